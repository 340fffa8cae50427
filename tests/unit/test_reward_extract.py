"""Final-answer extraction and gold parsing, against hand-written completions."""

import pytest

from megatron_gtpo.reward.extract import choice_letter, extract_answer, gold_answer, last_boxed, last_number


@pytest.mark.parametrize("text,expected", [
    ("so \\boxed{42}.", "42"),
    ("first \\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("nested \\boxed{\\left( 3, \\frac{\\pi}{2} \\right)} end", "\\left( 3, \\frac{\\pi}{2} \\right)"),
    ("\\fbox{7}", "7"),
    ("space form \\boxed 5.", "5"),
    ("truncated \\boxed{\\frac{1}{", None),
    ("no box here", None),
])
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


@pytest.mark.parametrize("text,task,expected", [
    # answer tags win, and a box inside the tags is unwrapped
    ("<reasoning>2+2</reasoning>\n<answer>4</answer>", "gsm8k", "4"),
    ("<reasoning>x</reasoning><answer>so \\boxed{\\frac{3}{4}}</answer>", "math", "\\frac{3}{4}"),
    ("<answer>1</answer> wait, <answer> 2 </answer>", "gsm8k", "2"),
    ("<reasoning>r</reasoning><answer>17", "aime", "17"),  # unclosed tag of a truncated completion
    ("The total is 5 + 7 = 12.\n#### 12", "gsm8k", "12"),
    ("Adding up, the answer is 1,234 dollars.", "gsm8k", "1,234 dollars"),
    ("Final answer: $\\frac{7}{2}$", "math", "$\\frac{7}{2}$"),
    ("We get $x = 3$ and then $y = \\sqrt{2}$", "math", "y = \\sqrt{2}"),
    ("I made 3 pies and ate 2, leaving 1", "gsm8k", "1"),
    ("Nothing numeric at all", "gsm8k", None),
    ("To answer this we compute 6 * 7 = 42", "gsm8k", "42"),  # "To answer this" is not an answer phrase
    ("The answer is (C) because ...", "mmlu", "C"),
    ("<answer>B</answer>", "mmlu", "B"),
    ("so the answer is \\boxed{D}.", "mmlu", "D"),
])
def test_extract_answer(text, task, expected):
    assert extract_answer(text, task) == expected


@pytest.mark.parametrize("text,expected", [
    ("The correct option is B.", "B"),
    ("A is wrong, (D) is right", "D"),
    ("choice: a", "A"),
    ("no letters in this one", None),
])
def test_choice_letter(text, expected):
    assert choice_letter(text) == expected


def test_last_number_keeps_separators_and_signs():
    assert last_number("from -3 to 1,234.50 then 7/2") == "7/2"
    assert last_number("costs $1,234.50") == "1,234.50"
    assert last_number("minus -12") == "-12"
    assert last_number("none") is None


@pytest.mark.parametrize("gold,task,expected", [
    ("She makes 9 * 2 = $<<9*2=18>>18.\n#### 18", "gsm8k", "18"),
    ("#### 1,450,000", "gsm8k", "1,450,000"),
    ("72", "gsm8k", "72"),  # a bare number is accepted too
    ("2", "mmlu", "C"),
    ("0", "mmlu", "A"),
    ("(b)", "mmlu", "B"),
    ("\\frac{14}{3}", "math", "\\frac{14}{3}"),
])
def test_gold_answer(gold, task, expected):
    assert gold_answer(gold, task) == expected


@pytest.mark.parametrize("text", [
    "the answer is" + " " * 200_000 + "x",
    "answer" + " " * 200_000,
    "<answer>" * 30_000 + "1",
    "</answer><answer>" * 30_000,
    "<reasoning>" * 30_000 + "\\boxed{" * 30_000,
    "1," * 100_000,
])
def test_extraction_is_linear_on_adversarial_text(text):
    # Quadratic regex backtracking would take minutes on these; a linear scan takes milliseconds.
    import time

    from megatron_gtpo.reward import paper_format_score

    start = time.perf_counter()
    for task in ("gsm8k", "math", "mmlu"):
        extract_answer(text, task)
    paper_format_score(text)
    assert time.perf_counter() - start < 5.0
