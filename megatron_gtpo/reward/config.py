"""Configuration of reward scoring (the ``reward:`` block of a recipe)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from megatron_gtpo.utils.configuration import require


@dataclass(kw_only=True)
class RewardConfig:
    """How completions are turned into rewards (see ``megatron_gtpo.reward.score_groups``)."""

    fn: str = "correctness"
    """Reward function: a built-in name (``correctness`` 0/1, ``format`` 0/1 for the paper's tags,
    ``gtpo`` the paper's 10+10 scheme, ``dapo`` +1/-1) or a dotted import path of a user function
    ``fn(completion, gold, task) -> float | RewardOutput`` (``my_pkg.rewards.fn``), which may also
    declare ``prompt`` (the prompt text) and/or ``row`` (the dataset row) to receive them."""

    scale: float = 1.0
    """Factor phi on every reward (the function's value plus DAPO's overlong term), applied where the
    rewards are produced (``score_groups``). Spec 6 Prop. 2: under AdamW training is largely
    insensitive to phi; ``megatron-gtpo probe reward-scale`` measures it. Logged rewards are scaled too."""

    range: float | None = None
    """Spread (max - min) of the reward function's values before ``scale``: what GTPO's
    ``algo.entropy_gamma_relative`` measures gamma against. None = the built-in reward's (20 for
    ``gtpo``/``gtpo_boxed``, 1 for ``correctness``/``format``, 2 for ``dapo``); a user function that
    is used with ``entropy_gamma_relative`` must declare it."""

    num_workers: int = 2
    """Scoring worker processes (>= 1 recommended): a reward that hangs in C code is killed, and one
    that ends its process (os._exit, segfault) stops the run with RewardFunctionCrashed instead of
    taking a training rank down. 0 scores in the training process: in-process, no protection (a
    hang in C code hangs the rank, an os._exit ends it; the per-sample limit works only from the
    main thread)."""

    timeout_s: float = 10.0
    """Per-sample time limit in seconds; a sample over it scores 0 and is counted as a timeout."""

    chunk_size: int = 16
    """Samples sent to a worker at a time (amortises inter-process messages)."""

    start_method: Literal["spawn", "forkserver", "fork"] = "spawn"
    """How workers are started. ``spawn`` is safe next to CUDA and vLLM threads; ``fork`` starts
    fastest but only suits processes without CUDA or threads."""

    max_failed_batches: int = 3
    """Stop the run (RewardFunctionFailing) when every reward failed (error or timeout) in this many
    scoring batches in a row, instead of training on rewards that are all 0. One batch per step
    (DAPO's refill tries count one each); each all-failed batch logs a warning, as does one where more
    than half failed. 0 never stops."""

    def __post_init__(self) -> None:
        require(bool(self.fn.strip()), "fn", self.fn, "a built-in reward name or a dotted import path")
        require(isinstance(self.scale, (int, float)) and math.isfinite(self.scale) and self.scale > 0, "scale",
                self.scale, "a finite number > 0 (1 = the reward function's own values)")
        require(self.range is None or (isinstance(self.range, (int, float)) and math.isfinite(self.range)
                                       and self.range > 0), "range", self.range,
                "null (the built-in reward's) or the finite spread > 0 of the function's values")
        require(self.num_workers >= 0, "num_workers", self.num_workers, "an integer >= 0")
        require(math.isfinite(self.timeout_s) and self.timeout_s > 0, "timeout_s", self.timeout_s,
                "a number of seconds > 0")
        require(self.chunk_size >= 1, "chunk_size", self.chunk_size, "an integer >= 1")
        require(self.max_failed_batches >= 0, "max_failed_batches", self.max_failed_batches,
                "0 (never stop) or a number of batches >= 1")


REWARD_RANGES: dict[str, float] = {"correctness": 1.0, "format": 1.0, "gtpo": 20.0, "gtpo_boxed": 20.0, "dapo": 2.0}
"""Spread (max - min) of each built-in reward's values (``functions.REWARDS``, same names): the scale
GTPO's entropy shift is measured against (``algo.entropy_gamma_relative``; docs/algorithms.md
"Reward scale and the entropy shift"). Here, not in functions.py: the config must not import the judge."""


def reward_range(fn: str, declared: float | None) -> float | None:
    """The spread of reward ``fn``: ``declared`` (``reward.range``) when given, else the built-in's;
    None for a user function that declares none."""
    return declared if declared is not None else REWARD_RANGES.get(fn)
