"""Typed records handed from one stage of a training step to the next.

    Prompt --rollout--> Completion --reward--> ScoredGroup --collect--> RolloutBatch
    RolloutBatch.groups --collate--> Batch --learner.step--> metrics --weight sync--> engines

Every record is a plain dataclass; tensor fields carry their shape in a comment (``B`` completions
of the global batch, ``T`` the longest completion, ``P`` the longest prompt).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass(kw_only=True)
class Prompt:
    """One prompt as the rollout engine receives it (chat template already applied)."""

    uid: str
    """Stable id (dataset name + row index); used for resumable cursors and eval reports."""
    token_ids: list[int]
    """Prompt tokens after the chat template, exactly what the engine is given."""
    text: str = ""
    """The rendered prompt text (for logs and sample tables)."""
    gold: str = ""
    """Reference answer in the task's own format (GSM8K '#### N' solution, MATH LaTeX, choice letter)."""
    task: str = "gsm8k"
    """Task name that selects the answer checker: gsm8k, math, aime, amc, mmlu."""
    row: dict = field(default_factory=dict)
    """The dataset row the prompt was built from (all its columns); handed to a reward function that
    declares a ``row`` parameter (``reward/functions.py``)."""


@dataclass(kw_only=True)
class Completion:
    """One sampled completion of one prompt, as returned by the rollout engine."""

    prompt_index: int
    """Index of the prompt in the list passed to ``generate``; completions of one prompt form a group."""
    prompt_token_ids: list[int]
    """The prompt's tokens (same list object for a whole group)."""
    token_ids: list[int]
    """Sampled completion tokens, including the stop/EOS token when generation stopped on it."""
    logprobs: list[float]
    """Sampler log-prob of each completion token (after temperature), len == len(token_ids)."""
    text: str = ""
    """Detokenized completion."""
    finish_reason: str = "stop"
    """'stop' (EOS or stop token) or 'length' (hit max_tokens)."""
    truncated: bool = False
    """True when generation hit max_tokens without stopping."""
    weight_version: int = 0
    """Version of the policy weights that sampled this completion's first token (see sync/); with
    partial rollouts the oldest of its ``token_versions``."""
    token_versions: list[int] | None = None
    """Version of the weights that sampled each token, len == len(token_ids), never decreasing (a
    request continued across weight pushes, ``rollout.partial: continue``); None: every token is
    ``weight_version``'s."""
    routed_experts: np.ndarray | None = None  # [len(prompt) + len(completion) - 1, moe layers, top_k] int16
    """Mixture-of-experts engines asked for routing (``model.moe_routing_replay: rollout``): the
    experts the engine routed each fed token to, prompt then completion (the last sampled token is
    never fed); None otherwise."""

    def versions(self) -> list[int]:
        """The weight version of each token (``token_versions``, else ``weight_version`` for all)."""
        if self.token_versions is None:
            return [self.weight_version] * len(self.token_ids)
        return list(self.token_versions)

    def version_counts(self) -> dict[int, int]:
        """Tokens per weight version that sampled them, without a list per token (the collector's
        per-step checks and metrics): ``{weight_version: tokens}``, empty for an empty completion."""
        if self.token_versions is None:
            return {self.weight_version: len(self.token_ids)} if self.token_ids else {}
        return dict(Counter(self.token_versions))


@dataclass(kw_only=True)
class ScoredGroup:
    """The G completions of one prompt with their rewards."""

    prompt: Prompt
    completions: list[Completion]
    rewards: list[float]
    """Scalar reward per completion (used for advantages)."""
    correct: list[bool] = field(default_factory=list)
    """Answer correctness per completion (accuracy metric; DAPO's dynamic-sampling filter)."""


@dataclass(kw_only=True)
class RolloutBatch:
    """The groups one training step trains on, with what it took to get them."""

    groups: list[ScoredGroup]
    """Kept groups (DAPO's dynamic sampling may have dropped and refilled)."""
    tries: int = 1
    """Rollout batches generated for this step."""
    dropped_groups: int = 0
    """Groups dropped by dynamic sampling (all-equal accuracy/reward) or to keep the batch divisible."""
    reward_stats: dict[str, float] = field(default_factory=dict)
    """Scoring counters summed over the tries (num_samples, timeouts, errors, overlong)."""
    rollout_s: float = 0.0
    """Wall time this step's collect spent in generate calls (submitting and waiting). Off-policy:
    colocated engines generate a later step's batch in it too; a pool's background generation is
    not in it (with ``rollout.staleness`` <= 1 and no partial rollouts the push after the step waits
    for it)."""
    reward_s: float = 0.0
    """Wall time spent scoring."""
    staleness: int = 0
    """Most weight pushes between the policy that sampled a kept token and the one the step trains
    from: at most the ``rollout.staleness`` setting (megatron_gtpo/rollout/staleness.py)."""
    staleness_mean: float = 0.0
    """Mean of that over the kept tokens."""
    reward_errors: list = field(default_factory=list)
    """Distinct reward-function failures first seen during this step (``reward.failures.RewardError``,
    with traceback; rank 0 only): the reporter saves them as an artifact."""


@dataclass(kw_only=True)
class Batch:
    """A global training batch in the completion view, built once per step by ``train.batching.collate``.

    Row ``b`` is one completion; every rank holds the whole record (token ids and rewards are small)
    and trains on its own data-parallel rows. The model input ``[mb, S]`` (prompt + completion) is
    made per micro-batch; the completion view is what ``algo/`` works in.
    """

    prompt_ids: torch.Tensor  # [B, P] long: prompt tokens, left-aligned, right-padded with pad_id
    prompt_lengths: torch.Tensor  # [B] long: tokens of each prompt (where its completion starts)
    token_ids: torch.Tensor  # [B, T] long: completion tokens, left-aligned, right-padded with pad_id
    mask: torch.Tensor  # [B, T] bool: True on the first |o_b| columns (the loss tokens, EOS included)
    sampler_logprobs: torch.Tensor  # [B, T] float: engine log-probs of the completion tokens, 0 elsewhere
    rewards: torch.Tensor  # [B] float
    group_ids: torch.Tensor  # [B] long: which prompt each row came from
    pad_id: int = 0
    """Token id used for padding."""
    routed_experts: torch.Tensor | None = None  # [B, S, moe layers, top_k] int16, sequence view, -1: not fed
    """The engine's routed experts of every fed token (prompt then completion; ``train/routing.py``),
    or None (dense policy, or an engine that returned none)."""

    @property
    def lengths(self) -> torch.Tensor:  # [B] long
        """Completion lengths ``|o_b|``."""
        return self.mask.sum(dim=1)

    @property
    def size(self) -> int:
        """B: completions in the global batch."""
        return int(self.mask.shape[0])
