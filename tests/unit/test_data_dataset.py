"""Prompt templates, chat rendering, length filtering and the resumable, seeded PromptDataset."""

import json

import pytest

from megatron_gtpo.data import (PAPER_SYSTEM_PROMPT, DataConfig, Example, PromptDataset, build_dataset,
                                build_messages, build_prompts)
from megatron_gtpo.types import Prompt
from tests.unit.data_tokenizer import tiny_tokenizer

QUESTION = Example(uid="t:0", question="What is 3 + 4?", gold="#### 7", task="gsm8k")
CHOICE = Example(uid="t:1", question="Which is even?", gold="B", task="mmlu", choices=("3", "4", "5"))


def test_templates_render_the_documented_prompts():
    tags = build_messages(QUESTION, template="reasoning_tags")
    assert tags == [{"role": "system", "content": PAPER_SYSTEM_PROMPT}, {"role": "user", "content": "What is 3 + 4?"}]
    assert "<reasoning>" in PAPER_SYSTEM_PROMPT and "<answer>" in PAPER_SYSTEM_PROMPT
    boxed = build_messages(QUESTION, template="boxed")
    assert len(boxed) == 1 and boxed[0]["content"].endswith("put your final answer within \\boxed{}.")
    mmlu = build_messages(CHOICE, template="mmlu")[0]["content"]
    assert "Which is even?\n\nA. 3\nB. 4\nC. 5" in mmlu and "(A, B or C)" in mmlu
    assert build_messages(CHOICE, template="auto") == build_messages(CHOICE, template="mmlu")
    assert build_messages(QUESTION, template="auto") == boxed
    assert "B. 4" in build_messages(CHOICE, template="reasoning_tags")[1]["content"]  # options always shown
    assert build_messages(QUESTION, template="plain", system_prompt="Be brief.")[0] == {
        "role": "system", "content": "Be brief."}
    with pytest.raises(ValueError, match="template 'mmlu' needs answer options"):
        build_messages(QUESTION, template="mmlu")


def test_one_shot_template_shows_a_filled_box_before_the_question():
    shot = build_messages(QUESTION, template="boxed_1shot")
    assert [m["role"] for m in shot] == ["user", "assistant", "user"]
    assert shot[-1] == build_messages(QUESTION, template="boxed")[0]  # the question as `boxed` asks it
    assert shot[1]["content"].endswith("\\boxed{42}.") and "23 + 19" in shot[0]["content"]  # not a task prompt
    (chat,), _ = build_prompts([QUESTION], tokenizer=tiny_tokenizer(), template="boxed_1shot")
    assert chat.text.count("<|im_start|>user") == 2 and chat.text.endswith("<|im_start|>assistant\n")
    (plain,), _ = build_prompts([QUESTION], tokenizer=tiny_tokenizer(), template="boxed_1shot",
                                use_chat_template=False)
    assert plain.text.startswith("Question: What is 23 + 19?") and "Answer: 23 + 19 = 42." in plain.text
    assert plain.text.endswith("Question: What is 3 + 4?\n\nPlease reason step by step, and put your final "
                               "answer within \\boxed{}.\nAnswer:")


def test_chat_template_is_applied_and_tokens_match_text():
    tok = tiny_tokenizer()
    (prompt,), stats = build_prompts([QUESTION], tokenizer=tok, template="reasoning_tags")
    assert prompt.text.startswith("<|im_start|>system\nYou are a helpful assistant")
    assert prompt.text.endswith("<|im_start|>assistant\n")
    assert tok.decode(prompt.token_ids) == prompt.text
    assert (prompt.uid, prompt.gold, prompt.task) == ("t:0", "#### 7", "gsm8k")
    assert stats.num_too_long == 0


def test_plain_prompts_and_missing_chat_template():
    (prompt,), _ = build_prompts([QUESTION], tokenizer=tiny_tokenizer(), template="plain", use_chat_template=False)
    assert prompt.text == "Question: What is 3 + 4?\nAnswer:"
    with pytest.raises(ValueError, match="use_chat_template: false"):
        build_prompts([QUESTION], tokenizer=tiny_tokenizer(with_chat_template=False), template="plain")


def test_prompts_over_the_limit_are_dropped_and_counted():
    long = Example(uid="t:2", question="word " * 200, gold="#### 1", task="gsm8k")
    tok = tiny_tokenizer()
    lengths = [len(p.token_ids) for p in build_prompts([QUESTION, long], tokenizer=tok, template="plain")[0]]
    prompts, stats = build_prompts([QUESTION, long, QUESTION], tokenizer=tok, template="plain",
                                   max_prompt_tokens=lengths[0])
    assert [p.uid for p in prompts] == ["t:0", "t:0"]
    assert (stats.num_rows, stats.num_prompts, stats.num_too_long) == (3, 2, 1)
    assert stats.longest_tokens > lengths[0] and stats.max_prompt_tokens == lengths[0]
    assert stats.metrics() == {"data/prompts": 2.0, "data/prompts_dropped_too_long": 1.0}
    assert stats.summary() == (f"prompts: 2 of 3 rows kept, 1 dropped as too long > data.max_prompt_tokens="
                               f"{lengths[0]} (longest prompt {stats.longest_tokens} tokens)")
    with pytest.raises(ValueError, match="prompt set is empty"):
        PromptDataset(build_prompts([long], tokenizer=tok, template="plain", max_prompt_tokens=lengths[0])[0])


def _prompts(n: int) -> list[Prompt]:
    return [Prompt(uid=f"p{i}", token_ids=[i], text=f"q{i}") for i in range(n)]


def test_epochs_are_seeded_permutations():
    ds = PromptDataset(_prompts(10), seed=3)
    first, second = ds.next_batch(10), ds.next_batch(10)
    assert sorted(p.uid for p in first) == sorted(p.uid for p in second) == sorted(f"p{i}" for i in range(10))
    assert [p.uid for p in first] != [p.uid for p in second]  # reshuffled each epoch
    again = PromptDataset(_prompts(10), seed=3)
    assert [p.uid for p in again.next_batch(20)] == [p.uid for p in first + second]
    assert [p.uid for p in PromptDataset(_prompts(10), seed=4).next_batch(10)] != [p.uid for p in first]
    ordered = PromptDataset(_prompts(4), shuffle=False)
    assert [p.uid for p in ordered.next_batch(6)] == ["p0", "p1", "p2", "p3", "p0", "p1"]
    with pytest.raises(ValueError, match="n must be >= 1"):
        ordered.next_batch(0)


def test_resume_reproduces_the_uninterrupted_stream():
    reference = PromptDataset(_prompts(7), seed=1)
    expected = [p.uid for _ in range(6) for p in reference.next_batch(3)]
    run = PromptDataset(_prompts(7), seed=1)
    drawn = [p.uid for _ in range(3) for p in run.next_batch(3)]  # 9 prompts: one epoch and 2 more
    state = json.loads(json.dumps(run.state_dict()))  # survives a JSON checkpoint
    resumed = PromptDataset(_prompts(7), seed=1)
    resumed.load_state_dict(state)
    drawn += [p.uid for _ in range(3) for p in resumed.next_batch(3)]
    assert drawn == expected and resumed.epoch == 2


def test_cursor_from_other_data_is_refused():
    state = PromptDataset(_prompts(7), seed=1).state_dict()
    with pytest.raises(ValueError, match="'fingerprint'"):
        PromptDataset(_prompts(8), seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="'seed'"):
        PromptDataset(_prompts(7), seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="position 99"):
        PromptDataset(_prompts(7), seed=1).load_state_dict({**state, "position": 99})


def test_build_dataset_from_config(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"question": f"What is {i} + 1?", "answer": f"#### {i + 1}"}) + "\n"
                            for i in range(5)))
    cfg = DataConfig(benchmarks=[], paths=[str(path)], limit=4, template="boxed", seed=5)
    ds = build_dataset(cfg, tokenizer=tiny_tokenizer(), progress=False)
    assert len(ds) == 4 and ds.stats.num_rows == 4
    batch = ds.next_batch(4)
    assert sorted(p.uid for p in batch) == ["train:0", "train:1", "train:2", "train:3"]
    assert all("\\boxed{}" in p.text and p.task == "gsm8k" for p in batch)
