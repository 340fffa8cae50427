"""The toy arithmetic task: seeded, exact golds that the standard gsm8k checker grades."""

import operator
import re

import pytest

from megatron_gtpo.data import arithmetic_examples, arithmetic_prompts
from megatron_gtpo.reward import is_correct
from tests.unit.data_tokenizer import tiny_tokenizer

OPS = {"+": operator.add, "-": operator.sub}


def test_golds_are_exact_and_graded_by_the_gsm8k_checker():
    examples = arithmetic_examples(num_prompts=50, seed=7, max_operand=30, num_operands=3)
    assert len({e.uid for e in examples}) == 50
    for e in examples:
        a, op1, b, op2, c = re.fullmatch(r"What is (\d+) ([+-]) (\d+) ([+-]) (\d+)\?", e.question).groups()
        value = OPS[op2](OPS[op1](int(a), int(b)), int(c))  # + and - associate left to right
        assert e.gold == f"#### {value}" and e.task == "gsm8k"
        assert all(0 <= int(x) <= 30 for x in (a, b, c))
        assert is_correct(f"The result is {value}.", e.gold, "gsm8k")
        assert not is_correct(f"The result is {value + 1}.", e.gold, "gsm8k")


def test_multiplication_respects_precedence():
    for e in arithmetic_examples(num_prompts=30, seed=1, num_operands=3, operators=("+", "*")):
        a, op1, b, op2, c = re.fullmatch(r"What is (\d+) ([+*]) (\d+) ([+*]) (\d+)\?", e.question).groups()
        a, b, c = int(a), int(b), int(c)
        expected = {("+", "+"): a + b + c, ("+", "*"): a + b * c, ("*", "+"): a * b + c, ("*", "*"): a * b * c}
        assert e.gold == f"#### {expected[op1, op2]}"


def test_seeded_and_tokenised():
    tok = tiny_tokenizer()
    first = arithmetic_prompts(tokenizer=tok, num_prompts=5, seed=3)
    assert [p.text for p in first] == [p.text for p in arithmetic_prompts(tokenizer=tok, num_prompts=5, seed=3)]
    assert [p.text for p in first] != [p.text for p in arithmetic_prompts(tokenizer=tok, num_prompts=5, seed=4)]
    assert re.fullmatch(r"Question: What is \d+ [+-] \d+\?\nAnswer:", first[0].text)
    assert tok.decode(first[0].token_ids) == first[0].text
    chat = arithmetic_prompts(tokenizer=tok, num_prompts=1, template="boxed", use_chat_template=True)[0]
    assert chat.text.startswith("<|im_start|>user") and "\\boxed{}" in chat.text


@pytest.mark.parametrize("kwargs,message", [
    ({"num_prompts": 0}, "num_prompts >= 1"),
    ({"num_prompts": 1, "num_operands": 1}, "num_operands >= 2"),
    ({"num_prompts": 1, "operators": ("/",)}, "operators"),
])
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        arithmetic_examples(**kwargs)
