"""Prompt templates and chat rendering: Example -> chat messages -> prompt text -> token ids.

Templates (``DataConfig.template``):

- ``reasoning_tags``: the GTPO paper's system prompt (reference code ``train_model.py``), asking for
  ``<reasoning>...</reasoning>`` then ``<answer>...</answer>``; the user turn is the question.
- ``boxed``: the common math-eval instruction, reason step by step and put the final answer in
  ``\\boxed{}``.
- ``boxed_1shot``: ``boxed`` after one worked example (a user turn and the assistant's answer ending
  in a filled ``\\boxed{}``): a small instruct model that rarely closes a box on its own starts
  formatted, as the GTPO paper's models did (docs/results.md, stage 4).
- ``mmlu``: multiple choice; options listed as ``A. ...`` and the letter asked for in ``\\boxed{}``.
- ``plain``: the question alone.
- ``auto``: ``mmlu`` for rows with choices, ``boxed`` otherwise (the evaluation default).

Options of a multiple-choice row are listed under the question whatever the template, so that
``reasoning_tags`` and ``boxed`` also work for MMLU.
"""

from __future__ import annotations

from megatron_gtpo.data.sources import Example

PAPER_SYSTEM_PROMPT = (
    "You are a helpful assistant for solving problems. Given a question, first think step by step "
    "between <reasoning> and </reasoning>. Then, give the final answer between <answer> and </answer>.")
"""The system prompt of the GTPO reference code (docs/algorithms.md section 7)."""

BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
"""User-turn suffix of the ``boxed`` template."""

ONE_SHOT = ({"role": "user", "content": f"What is 23 + 19?\n\n{BOXED_INSTRUCTION}"},
            {"role": "assistant", "content": "23 + 19 = 42.\n\nThe final answer is \\boxed{42}."})
"""The worked example of ``boxed_1shot``: its operands lie above the arithmetic task's (at most 20),
so it is never one of that task's prompts."""

MMLU_INSTRUCTION = ("Answer with the letter of the correct option. Reason step by step, then put the "
                    "letter ({letters}) within \\boxed{{}}.")
"""User-turn suffix of the ``mmlu`` template ({letters} -> 'A, B, C or D')."""

LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


def question_text(example: Example) -> str:
    """The question, followed by lettered options for a multiple-choice row."""
    if not example.choices:
        return example.question.strip()
    options = "\n".join(f"{LETTERS[i]}. {choice}" for i, choice in enumerate(example.choices))
    return f"{example.question.strip()}\n\n{options}"


def _letters(count: int) -> str:
    letters = list(LETTERS[:count])
    return letters[0] if count == 1 else f"{', '.join(letters[:-1])} or {letters[-1]}"


def resolve_template(template: str, example: Example) -> str:
    """``auto`` -> ``mmlu`` for multiple choice, else ``boxed``; other names pass through.
    Raises ValueError when ``mmlu`` is asked for a row without choices."""
    if template == "auto":
        return "mmlu" if example.choices else "boxed"
    if template == "mmlu" and not example.choices:
        raise ValueError(f"template 'mmlu' needs answer options but row {example.uid} has none; "
                         f"set data.fields.choices or use template 'boxed'")
    return template


def build_messages(example: Example, *, template: str, system_prompt: str = "") -> list[dict[str, str]]:
    """Chat messages for ``example`` (a system turn only when the template or override has one)."""
    template = resolve_template(template, example)
    user = question_text(example)
    system = system_prompt
    if template == "reasoning_tags":
        system = system or PAPER_SYSTEM_PROMPT
    elif template in ("boxed", "boxed_1shot"):
        user = f"{user}\n\n{BOXED_INSTRUCTION}"
    elif template == "mmlu":
        user = f"{user}\n\n{MMLU_INSTRUCTION.format(letters=_letters(len(example.choices)))}"
    elif template != "plain":
        raise ValueError(f"unknown template {template!r}; expected auto, reasoning_tags, boxed, boxed_1shot, mmlu "
                         f"or plain")
    messages = [{"role": "system", "content": system}] if system else []
    shots = [dict(m) for m in ONE_SHOT] if template == "boxed_1shot" else []
    return messages + shots + [{"role": "user", "content": user}]


def render_text(messages: list[dict[str, str]], *, tokenizer, use_chat_template: bool) -> str:
    """Prompt text: the tokenizer's chat template with the generation prompt, or plain text
    ("<system>\\n\\nQuestion: <user>\\nAnswer:") when ``use_chat_template`` is false."""
    if use_chat_template:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template; set data.use_chat_template: false "
                             "(or eval --no-chat-template) to send plain prompts")
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    parts = [m["content"] for m in messages if m["role"] == "system"]
    turns = [m for m in messages if m["role"] != "system"]
    parts += [f"Question: {q['content']}\nAnswer: {a['content']}" for q, a in zip(turns[:-1:2], turns[1::2])]
    parts.append("Question: " + messages[-1]["content"] + "\nAnswer:")
    return "\n\n".join(parts)


def tokenize_texts(texts: list[str], *, tokenizer, use_chat_template: bool) -> list[list[int]]:
    """Token ids of rendered prompts. A chat template already holds its special tokens, so they are
    added by the tokenizer only for plain prompts."""
    if not texts:
        return []
    encoded = tokenizer(texts, add_special_tokens=not use_chat_template)["input_ids"]
    return [list(ids) for ids in encoded]
