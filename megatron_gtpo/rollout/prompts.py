"""Prompt records from chat messages, rendered with the policy tokenizer's chat template."""

from __future__ import annotations

from megatron_gtpo.types import Prompt


def chat_prompt(tokenizer, messages: str | list[dict], *, uid: str, gold: str = "", task: str = "gsm8k",
                system: str | None = None) -> Prompt:
    """A :class:`Prompt` whose ``token_ids`` are ``messages`` under the tokenizer's chat template,
    ending with the assistant turn's header (``add_generation_prompt``).

    ``messages`` is a single user turn as a string, or a list of ``{"role", "content"}`` dicts;
    ``system`` prepends a system turn.
    """
    turns = [{"role": "user", "content": messages}] if isinstance(messages, str) else list(messages)
    if system is not None:
        turns = [{"role": "system", "content": system}, *turns]
    if not turns or not all(isinstance(t, dict) and {"role", "content"} <= t.keys() for t in turns):
        raise ValueError(f"messages must be a string or a list of {{'role', 'content'}} dicts, got {messages!r:.120}")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"tokenizer {type(tokenizer).__name__} has no chat template; "
                         "use an instruct model's tokenizer")
    text = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    # The template already holds the special tokens (BOS, role headers): do not add them twice.
    token_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return Prompt(uid=uid, token_ids=list(token_ids), text=text, gold=gold, task=task)
