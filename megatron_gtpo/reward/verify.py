"""Answer checking: is the model's final answer the reference answer?

    completion --extract_answer--> span --normalize--> equal strings?  -> correct
                                                   --> both numbers?  -> exact Fraction compare
                                                   --> math-verify    -> symbolic equivalence

The cheap paths answer almost every GSM8K/AIME/AMC/MMLU sample in microseconds; math-verify (sympy,
60-750 ms for symbolic cases) runs only when a LaTeX answer is not string- or number-identical to
the reference. math-verify's own ``signal.alarm`` timeouts are switched off here because they break
outside the main thread and would clobber the scorer's per-sample alarm (``pool.py``); callers that
need a time limit use the scorer, which enforces one per sample.
"""

from __future__ import annotations

import functools
import logging
import re
from dataclasses import dataclass
from fractions import Fraction

from megatron_gtpo.reward.extract import NUMBER_RE, choice_letter, extract_answer, gold_answer, last_number

TASKS = ("gsm8k", "math", "aime", "amc", "mmlu")
"""Task names understood by the checker (``Prompt.task``)."""
NUMERIC_TASKS = ("gsm8k", "aime", "amc")
"""Tasks whose reference is a single number: a prediction is reduced to its last number if needed."""

_SPACING = re.compile(r"\\[!,;: ]|~|\\left(?![a-zA-Z])|\\right(?![a-zA-Z])|\\displaystyle")
_DEGREES = re.compile(r"\^\s*\{?\\circ\}?|°|\\circ|\\%|%|\\\$|\$")
_UNIT_TAIL = re.compile(r"(?<=\S)\s*\\(?:text|mbox|mathrm)\{[^{}]*\}(?:\^\{?\d\}?)?\s*$")
_TEXT_WRAP = re.compile(r"^\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}$")
_THOUSANDS = re.compile(r"^-?\d{1,3}(,\d{3})+(\.\d+)?$")
_FRAC = re.compile(r"^(-?)\\frac(?:\{(-?\d+)\}|(\d))(?:\{(\d+)\}|(\d))$")
_PLAIN_NUMBER = re.compile(r"^-?(\d+(\.\d*)?|\.\d+)(/\d+)?$")


@dataclass(frozen=True, kw_only=True)
class Judgement:
    """The verdict on one completion."""

    correct: bool
    """True when the extracted answer equals the reference (string, number or symbolic match)."""
    answer: str | None
    """Canonical form of the extracted answer (the maj@k voting key); None when none was found."""


def _check_task(task: str) -> None:
    if task not in TASKS:
        raise ValueError(f"task={task!r} is not supported: expected one of {', '.join(TASKS)} "
                         f"(set Prompt.task / the dataset's task to one of them)")


def normalize_answer(text: str) -> str:
    """Spelling-only normalisation shared by prediction and reference: drops ``$``, spacing commands,
    ``\\left``/``\\right``, degrees and percent signs, a trailing unit ``\\text{ cm}``, thousands
    separators of a plain number and all whitespace; ``\\dfrac``/``\\tfrac`` -> ``\\frac``."""
    text = text.strip().strip(".").strip()
    text = re.sub(r"^\\\(|\\\)$|^\\\[|\\\]$", "", text)
    text = _SPACING.sub("", text)
    text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    text = _DEGREES.sub("", text)
    text = _UNIT_TAIL.sub("", text)
    wrapped = _TEXT_WRAP.match(text.strip())
    if wrapped:
        text = wrapped.group(1)
    text = re.sub(r"\s+", "", text).rstrip(".")
    if _THOUSANDS.match(text):
        text = text.replace(",", "")
    return text


def parse_number(text: str) -> Fraction | None:
    """Exact value of a normalised plain number (``-12``, ``0.15``, ``.5``, ``7/2``, ``\\frac{3}{4}``,
    ``\\frac43``), or None for anything else (surds, expressions, tuples, text)."""
    if _PLAIN_NUMBER.match(text):
        try:
            return Fraction(text)
        except (ValueError, ZeroDivisionError):
            return None
    frac = _FRAC.match(text)
    if frac:
        sign, num_braced, num_digit, den_braced, den_digit = frac.groups()
        den = int(den_braced or den_digit)
        if den == 0:
            return None
        value = Fraction(int(num_braced or num_digit), den)
        return -value if sign else value
    return None


def _numbers_equal(a: Fraction, b: Fraction) -> bool:
    # Exact for integers and fractions; a rounded decimal such as 0.333333 still meets 1/3. The
    # tolerance is absolute so that 1450001 never "equals" 1450000.
    return a == b or abs(a - b) <= Fraction(1, 10**6)


@functools.lru_cache(maxsize=8192)
def _mv_parse(expr: str) -> tuple:
    from math_verify import parse  # imported lazily: 1 s of sympy start-up

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # its "timeout disabled" notice
    return tuple(parse("\\boxed{" + expr + "}", parsing_timeout=None))


def math_equal(pred: str, gold: str) -> bool:
    """Symbolic equivalence by math-verify (gold first, as its API requires); no time limit here."""
    from math_verify import verify

    gold_parsed, pred_parsed = _mv_parse(gold), _mv_parse(pred)
    if not gold_parsed or not pred_parsed:
        return False
    return bool(verify(list(gold_parsed), list(pred_parsed), timeout_seconds=None))


def canonical(answer: str, task: str) -> str:
    """Voting key of an extracted answer: the letter (mmlu), the exact number (``1/2``, ``18``) or
    the normalised string. Answers that are equal only symbolically get different keys."""
    if task == "mmlu":
        return choice_letter(answer) or answer.strip()
    norm = normalize_answer(answer)
    value = parse_number(norm)
    if value is None and task in NUMERIC_TASKS and "\\" not in norm:
        number = last_number(norm)
        value = parse_number(number.replace(",", "")) if number else None
    return str(value) if value is not None else norm


def answers_match(pred: str, gold: str, task: str) -> bool:
    """True when prediction span ``pred`` equals reference answer ``gold`` (both already extracted)."""
    if task == "mmlu":
        return choice_letter(pred) == gold.strip().upper()
    pred_norm, gold_norm = normalize_answer(pred), normalize_answer(gold)
    if pred_norm and pred_norm == gold_norm:
        return True
    pred_value, gold_value = parse_number(pred_norm), parse_number(gold_norm)
    if pred_value is not None and gold_value is not None:
        return _numbers_equal(pred_value, gold_value)
    if task in NUMERIC_TASKS and gold_value is not None and "\\" not in pred_norm:
        # "18 dollars", "x = 18": reduce plain text to its last number instead of calling sympy.
        numbers = NUMBER_RE.findall(pred_norm)
        last = parse_number(numbers[-1].replace(",", "")) if numbers else None
        return last is not None and _numbers_equal(last, gold_value)
    return math_equal(pred.strip().strip("$"), gold.strip().strip("$"))


def judge(completion: str, gold: str, task: str) -> Judgement:
    """Extracts the final answer of ``completion`` and checks it against the dataset gold field."""
    _check_task(task)
    pred = extract_answer(completion, task)
    if pred is None or not pred.strip():
        return Judgement(correct=False, answer=None)
    return Judgement(correct=answers_match(pred, gold_answer(gold, task), task), answer=canonical(pred, task))


@functools.lru_cache(maxsize=4096)
def _judge_cached(completion: str, gold: str, task: str) -> Judgement:
    # Reward functions and the scorer both ask for the same verdict; computing it once matters
    # when math-verify is involved.
    return judge(completion, gold, task)


def is_correct(completion: str, gold: str, task: str) -> bool:
    """Public checker: does ``completion`` state the answer in ``gold`` for ``task``?

    ``task`` is one of gsm8k, math, aime, amc, mmlu. ``gold`` is the dataset's gold field: a GSM8K
    solution ending ``#### N`` (or the bare number), a MATH LaTeX answer, an AIME/AMC number, an MMLU
    letter A-D or 0-based index. The answer is taken from ``<answer>`` tags, ``\\boxed{}``,
    ``#### N``, "the answer is X", a choice letter or the last number, in that order; see
    ``extract_answer``. Raises ValueError for an unknown task. No time limit: use the scorer
    (``RewardScorer``) for untrusted text at scale.
    """
    return _judge_cached(completion, str(gold), task).correct
