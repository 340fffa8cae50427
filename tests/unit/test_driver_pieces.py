"""The driver's pure pieces: DAPO's group filter, rollout metrics, toy reward, atomic writes."""

from __future__ import annotations

import pytest
import torch

from megatron_gtpo.reward.toy import alphabet_count
from megatron_gtpo.rollout.collector import _dynamic_keep, rollout_metrics
from megatron_gtpo.types import Completion, Prompt, RolloutBatch, ScoredGroup
from megatron_gtpo.utils.atomic import atomic_directory, write_text_atomic


def group(uid: str, prompt: list[int], comps: list[list[int]], rewards: list[float], correct=None) -> ScoredGroup:
    p = Prompt(uid=uid, token_ids=prompt)
    cs = [Completion(prompt_index=0, prompt_token_ids=prompt, token_ids=c, logprobs=[-0.5 - 0.1 * i for i in range(len(c))])
          for c in comps]
    return ScoredGroup(prompt=p, completions=cs, rewards=rewards, correct=correct or [r > 0 for r in rewards])


def test_dapo_filter_keeps_mixed_groups_only():
    mixed = group("a", [1], [[2], [3]], [1.0, -1.0], [True, False])
    all_right = group("b", [1], [[2], [3]], [1.0, 1.0], [True, True])
    all_wrong = group("c", [1], [[2], [3]], [-1.0, -1.0], [False, False])
    assert _dynamic_keep([mixed, all_right, all_wrong], "accuracy") == [mixed]
    same_acc_other_reward = group("d", [1], [[2], [3]], [0.2, 0.7], [False, False])
    assert _dynamic_keep([same_acc_other_reward], "accuracy") == []
    assert _dynamic_keep([same_acc_other_reward], "reward") == [same_acc_other_reward]


def test_rollout_metrics():
    g = group("a", [1], [[2, 3], [4, 5, 6, 7]], [1.0, 0.0])
    g.completions[1].truncated = True
    m = rollout_metrics(RolloutBatch(groups=[g], tries=2, dropped_groups=1))
    assert m["reward/mean"] == 0.5 and m["reward/accuracy"] == 0.5
    assert m["completion/length_mean"] == 3.0 and m["completion/truncated_frac"] == 0.5
    assert (m["rollout/tries"], m["rollout/dropped_groups"]) == (2.0, 1.0)
    assert rollout_metrics(RolloutBatch(groups=[], tries=3)) == {
        "rollout/groups": 0.0, "rollout/tries": 3.0, "rollout/dropped_groups": 0.0}


@pytest.mark.parametrize("text, reward", [("", 0.0), ("nopqrstuvwxyz", 0.0), ("abc", 3 / 16),
                                          ("ABCDEFGHIJKLMabcdefghijklm", 1.0), ("a1 b2 c3 d4 e5 f6 g7 h8", 0.5)])
def test_toy_reward(text, reward):
    out = alphabet_count(text, "", "gsm8k")
    assert out.reward == pytest.approx(reward) and out.correct == (reward >= 0.5)


def test_atomic_directory(tmp_path):
    final = tmp_path / "model"
    with atomic_directory(final) as tmp:
        (tmp / "a").write_text("1")
    with pytest.raises(RuntimeError):
        with atomic_directory(final) as tmp:
            (tmp / "b").write_text("2")
            raise RuntimeError("crash mid-write")
    assert sorted(p.name for p in final.iterdir()) == ["a"], "a failed write must not touch the target"
    with atomic_directory(final, replace=False) as tmp:  # a cache filled concurrently: first one wins
        (tmp / "c").write_text("3")
    assert sorted(p.name for p in final.iterdir()) == ["a"]
    with atomic_directory(final) as tmp:
        (tmp / "d").write_text("4")
    assert sorted(p.name for p in final.iterdir()) == ["d"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"], "no temporary directory left behind"
    write_text_atomic(tmp_path / "f.txt", "x")
    assert (tmp_path / "f.txt").read_text() == "x"


def test_char_tokenizer_round_trips_text():
    from megatron_gtpo.models.tiny import _char_tokenizer

    tok = _char_tokenizer()
    text = "What is 7 + 12?\n\tAnswer: 19."
    ids = tok(text).input_ids
    assert len(ids) == len(text) and tok.decode(ids) == text
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert prompt == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
