"""Typed records handed from one stage to the next.

    Prompt --rollout--> Completion --reward--> ScoredGroup --advantage--> TrainBatch --train step--> StepMetrics

Every record is a plain dataclass; tensor fields carry their shape in a comment.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
    """Version of the policy weights that produced this completion (see sync/)."""


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
class TrainBatch:
    """A global rollout batch, padded, with everything the loss needs precomputed per sequence.

    Sequences are prompt + completion; only completion positions carry loss. Index ``b`` runs over
    all completions of all groups in the global batch (every DP rank holds the same object and
    takes its own slice).
    """

    input_ids: torch.Tensor  # [B, S] long: prompt + completion tokens, right-padded with pad_id
    loss_mask: torch.Tensor  # [B, S] float: 1 on completion tokens that carry loss (incl. EOS)
    position_ids: torch.Tensor  # [B, S] long
    group_ids: torch.Tensor  # [B] long: which prompt each row came from
    rewards: torch.Tensor  # [B] float
    advantages: torch.Tensor  # [B] float: unshaped group advantages (sign decides conflicts)
    sampler_logprobs: torch.Tensor  # [B, S] float: engine log-probs on completion positions, 0 elsewhere
    pad_id: int = 0
    """Token id used for padding."""
    completion_start: torch.Tensor | None = None  # [B] long: first completion position per row


@dataclass(kw_only=True)
class StepMetrics:
    """What one training step reports (flat name -> float), plus timings per stage."""

    step: int
    values: dict[str, float] = field(default_factory=dict)
    """Metric name (``reward/mean``, ``gtpo/conflict_tokens_per_completion``, ...) -> value."""
