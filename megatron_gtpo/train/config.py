"""``TrainConfig``: the ``train:`` block of a recipe (length of the run, batch geometry, checkpoints,
periodic evaluation)."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_gtpo.utils.configuration import require


@dataclass(kw_only=True)
class TrainConfig:
    """Length of the run, batch geometry, checkpoints and periodic evaluation (the ``train:`` block)."""

    steps: int = 100
    """Rollout steps (each: generate, score, mu optimizer steps, weight push)."""
    prompts_per_step: int = 1
    """Prompts per rollout step; the global batch is prompts_per_step * rollout.n completions.
    1 as the GTPO reference code (spec 5.10)."""
    micro_batch_size: int = 8
    """Completions per micro-batch on one DP rank (Megatron's micro-batch) on the padded path
    (``micro_batch_tokens: 0``); unused when packing."""
    micro_batch_tokens: int | None = None
    """Token budget of a packed micro-batch. Packing is the default: each DP rank's rows (prompt +
    completion) go back to back, padding-free, into micro-batches of at most this many tokens,
    balanced by token count, the same number of micro-batches on every DP rank (train/batching.py);
    loss and gradients equal the padded path's up to float rounding. null (default): the longest
    possible row, data.max_prompt_tokens + rollout.max_tokens, so a micro-batch never holds more
    tokens than one worst-case row (padded micro-batches hold up to micro_batch_size of them); on GPU
    a larger budget means fewer, fuller micro-batches. 0: the padded path, micro-batches of
    micro_batch_size rows, each padded to its longest row (with PP to the step's longest). An
    explicit budget must hold the longest possible row. On GPU with Transformer Engine the packed
    micro-batch goes in Megatron's THD format (PackedSeqParams; untested on GPU so far); with the
    local spec (CPU) as one row with a block-diagonal causal mask, whose attention costs
    O(budget^2): there the default is also the fastest (bench/packing.py)."""
    seed: int = 1234
    """Seed of model init, dropout RNG and sampling."""
    checkpoint_every: int = 10
    """Save a training checkpoint every N steps (and at the end, and on SIGTERM/SIGUSR1)."""
    keep_last: int = 2
    """Checkpoints kept on disk (older ones are deleted after a successful save)."""
    eval_every: int = 0
    """Greedy accuracy on held-out prompts every N steps (0 = never)."""
    eval_benchmark: str = "gsm8k"
    """Held-out benchmark for the periodic evaluation (test split names of data.benchmarks)."""
    eval_prompts: int = 16
    """Held-out prompts per periodic evaluation."""

    def __post_init__(self):
        for name in ("steps", "prompts_per_step", "micro_batch_size", "checkpoint_every", "keep_last",
                     "eval_prompts"):
            require(getattr(self, name) >= 1, name, getattr(self, name), "an integer >= 1")
        require(self.micro_batch_tokens is None or self.micro_batch_tokens >= 0, "micro_batch_tokens",
                self.micro_batch_tokens, "null (default budget), 0 (padded micro-batches) or a token budget")
        require(self.eval_every >= 0, "eval_every", self.eval_every, "0 (off) or an integer >= 1")

    @property
    def rows_per_micro_batch(self) -> int:
        """What each DP rank's rows must divide into: ``micro_batch_size`` rows (padded), or any
        count (1) when packing."""
        return self.micro_batch_size if self.micro_batch_tokens == 0 else 1

    def token_budget(self, longest_row: int) -> int:
        """``micro_batch_tokens`` resolved for rows of at most ``longest_row`` tokens (0: padded)."""
        return longest_row if self.micro_batch_tokens is None else self.micro_batch_tokens
