"""Verifiable rewards: answer extraction, checking, named reward functions and parallel scoring.

    completion text --extract.py--> answer span --verify.py--> correct?  (is_correct)
                    --functions.py--> reward (correctness | format | gtpo | dapo | user path)
    prompts + completions --score.py (pool.py workers, per-sample timeout)--> ScoredGroups

Importing this package does not import torch: scoring workers import it, and ``score_groups``
(which needs ``megatron_gtpo.types``) is loaded on first use.
"""

from __future__ import annotations

from megatron_gtpo.reward.config import RewardConfig
from megatron_gtpo.reward.extract import extract_answer, gold_answer
from megatron_gtpo.reward.functions import REWARDS, RewardOutput, overlong_penalty, paper_format_score
from megatron_gtpo.reward.failures import RewardError, RewardFunctionFailing
from megatron_gtpo.reward.pool import RewardFunctionCrashed, SampleScore, ScoringPool
from megatron_gtpo.reward.verify import TASKS, Judgement, is_correct, judge

_LAZY = {"score_groups", "RewardScorer", "ScoredBatch", "ScoringStats"}

__all__ = ["REWARDS", "TASKS", "Judgement", "RewardConfig", "RewardError", "RewardFunctionCrashed",
           "RewardFunctionFailing", "RewardOutput", "SampleScore", "ScoringPool",
           "extract_answer", "gold_answer", "is_correct", "judge", "overlong_penalty", "paper_format_score",
           *sorted(_LAZY)]


def __getattr__(name: str):
    if name in _LAZY:
        from megatron_gtpo.reward import score

        return getattr(score, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
