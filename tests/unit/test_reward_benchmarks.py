"""Acceptance: every row of every shipped benchmark (megatron_gtpo/data/benchmarks) is graded right both ways.

For each row, four completions written the way a model would: the gold answer boxed at the end of
a sentence, the gold in <answer> tags, and the same two with a genuinely wrong answer (gold + 1 for
numbers, the next letter for MMLU, and for MATH's LaTeX answers the first digit changed, which
always changes the value, or a different word/expression when the answer has no digit). The answers
are parsed here from the raw JSON files, independently of the package's own ``gold_answer``, and the
completions are scored against the gold fields exactly as the data loaders read them. Scoring runs
through the parallel scorer (spawned workers, per-sample timeout), as in training. Every row must be
graded right both ways, except the rows listed in KNOWN_MISGRADES with the reason.
"""

import re
from collections import defaultdict
from fractions import Fraction

import pytest

import json

from megatron_gtpo.data import SHIPPED_DATA, load_benchmark
from megatron_gtpo.reward import RewardConfig, RewardScorer

BENCHMARKS = ["gsm8k", "math500", "aime24", "aime25", "amc23", "mmlu_stem"]
FILES = {"gsm8k": "gsm8k/test.jsonl", "math500": "math500/test.jsonl", "aime24": "aime24/test.jsonl",
         "aime25": "aime25/test.jsonl", "amc23": "amc23/test.jsonl", "mmlu_stem": "mmlu_stem/test.jsonl"}
KNOWN_MISGRADES: dict[tuple[str, str, bool], str] = {}
"""(benchmark, uid, expected verdict) -> why the checker gets it wrong (none today)."""


def raw_answer(name: str, row: dict) -> str:
    """The gold answer of a raw JSON row, parsed without the package's code."""
    if name == "gsm8k":
        return row["answer"].split("####")[-1].strip().replace(",", "")
    if name == "mmlu_stem":
        return "ABCD"[int(row["answer"])]
    value = row["answer"]
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value).strip()


def raw_rows(name: str) -> list[dict]:
    with (SHIPPED_DATA / FILES[name]).open() as handle:
        return [json.loads(line) for line in handle if line.strip()]


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
        examples, rows = load_benchmark(name, data_root=SHIPPED_DATA), raw_rows(name)
        assert len(examples) == len(rows)
        for example, row in zip(examples, rows):
            answer = raw_answer(name, row)
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
        if (score.correct != expected or score.status != "ok") and (name, uid, expected) not in KNOWN_MISGRADES:
            failures[name, expected].append((uid, text[-80:], score.status))
    assert {name for name, _ in totals} == set(BENCHMARKS)
    report = {f"{name} {'right' if exp else 'wrong'}": f"{len(failures[name, exp])}/{totals[name, exp]}"
              for name, exp in sorted(totals)}
    assert not any(failures.values()), f"misgraded {report}; first failures: " + str(
        {k: v[:5] for k, v in failures.items() if v})
