"""Every named choice an algorithm setting can take, spelled once.

The recipe's ``algo:`` block (``config.AlgoConfig``), the resolved record (``spec.AlgoSpec``) and the
functions that branch on a choice all use these ``Literal`` types; the tuples of allowed values
are read back from them with ``typing.get_args``, so a choice is never listed twice.
"""

from __future__ import annotations

from typing import Literal, get_args

AlgoName = Literal["gtpo", "grpo", "drgrpo", "dapo", "gspo", "cispo"]
"""GTPO (docs/algorithms.md section 5), GRPO (2), Dr. GRPO (3), DAPO (4), GSPO (13), CISPO (14)."""
Surrogate = Literal["clip", "gspo", "cispo"]
"""The per-token policy term (``losses.py``): PPO's clipped token ratio (GRPO, Dr. GRPO, DAPO, GTPO),
GSPO's clipped length-normalised sequence ratio, or CISPO's clipped and detached token IS weight."""
AggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
"""Loss aggregation modes (``aggregate.py``)."""
ConflictOverlap = Literal["product", "union"]
"""GTPO: weight where a positive completion's forward and backward conflict runs overlap."""
GtpoNormalization = Literal["code", "paper"]
"""GTPO per-completion normaliser: ``1/max(1, n_i)`` (code) or ``1/G`` (paper)."""
PromptReduction = Literal["mean", "sum"]
"""GTPO over several prompts: average or sum the per-prompt objectives."""
EntropyLogits = Literal["sampling", "raw"]
"""GTPO's <H>_i at the sampling temperature or on the raw logits (temperature 1)."""
MismatchMode = Literal["none", "tis", "mis"]
"""Train-inference mismatch correction (``importance.py``)."""
SamplingMetric = Literal["accuracy", "reward"]
"""DAPO dynamic sampling's per-completion filter value."""

ALGO_NAMES: tuple[str, ...] = get_args(AlgoName)
SURROGATES: tuple[str, ...] = get_args(Surrogate)
AGG_MODES: tuple[str, ...] = get_args(AggMode)
OVERLAP_MODES: tuple[str, ...] = get_args(ConflictOverlap)
NORMALIZATIONS: tuple[str, ...] = get_args(GtpoNormalization)
REDUCTIONS: tuple[str, ...] = get_args(PromptReduction)
MISMATCH_MODES: tuple[str, ...] = get_args(MismatchMode)
