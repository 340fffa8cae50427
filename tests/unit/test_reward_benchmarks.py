"""Acceptance: every row of every shipped benchmark (megatron_gtpo/data/benchmarks) is graded right both ways.

For each row, four completions written the way a model would: the gold answer boxed at the end of
a sentence, the gold in <answer> tags, and the same two with a genuinely wrong answer (gold + 1 for
numbers, the next letter for MMLU, and for MATH's LaTeX answers the first digit changed, which
always changes the value, or a different word/expression when the answer has no digit). The gold
fields are read exactly as the data loaders read them. Scoring runs through the parallel scorer
(spawned workers, per-sample timeout), as in training. At least 99.5% must be right each way.
"""

import re
from collections import defaultdict
from fractions import Fraction

import pytest

from megatron_gtpo.data import SHIPPED_DATA, load_benchmark
from megatron_gtpo.reward import RewardConfig, RewardScorer
from megatron_gtpo.reward.extract import gold_answer

BENCHMARKS = ["gsm8k", "math500", "aime24", "aime25", "amc23", "mmlu_stem"]


def wrong_number(answer: str) -> str:
    value = Fraction(answer.replace(",", "")) + 1
    return str(value.numerator) if value.denominator == 1 else str(float(value))


def wrong_latex(answer: str) -> str:
    if re.fullmatch(r"-?\d+", answer):
        return str(int(answer) + 1)
    digit = re.search(r"\d", answer)
    if digit:
        d = int(digit.group())
        return answer[:digit.start()] + str(d + 1 if d < 9 else d - 1) + answer[digit.end():]
    text = re.fullmatch(r"\\text\{(.*)\}", answer)
    if text:
        return "\\text{not " + text.group(1) + "}"
    return answer + "+1"


def wrong_letter(letter: str) -> str:
    return "ABCD"[("ABCD".index(letter) + 1) % 4]


def variants(answer: str, wrong: str) -> list[tuple[str, bool]]:
    return [(f"Let me work through it step by step. So the answer is \\boxed{{{answer}}}.", True),
            (f"<reasoning>\nStep by step work.\n</reasoning>\n<answer>{answer}</answer>", True),
            (f"Let me work through it step by step. So the answer is \\boxed{{{wrong}}}.", False),
            (f"<reasoning>\nStep by step work.\n</reasoning>\n<answer>{wrong}</answer>", False)]


def test_every_benchmark_row_is_graded_right_both_ways():
    items, keys = [], []
    for name in BENCHMARKS:
        for example in load_benchmark(name, data_root=SHIPPED_DATA):
            answer = gold_answer(example.gold, example.task)
            wrong = {"mmlu": wrong_letter, "math": wrong_latex}.get(example.task, wrong_number)(answer)
            assert wrong != answer
            for text, expected in variants(answer, wrong):
                items.append((text, example.gold, example.task))
                keys.append((name, expected, example.uid, text))
    with RewardScorer(RewardConfig(fn="correctness", num_workers=2, timeout_s=20.0)) as scorer:
        scores = scorer.score(items)
    totals, failures = defaultdict(int), defaultdict(list)
    for (name, expected, uid, text), score in zip(keys, scores):
        totals[name, expected] += 1
        if score.correct != expected or score.status != "ok":
            failures[name, expected].append((uid, text[-80:], score.status))
    assert {name for name, _ in totals} == set(BENCHMARKS)
    report = {f"{name} {'right' if exp else 'wrong'}": f"{len(failures[name, exp])}/{totals[name, exp]}"
              for name, exp in sorted(totals)}
    for key, total in totals.items():
        assert len(failures[key]) <= 0.005 * total, f"misgraded {report}; first failures: {failures[key][:5]}"
