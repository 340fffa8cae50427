"""A verifiable toy reward that a tiny random policy can learn in a few steps.

``alphabet_count`` counts the letters a..m (case-folded) in a completion: ``min(1, count / 16)``.
A random policy over the character-level tiny model (``model.path: tiny-char``) starts near 0.3
with real spread between completions, so group-relative advantages are non-zero from step one,
and a working loss must raise the mean reward within a bounded number of steps
(tests/e2e/test_train.py). Counting (rather than a share) keeps the optimum away from the trivial
"stop at once" policy. It is the user-reward extension point in action: recipes name it by dotted
path, ``reward.fn: megatron_gtpo.reward.toy.alphabet_count``.
"""

from __future__ import annotations

from megatron_gtpo.reward.functions import RewardOutput

TARGET = 16
"""Letters a..m needed for the full reward."""


def alphabet_count(completion: str, gold: str, task: str) -> RewardOutput:
    """``min(1, #letters in a..m / 16)``; ``correct`` when the reward is at least 0.5."""
    count = sum("a" <= ch <= "m" for ch in completion.lower())
    reward = min(1.0, count / TARGET)
    return RewardOutput(reward=reward, correct=reward >= 0.5)
