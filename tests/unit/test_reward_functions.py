"""Named reward functions: the paper's format/10+10 scheme, DAPO's +-1 and overlong punishment,
and resolution of user rewards by dotted path."""

import pytest

from megatron_gtpo.reward import REWARDS, RewardConfig, RewardOutput, overlong_penalty, paper_format_score
from megatron_gtpo.reward.functions import as_output, resolve_reward, reward_path
from megatron_gtpo.utils.configuration import ConfigError, build

GOLD = "#### 18"
FULL_RIGHT = "<reasoning>9 * 2</reasoning>\n<answer>18</answer>"
FULL_WRONG = "<reasoning>9 * 3</reasoning>\n<answer>27</answer>"


@pytest.mark.parametrize("text,score", [
    (FULL_RIGHT, 10.0),
    (FULL_RIGHT + "\n", 10.0),  # trailing whitespace after the answer block is fine
    ("<reasoning>r</reasoning><answer>18</answer> and more text", 1.5),  # answer block does not end the text
    ("<reasoning>r</reasoning> the answer is 18", 1.0),
    ("<answer>18</answer>", 1.0),
    ("<reasoning> unclosed <answer>18</answer>", 1.5),
    ("just 18", 0.0),
])
def test_paper_format_score(text, score):
    assert paper_format_score(text) == score


@pytest.mark.parametrize("text,reward,correct", [
    (FULL_RIGHT, 20.0, True),
    (FULL_WRONG, 10.0, False),
    ("<answer>18</answer>", 1.0, True),  # correct but badly formatted: no correctness bonus
    ("<reasoning>r</reasoning><answer>18</answer> trailing", 1.5, True),
    ("the answer is 18", 0.0, True),
    ("nothing", 0.0, False),
])
def test_gtpo_reward_values(text, reward, correct):
    out = REWARDS["gtpo"](text, GOLD, "gsm8k")
    assert (out.reward, out.correct) == (reward, correct)


def test_correctness_format_and_dapo():
    assert REWARDS["correctness"](FULL_RIGHT, GOLD, "gsm8k") == RewardOutput(reward=1.0, correct=True)
    assert REWARDS["correctness"](FULL_WRONG, GOLD, "gsm8k") == RewardOutput(reward=0.0, correct=False)
    assert REWARDS["format"](FULL_WRONG, GOLD, "gsm8k") == RewardOutput(reward=1.0, correct=False)
    assert REWARDS["format"]("\\boxed{18}", GOLD, "gsm8k") == RewardOutput(reward=0.0, correct=True)
    assert REWARDS["dapo"](FULL_RIGHT, GOLD, "gsm8k").reward == 1.0
    assert REWARDS["dapo"](FULL_WRONG, GOLD, "gsm8k").reward == -1.0


def test_overlong_penalty_matches_spec_invariants():
    # docs/algorithms.md section 10, item 7: 0, -0.5, -1 at L_max - L_cache, L_max - L_cache/2, L_max + 1
    L_max, L_cache = 20480, 4096
    assert overlong_penalty(L_max - L_cache, max_tokens=L_max, cache_tokens=L_cache) == 0.0
    assert overlong_penalty(L_max - L_cache // 2, max_tokens=L_max, cache_tokens=L_cache) == -0.5
    assert overlong_penalty(L_max, max_tokens=L_max, cache_tokens=L_cache) == -1.0
    assert overlong_penalty(L_max + 1, max_tokens=L_max, cache_tokens=L_cache) == -1.0
    assert overlong_penalty(10, max_tokens=L_max, cache_tokens=L_cache) == 0.0
    assert overlong_penalty(L_max - L_cache // 4, max_tokens=L_max, cache_tokens=L_cache, factor=2.0) == -1.5
    with pytest.raises(ValueError, match="cache_tokens"):
        overlong_penalty(5, max_tokens=10, cache_tokens=0)


def test_user_reward_by_dotted_path():
    for path in ("tests.unit.reward_plugins.length_reward", "tests.unit.reward_plugins:length_reward"):
        fn = resolve_reward(path)
        out = as_output(fn("abcd", GOLD, "gsm8k"), "abcd", GOLD, "gsm8k")
        assert out == RewardOutput(reward=1.0, correct=False)
    assert reward_path("gtpo") == "megatron_gtpo.reward.functions:gtpo_reward"


@pytest.mark.parametrize("path,message", [
    ("nosuchreward", "neither a built-in reward"),
    ("no_such_module_xyz.fn", "could not be imported"),
    (f"{__name__}.missing_fn", "could not be imported"),
    (f"{__name__}.GOLD", "not a function"),
])
def test_bad_user_reward_is_explained(path, message):
    with pytest.raises(ValueError, match=message):
        resolve_reward(path)


def test_as_output_rejects_non_numbers():
    with pytest.raises(TypeError, match="finite float"):
        as_output("1.0", "x", GOLD, "gsm8k")
    with pytest.raises(TypeError, match="finite float"):
        as_output(float("inf"), "x", GOLD, "gsm8k")
    assert as_output(True, "x", GOLD, "gsm8k").reward == 1.0


@pytest.mark.parametrize("data,field", [
    ({"num_workers": -1}, "reward.num_workers"),
    ({"timeout_s": 0}, "reward.timeout_s"),
    ({"fn": " "}, "reward.fn"),
    ({"overlong_max_tokens": 100}, "unknown key reward.overlong_max_tokens"),  # one setting: algo.overlong_*
    ({"start_method": "thread"}, "reward.start_method"),
])
def test_reward_config_rejects_bad_values(data, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        build(RewardConfig, data, "reward")


def test_reward_config_defaults_are_valid():
    cfg = build(RewardConfig, {"fn": "dapo"}, "reward")
    assert cfg.fn == "dapo" and RewardConfig().fn == "correctness"
