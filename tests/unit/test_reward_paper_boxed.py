"""The GTPO paper's reward in its \\boxed{} form (reward.fn: gtpo_boxed) and the reward ranges that
put GTPO's gamma on the reward's scale.

Injected bugs, each seen failing once: an empty box accepted as an answer (the first paper-reward
study's policies learned to end with one); text after the box still paid the full format term.
"""

from __future__ import annotations

import pytest

from megatron_gtpo.reward.config import REWARD_RANGES
from megatron_gtpo.reward.functions import REWARDS, boxed_format_score, gtpo_boxed_reward


@pytest.mark.parametrize("text, score", [
    ("so 3 + 4 = 7, the answer is \\boxed{7}.", 10.0),
    ("$\\boxed{-5}$\n", 10.0),
    ("\\[\\boxed{12}\\]", 10.0),
    ("the answer is \\boxed{1{2}} and that is all", 1.0),
    ("the answer is \\boxed{}", 0.0),                      # the template's own empty box
    ("the answer is \\boxed{  } .", 0.0),
    ("\\boxed{7} or rather \\boxed{}", 0.0),              # the last box decides
    ("the answer is \\boxed{4", 0.0),                     # truncated: the brace never closes
    ("the answer is 7", 0.0),
])
def test_format_term(text, score):
    assert boxed_format_score(text) == score


def test_correct_answers_earn_the_second_ten_only_with_the_full_format():
    assert gtpo_boxed_reward("2 + 3 = 5, so \\boxed{5}", "#### 5", "gsm8k").reward == 20.0
    late = gtpo_boxed_reward("\\boxed{5} is it, I think", "#### 5", "gsm8k")
    assert (late.reward, late.correct) == (1.0, True)
    assert gtpo_boxed_reward("so \\boxed{6}", "#### 5", "gsm8k").reward == 10.0


def test_every_built_in_reward_has_a_range():
    assert set(REWARD_RANGES) == set(REWARDS)
