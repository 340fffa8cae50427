"""is_correct on hand-written cases: equivalent spellings pass, different values fail."""

from fractions import Fraction

import pytest

from megatron_gtpo.reward import is_correct, judge
from megatron_gtpo.reward.verify import canonical, normalize_answer, parse_number

GSM_GOLD = "Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 duck eggs a day.\nShe makes 9 * 2 = $<<9*2=18>>18.\n#### 18"


@pytest.mark.parametrize("completion", [
    "So she makes \\boxed{18} dollars.",
    "<reasoning>9 eggs times 2</reasoning>\n<answer>18</answer>",
    "<reasoning>9 eggs times 2</reasoning>\n<answer>$18.00</answer>",
    "9 * 2 = 18\n#### 18",
    "The answer is 18 dollars.",
    "She makes 9 * 2 = 18",  # last number
    "The answer is \\boxed{\\frac{36}{2}}.",
])
def test_gsm8k_correct_spellings(completion):
    assert is_correct(completion, GSM_GOLD, "gsm8k")


@pytest.mark.parametrize("completion", [
    "So she makes \\boxed{19} dollars.",
    "<answer>17</answer>",
    "The answer is 18.5.",
    "I am not sure.",
    "",
])
def test_gsm8k_wrong(completion):
    assert not is_correct(completion, GSM_GOLD, "gsm8k")


def test_thousands_separators_are_not_tolerance():
    gold = "#### 1,450,000"
    assert is_correct("\\boxed{1450000}", gold, "gsm8k")
    assert is_correct("The answer is 1,450,000.", gold, "gsm8k")
    assert not is_correct("\\boxed{1450001}", gold, "gsm8k")
    assert not is_correct("\\boxed{145000}", gold, "gsm8k")


@pytest.mark.parametrize("gold,pred", [
    ("\\frac{1}{2}", "0.5"),
    ("\\frac{1}{2}", "\\dfrac{1}{2}"),
    ("\\frac43", "\\frac{4}{3}"),
    ("\\frac 59", "5/9"),
    ("0.15", "\\frac{3}{20}"),
    ("90^\\circ", "90"),
    ("10,\\!080", "10080"),
    ("\\$32,\\!348", "32348"),
    ("5.4 \\text{ cents}", "5.4"),
    ("\\text{Evelyn}", "\\text{Evelyn}"),
    ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3, \\pi/2)"),
    ("3\\sqrt{13}", "\\sqrt{117}"),
    ("x^2+2x+1", "(x+1)^2"),
    ("\\frac{\\sqrt{3}}{3}", "\\frac{1}{\\sqrt{3}}"),
])
def test_math_equivalent(gold, pred):
    assert is_correct(f"so the answer is \\boxed{{{pred}}}.", gold, "math")


@pytest.mark.parametrize("gold,pred", [
    ("\\frac{1}{2}", "\\frac{1}{3}"),
    ("3\\sqrt{13}", "3\\sqrt{14}"),
    ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3, \\pi)"),
    ("x^2+2x+1", "(x-1)^2"),
    ("\\text{Evelyn}", "\\text{Navin}"),
    ("10,\\!080", "10081"),
])
def test_math_not_equivalent(gold, pred):
    assert not is_correct(f"so the answer is \\boxed{{{pred}}}.", gold, "math")


def test_aime_and_amc_numbers():
    assert is_correct("\\boxed{25}", "025", "aime")
    assert not is_correct("\\boxed{26}", "025", "aime")
    assert is_correct("<answer>27</answer>", "27.0", "amc")
    assert is_correct("The answer is 27.", "27", "amc")
    assert not is_correct("<answer>27.5</answer>", "27", "amc")


@pytest.mark.parametrize("gold", ["C", "2"])
def test_mmlu_letter_or_index(gold):
    assert is_correct("The answer is \\boxed{C}.", gold, "mmlu")
    assert is_correct("<reasoning>...</reasoning><answer>C</answer>", gold, "mmlu")
    assert not is_correct("The answer is \\boxed{B}.", gold, "mmlu")


def test_unknown_task_names_the_argument():
    with pytest.raises(ValueError, match="task='physics'"):
        is_correct("\\boxed{1}", "1", "physics")


def test_judge_returns_canonical_voting_key():
    assert judge("\\boxed{1,234}", "#### 1234", "gsm8k").answer == "1234"
    assert judge("\\boxed{\\dfrac{1}{2}}", "\\frac12", "math").answer == "1/2"
    assert judge("no answer", "1", "gsm8k").answer is None
    assert canonical("(B)", "mmlu") == "B"


def test_normalize_and_parse_number():
    assert normalize_answer("\\$1,000.") == "1000"
    assert normalize_answer("\\left( 1, 2 \\right)") == "(1,2)"
    assert parse_number("-\\frac{3}{4}") == Fraction(-3, 4)
    assert parse_number(".5") == Fraction(1, 2)
    assert parse_number("\\frac{1}{0}") is None
    assert parse_number("\\sqrt{2}") is None
