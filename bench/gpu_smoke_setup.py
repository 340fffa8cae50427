"""Building blocks of ``bench/gpu_smoke.py``: the smoke's config, model config, synthetic batch,
policy builder, the calls into the package's train-step API (one GTPO step, the no-grad
log-prob pass, greedy decoding), and which parts can run on this machine.

Everything here runs on a CPU too (``gpu_smoke.py --dry`` uses it in CI); nothing touches CUDA
before ``build_policy``.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch

from megatron_gtpo.utils.configuration import require

PARTS = ("logprob", "local", "checkpoint", "optim_state", "offload", "export", "te_bf16", "te_fp8", "te_packed",
         "vllm")
NEEDS = {"checkpoint": ("local",), "optim_state": ("local",), "offload": ("local",), "export": ("local",), "te_bf16": ("checkpoint",),
         "te_fp8": ("checkpoint",), "te_packed": ("checkpoint",), "vllm": ("local",)}
"""Parts that use what an earlier part built (the local model, the step-1 checkpoint and its log-probs)."""
TINY = dict(layers=2, hidden=128, heads=4, kv_heads=2, ffn=256, vocab=512, seq=64, rows=8, micro_batch=4, steps=2,
            shared_prefix=4)
"""``--tiny``: a model and batch small enough for 2 CPU cores (the CPU check of this script)."""
PAD_ID, EOS_ID = 0, 2
"""Special token ids of the synthetic model (``hf_config``); data tokens are drawn from 3 .. vocab - 1."""


@dataclass(kw_only=True)
class SmokeConfig:
    """What the smoke builds and runs (the command line, validated before anything starts)."""

    layers: int = 8
    """Transformer layers."""
    hidden: int = 1024
    """Hidden size."""
    heads: int = 16
    """Attention heads (head dim = hidden / heads)."""
    kv_heads: int = 4
    """Key/value heads (GQA groups)."""
    ffn: int = 4096
    """SwiGLU intermediate size."""
    vocab: int = 49152
    """Vocabulary size (SmolLM2's)."""
    seq: int = 1024
    """Sequence length (prompt + completion); a multiple of 16 for FP8."""
    rows: int = 32
    """Sequences in the global batch."""
    group: int = 4
    """Completions per prompt (GTPO's G)."""
    micro_batch: int = 4
    """Sequences per micro-batch."""
    steps: int = 3
    """Train steps of the local model (>= 2: step 1 is checkpointed, step 2 is the reference)."""
    shared_prefix: int = 32
    """Completion tokens every completion of a group starts with (GTPO forward conflict runs; each
    completion also ends with EOS, a backward run of at least 1)."""
    init_std: float = 0.05
    """Megatron ``init_method_std``: wide enough that the random model's log-probs are far from uniform."""
    lr: float = 1e-3
    """Adam learning rate: large enough that bf16 weights visibly change in each step."""
    fp8_recipe: str = "tensorwise"
    """Megatron ``fp8_recipe`` for te_fp8: tensorwise (current scaling) or delayed; Hopper runs both."""
    device: str = "cuda"
    """cuda (NCCL, bf16) or cpu (gloo, the CPU shims): the latter only checks this script."""
    skip: tuple[str, ...] = ()
    """Parts not to run (names from PARTS)."""
    workdir: str | None = None
    """Where the checkpoint and the HF config go (a temporary folder inside it, removed at the end)."""
    seed: int = 0
    """Seed of the model, the batch and the logits."""

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "rows", "group", "micro_batch"):
            require(getattr(self, name) >= 1, name, getattr(self, name), "an integer >= 1")
        require(self.hidden % self.heads == 0, "hidden", self.hidden, f"a multiple of heads={self.heads}")
        require(self.seq >= 16 and self.seq % 16 == 0, "seq", self.seq, "a multiple of 16, at least 16")
        require(self.rows % self.group == 0, "rows", self.rows, f"a multiple of group={self.group}")
        require(self.rows % self.micro_batch == 0, "rows", self.rows, f"a multiple of micro_batch={self.micro_batch}")
        require(self.steps >= 2, "steps", self.steps, "an integer >= 2 (step 1 is saved, step 2 is compared)")
        shortest = self.completion_width // 4  # see synthetic_batch
        require(0 <= self.shared_prefix < shortest, "shared_prefix", self.shared_prefix,
                f"0 .. {shortest - 1} (below the shortest completion, (seq - seq // 8) // 4)")
        require(self.vocab >= 8, "vocab", self.vocab, "an integer >= 8")
        require(self.fp8_recipe in ("tensorwise", "delayed"), "fp8_recipe", self.fp8_recipe, "tensorwise or delayed")
        require(self.device in ("cuda", "cpu"), "device", self.device, "cuda or cpu")
        unknown = sorted(set(self.skip) - set(PARTS))
        require(not unknown, "skip", ",".join(unknown), f"names from {', '.join(PARTS)}")

    @property
    def prompt_tokens(self) -> int:
        """Prompt length of every row: an eighth of ``seq``."""
        return self.seq // 8

    @property
    def completion_width(self) -> int:
        """Longest completion (the first row of each micro-batch): prompt + completion fill ``seq``."""
        return self.seq - self.prompt_tokens


def hf_config(cfg: SmokeConfig) -> dict:
    """A Llama-shaped HF ``config.json`` (SwiGLU, RMSNorm, GQA, untied) for the Megatron builder and vLLM."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": cfg.hidden,
            "intermediate_size": cfg.ffn, "num_hidden_layers": cfg.layers, "num_attention_heads": cfg.heads,
            "num_key_value_heads": cfg.kv_heads, "vocab_size": cfg.vocab, "max_position_embeddings": cfg.seq,
            "rms_norm_eps": 1e-5, "hidden_act": "silu", "tie_word_embeddings": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
            "bos_token_id": 1, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}


def synthetic_batch(cfg: SmokeConfig):
    """The global ``Batch`` (completion view, built by the trainer's own ``collate`` from scored
    groups): ``rows`` completions in groups of ``group``, one prompt of ``seq // 8`` tokens per group,
    completions of varied length that share their first ``shared_prefix`` tokens within the group and
    end with EOS, so GTPO finds conflict runs at both ends; rewards alternate 1/0 inside each group.
    The first row of every micro-batch has the longest completion, so prompt + completion fill
    ``seq`` and each micro-batch's model input is ``[micro_batch, seq]`` (FP8 needs multiples of 16)."""
    from megatron_gtpo.train.batching import collate
    from megatron_gtpo.types import Completion, Prompt, ScoredGroup

    g = torch.Generator().manual_seed(cfg.seed)
    groups, width = cfg.rows // cfg.group, cfg.completion_width
    prompts = torch.randint(3, cfg.vocab, (groups, cfg.prompt_tokens), generator=g)
    completions = torch.randint(3, cfg.vocab, (cfg.rows, width), generator=g)
    completions[:, :cfg.shared_prefix] = torch.randint(3, cfg.vocab, (groups, width), generator=g).repeat_interleave(
        cfg.group, dim=0)[:, :cfg.shared_prefix]
    lengths = torch.randint(width // 4, width + 1, (cfg.rows,), generator=g)
    lengths[:: cfg.micro_batch] = width
    completions[torch.arange(cfg.rows), lengths - 1] = EOS_ID
    rewards = (torch.arange(cfg.rows) % 2 == 0).float()
    scored = []
    for gi in range(groups):
        prompt = Prompt(uid=f"smoke-{gi}", token_ids=prompts[gi].tolist())
        rows = range(gi * cfg.group, (gi + 1) * cfg.group)
        outputs = [Completion(prompt_index=gi, prompt_token_ids=prompt.token_ids,
                              token_ids=completions[r, :lengths[r]].tolist(), logprobs=[-1.0] * int(lengths[r]))
                   for r in rows]
        scored.append(ScoredGroup(prompt=prompt, completions=outputs, rewards=[float(rewards[r]) for r in rows]))
    return collate(scored, pad_id=PAD_ID)


def param_count(hf: dict) -> int:
    """Parameters of the untied Llama described by ``hf`` (embedding, layers, final norm, lm_head)."""
    h, f, layers = hf["hidden_size"], hf["intermediate_size"], hf["num_hidden_layers"]
    kv = h // hf["num_attention_heads"] * hf["num_key_value_heads"]
    per_layer = h * h * 2 + 2 * h * kv + 3 * h * f + 2 * h
    return 2 * hf["vocab_size"] * h + layers * per_layer + h


@dataclass(kw_only=True)
class Policy:
    """A Megatron model with its optimizer and LR schedule, as the train step takes them."""

    chunks: list
    """DDP-wrapped model chunks (one: no virtual pipeline)."""
    optimizer: object
    """Megatron optimizer (mixed precision, fp32 main params)."""
    scheduler: object
    """Megatron ``OptimizerParamScheduler``."""


def build_policy(cfg: SmokeConfig, hf: dict, dims, *, use_te: bool, overrides: dict | None = None,
                 distributed_optimizer: bool = False) -> Policy:
    """Model (seeded random weights), Megatron DDP and Adam, as the trainer builds them
    (``distributed_optimizer``: Megatron's DistributedOptimizer, as every GPU recipe uses)."""
    from megatron_gtpo.train.model import build_model
    from megatron_gtpo.train.optim import OptimConfig, build_optimizer, wrap_ddp

    torch.manual_seed(cfg.seed)
    optim = OptimConfig(optimizer={**OptimConfig().optimizer, "lr": cfg.lr,
                                   "use_distributed_optimizer": distributed_optimizer})
    model = build_model(hf, dims=dims, dtype=torch.bfloat16, use_te=use_te,
                        overrides={"init_method_std": cfg.init_std, **(overrides or {})})
    chunks = wrap_ddp(model, optim)
    optimizer, scheduler = build_optimizer(chunks, optim, total_steps=cfg.steps + 2)
    return Policy(chunks=chunks, optimizer=optimizer, scheduler=scheduler)


def step_settings(cfg: SmokeConfig):
    """``StepSettings`` of every train step and log-prob pass here: GTPO with the entropy filter
    disabled (threshold 777: every row trains), temperature 1, micro-batch lengths padded on CUDA
    to what the te_fp8 part's recipe needs at TP=1 (train/model.py ``padding_multiple``, the rule
    the trainer uses; 16 for tensorwise/delayed, never past the batch's longest row, ``seq``).
    Pure: no CUDA call."""
    from megatron_gtpo.algo import AlgoConfig
    from megatron_gtpo.train.model import padding_multiple
    from megatron_gtpo.train.step import StepSettings

    spec = AlgoConfig(name="gtpo", entropy_threshold=777.0).resolve(max_completion_tokens=cfg.completion_width)
    pad = padding_multiple(recipe=cfg.fp8_recipe, tp=1, sequence_parallel=False) if cfg.device == "cuda" else 1
    return StepSettings(spec=spec, micro_batch_size=cfg.micro_batch, temperature=1.0, pad_to_multiple=pad)


def gtpo_train_step(policy: Policy, batch, settings, dims) -> dict[str, float]:
    """One GTPO rollout step (``spec.mu`` = 1 optimizer step) through the package's train-step API.
    Returns its metrics (``loss``, ``optim/*``, ``gtpo/*`` ...; names in megatron_gtpo/metrics.py)."""
    from megatron_gtpo.train.step import train_step

    return train_step(policy, batch, settings, dims)


def token_stats(chunks: list, batch, settings, dims):
    """The no-grad pass the train step uses for pi_old: ``ForwardStats`` (logp, entropy [B, T] in the
    completion view, <H>_i [B]) of every row (world of 1: this rank holds the whole batch)."""
    from megatron_gtpo.train.step import forward_stats, logprob_settings, process_groups, rank_micro_batches

    rows, mbs = rank_micro_batches(batch, settings, dims)
    stats = forward_stats(chunks, batch, mbs, logprob_settings(settings, dims, process_groups(), chunks))
    if stats is None or stats.logp.shape != batch.token_ids.shape or rows != slice(0, batch.size):
        raise RuntimeError(f"forward_stats of rows {rows} gave {None if stats is None else tuple(stats.logp.shape)}, "
                           f"expected the whole batch {tuple(batch.token_ids.shape)} (the smoke is a world of 1)")
    return stats


@torch.no_grad()
def next_token_logits(chunks: list, sequences: list[list[int]], dims, *, vocab_size: int) -> list[torch.Tensor]:
    """Megatron's fp32 logits ``[len(seq), vocab_size]`` at every position of each sequence (one
    full forward each, the forward-only schedule; row j predicts token j + 1). One pipeline stage
    and one tensor-parallel rank (the smoke's world of 1): the whole vocabulary is here."""
    from megatron_gtpo.parallel.collectives import comm_device
    from megatron_gtpo.train.batching import MicroBatch
    from megatron_gtpo.train.step import run_schedule

    if dims.pp != 1 or dims.tp != 1:
        raise ValueError(f"next_token_logits runs a world of 1, got tp={dims.tp} pp={dims.pp}")
    device, out = comm_device(), []

    def keep(mb, logits):
        return logits.new_zeros(()), {"logits": logits[0, :, :vocab_size].float().cpu()}

    for seq in sequences:
        ids = torch.tensor([seq], dtype=torch.long, device=device)
        one = torch.ones(1, dtype=torch.long, device=device)
        mb = MicroBatch(rows=torch.zeros(1, dtype=torch.long), input_ids=ids, start=one, lengths=one, width=1,
                        position_ids=torch.arange(ids.shape[1], device=device)[None, :])
        out.append(run_schedule(chunks, [mb], keep, forward_only=True)[0]["logits"])
    return out


def absent_reason(part: str, cfg: SmokeConfig, *, dry: bool) -> str | None:
    """Why ``part`` cannot run on this machine (None: it runs). ``dry`` only looks for the packages."""
    if part in cfg.skip:
        return "left out with --skip"
    if part in ("te_bf16", "te_fp8", "te_packed"):
        return _te_absent(part, cfg, dry=dry)
    if part == "vllm":
        if dry:
            return None if importlib.util.find_spec("vllm") else "vllm is not installed"
        try:
            import vllm  # noqa: F401
        except Exception as err:  # noqa: BLE001 - any import failure means the part cannot run
            return f"vllm does not import ({type(err).__name__}: {err})"
    return None


def _te_absent(part: str, cfg: SmokeConfig, *, dry: bool) -> str | None:
    if dry:
        if not importlib.util.find_spec("transformer_engine"):
            return "transformer_engine is not installed"
        return None
    if cfg.device != "cuda":
        return "Transformer Engine needs CUDA (this run is --device cpu)"
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as err:  # noqa: BLE001 - a missing core library raises OSError, not ImportError
        return f"transformer_engine.pytorch does not import ({type(err).__name__}: {err})"
    from megatron_gtpo.train.model import te_available

    if not te_available():
        return "megatron-core does not see Transformer Engine (gpt_layer_specs.HAVE_TE is False)"
    major, minor = torch.cuda.get_device_capability()
    if part == "te_fp8" and major < 9:
        return f"compute capability {major}.{minor} < 9.0 (FP8 needs Hopper or newer)"
    return None
