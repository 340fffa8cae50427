"""Final-answer extraction: completion text -> the answer span the model committed to.

    completion --answer_region--> <answer>...</answer> body (or the whole text)
               --pick_span------> \\boxed{...} | "#### N" | "the answer is X" | choice letter | last number

Only string work happens here (regexes and brace matching, microseconds per completion); deciding
whether a span equals the reference is ``verify.py``'s job. Every function is pure and total: bad or
adversarial text yields ``None``, never an exception, and no regex here can backtrack
catastrophically (no nested quantifiers over the same characters).
"""

from __future__ import annotations

import re

# A number as models write it: sign, thousands separators, decimals, an optional "/d" fraction.
NUMBER_RE = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_HASH_RE = re.compile(r"####\s*([^\n]+)")
# "The (final) answer is X", "answer: X". X is the rest of the line, cut at the end of its sentence
# in Python (a lazy regex for that would backtrack quadratically on long lines). "is"/":" is
# required so that prose such as "to answer this" is not taken for an answer.
_PHRASE_RE = re.compile(r"answer\s*(?:is|:|=)[ \t:]*([^\n]*)", re.IGNORECASE)
_SENTENCE_END_RE = re.compile(r"\.(?:\s|$)")
_BOXED_NAMES = ("\\boxed", "\\fbox")
# Choice letters: "(C)", "C)", "C.", "C:" or a bare "C" that is its own token.
_LETTER_RE = re.compile(r"(?<![A-Za-z])\(?([A-D])(?:\)|\.|:|(?![A-Za-z]))")
_LETTER_PHRASE_RE = re.compile(r"(?:answer|option|choice)(?:\s|:|is\b)*\(?([A-D])\b", re.IGNORECASE)


def answer_region(text: str) -> tuple[str, bool]:
    """Returns ``(region, tagged)``: the body of the last ``<answer>...</answer>`` block when there is
    one (or of a final unclosed ``<answer>``, as truncated models leave it), else the whole text."""
    lower = text.lower()  # str.rfind keeps this linear even for text full of stray tags
    close = lower.rfind("</answer>")
    start = lower.rfind("<answer>", 0, close) if close >= 0 else -1
    if start >= 0:
        return text[start + len("<answer>"):close].strip(), True
    start = lower.rfind("<answer>")
    if start >= 0:
        return text[start + len("<answer>"):].strip(), True
    return text, False


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced; ``\\boxed 5`` too.

    Returns None when there is no box or its braces never close (a truncated completion)."""
    start, name = max((text.rfind(name), name) for name in _BOXED_NAMES)
    if start < 0:
        return None
    rest = text[start + len(name):]
    if rest.startswith(" "):  # "\boxed 5": the argument is the next token
        token = rest.strip().split(maxsplit=1)
        return token[0].rstrip(".$") if token else None
    if not rest.startswith("{"):
        return None
    close = matching_brace(rest, 0)
    return None if close is None else rest[1:close].strip()


def matching_brace(text: str, opened: int) -> int | None:
    """Index of the ``}`` that closes the ``{`` at ``opened``; None when it never closes."""
    depth = 0
    for i in range(opened, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return i
    return None


def last_number(text: str) -> str | None:
    """The last number in ``text`` as written (``"1,234.5"``, ``"-3"``, ``"7/2"``), or None."""
    found = NUMBER_RE.findall(text)
    return found[-1] if found else None


def choice_letter(text: str) -> str | None:
    """The choice letter (A-D) a multiple-choice completion commits to, or None.

    An "answer is (C)"-style phrase wins; otherwise the last standalone letter counts, so the
    English article "A" inside prose can mislead it only when no phrase or box is present."""
    phrased = _LETTER_PHRASE_RE.findall(text)
    if phrased:
        return phrased[-1].upper()
    letters = _LETTER_RE.findall(text)
    return letters[-1] if letters else None


def _phrase(text: str) -> str | None:
    found = []
    for match in _PHRASE_RE.finditer(text):
        span = _SENTENCE_END_RE.split(match.group(1), maxsplit=1)[0].strip()
        if span:
            found.append(span)
    return found[-1] if found else None


def extract_answer(completion: str, task: str) -> str | None:
    """The final answer span of ``completion`` for ``task``, or None when it states none.

    Order, first hit wins (inside the last ``<answer>`` block when there is one, else the text):
    ``\\boxed{}``; for ``mmlu`` a choice letter; the whole tag body; a GSM8K ``#### N`` line;
    an "the answer is X" phrase; the last inline ``$...$`` math (``math``) or last number.
    """
    region, tagged = answer_region(completion)
    boxed = last_boxed(region)
    if boxed is not None:
        return boxed
    if task == "mmlu":
        return choice_letter(region)
    if tagged:
        return region or None
    hashed = _HASH_RE.findall(region)
    if hashed:
        return hashed[-1].strip()
    phrase = _phrase(region)
    if phrase:
        return phrase
    if task == "math":
        spans = re.findall(r"\$([^$]+)\$", region)
        if spans:
            return spans[-1].strip()
    return last_number(region)


def gold_answer(gold: str, task: str) -> str:
    """The reference answer inside a dataset's gold field.

    GSM8K golds are full solutions ending ``#### N``; the number after the last ``####`` is the answer
    (a gold without ``####`` is used as is). MMLU golds may be a letter or a 0-based index ("2" -> "C").
    Other tasks' golds already are the answer."""
    gold = str(gold).strip()
    if task == "gsm8k":
        hashed = _HASH_RE.findall(gold)
        return hashed[-1].strip() if hashed else gold
    if task == "mmlu":
        if gold.isdigit() and int(gold) < 26:
            return "ABCDEFGHIJKLMNOPQRSTUVWXYZ"[int(gold)]
        return gold.strip("() .").upper()
    return gold
