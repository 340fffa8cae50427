"""Reward functions that take the prompt and the dataset row (issue 36): a user function declaring
``prompt`` and/or ``row`` gets them, read from its signature once at load; one declaring neither is
called as before. The rows come from a real jsonl file through the data loader."""

from __future__ import annotations

import json

import pytest

from megatron_gtpo.data.dataset import build_prompts
from megatron_gtpo.data.sources import FieldMap, read_examples
from megatron_gtpo.reward import RewardConfig, RewardScorer, score_groups
from megatron_gtpo.reward.functions import context_args, resolve_reward
from megatron_gtpo.types import Completion
from tests.unit.data_tokenizer import tiny_tokenizer

PLUGIN = "tests.unit.reward_plugins"


@pytest.fixture
def prompts(tmp_path):
    """Two prompts of a jsonl file with an extra column (``points``) the prompt template never shows."""
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [{"question": "Name a colour: red", "answer": "1",
                                                             "points": 3},
                                                            {"question": "Name a fruit: plum", "answer": "2",
                                                             "points": 5}]))
    examples = read_examples(path, fields=FieldMap(), task="gsm8k")
    built, _ = build_prompts(examples, tokenizer=tiny_tokenizer(), template="plain", use_chat_template=False)
    return built


def _completions(texts_per_prompt: list[list[str]]) -> list[Completion]:
    return [Completion(prompt_index=i, prompt_token_ids=[1], token_ids=[1, 2], logprobs=[0.0, 0.0], text=t)
            for i, texts in enumerate(texts_per_prompt) for t in texts]


def test_the_signature_says_what_a_reward_function_gets():
    """Injected bug: ``context_args`` without its ``**kwargs`` branch -> kwargs_reward gets (), fails."""
    assert context_args(resolve_reward(f"{PLUGIN}.length_reward")) == ()
    assert context_args(resolve_reward(f"{PLUGIN}.prompt_reward")) == ("prompt",)
    assert context_args(resolve_reward(f"{PLUGIN}.row_reward")) == ("prompt", "row")
    assert context_args(resolve_reward(f"{PLUGIN}.kwargs_reward")) == ("prompt", "row")
    assert context_args(resolve_reward("correctness")) == ()


@pytest.mark.parametrize("num_workers", [0, 1], ids=["inline", "worker"])
def test_reward_functions_get_the_prompt_and_the_row(prompts, num_workers):
    """The prompt text and every column of the row reach the function, in the scoring worker too.
    Injected bug: ``score_one`` calling ``fn(text, gold, task)`` without the context -> prompt_reward
    raises TypeError, scores 0 as an error, fails."""
    completions = _completions([["red again", "blue"], ["plum", "PLUM"]])
    for fn, want in ((f"{PLUGIN}:prompt_reward", [1.0, 0.0, 1.0, 0.0]),
                     (f"{PLUGIN}:row_reward", [3.5, 3.5, 5.5, 5.5]),
                     (f"{PLUGIN}:kwargs_reward", [1.0] * 4)):
        config = RewardConfig(fn=fn, num_workers=num_workers, start_method="fork")
        batch = score_groups(prompts, completions, config=config)
        assert batch.stats.num_errors == 0, fn
        assert [r for g in batch.groups for r in g.rewards] == want, fn


def test_a_reward_function_without_them_is_called_as_before(prompts):
    """A plain ``fn(completion, gold, task)`` gets no extra keyword (it would raise TypeError) and the
    scorer sends its workers nothing more. Injected bug: contexts always built -> length_reward gets
    prompt=/row=, errors, fails."""
    completions = _completions([["abcd"], ["ab"]])
    with RewardScorer(RewardConfig(fn=f"{PLUGIN}:length_reward", num_workers=1, start_method="fork")) as scorer:
        assert scorer.context_args == () and scorer._contexts(prompts, 2) is None
        batch = score_groups(prompts, completions, scorer=scorer)
    assert batch.stats.num_errors == 0 and [g.rewards for g in batch.groups] == [[1.0], [0.5]]


def test_a_function_that_declares_them_needs_the_prompts():
    """Calling ``score`` without prompts for such a function is refused, naming reward.fn and the fix."""
    with RewardScorer(RewardConfig(fn=f"{PLUGIN}:prompt_reward", num_workers=0)) as scorer:
        with pytest.raises(ValueError, match=r"reward.fn=.*prompt_reward.* declares prompt: score\(\) needs prompts="):
            scorer.score([("a", "1", "gsm8k")])
