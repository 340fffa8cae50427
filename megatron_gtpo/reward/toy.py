"""A verifiable toy reward that a tiny random policy can learn in a few steps.

``alphabet_share`` scores a completion by the share of its ASCII letters that lie in a..m. A
randomly initialised policy over a 49k-token vocabulary starts near 0.5 with real spread between
completions, so group-relative advantages are non-zero from step one and a working loss must
raise the mean reward within a bounded number of steps (tests/e2e/test_learning.py). It is the
user-reward extension point in action: recipes name it by dotted path,
``reward.fn: megatron_gtpo.reward.toy.alphabet_share``.
"""

from __future__ import annotations

from megatron_gtpo.reward.functions import RewardOutput


def alphabet_share(completion: str, gold: str, task: str) -> RewardOutput:
    """Share of letters in a..m (case-folded) among all ASCII letters; 0 when there are none.
    ``correct`` is True when more than half of the letters are in a..m."""
    letters = [ch for ch in completion.lower() if "a" <= ch <= "z"]
    share = sum(ch <= "m" for ch in letters) / len(letters) if letters else 0.0
    return RewardOutput(reward=share, correct=share > 0.5)
