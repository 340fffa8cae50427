"""A toy verifiable task: integer arithmetic prompts with exact answers, for demos and learning tests.

Each prompt asks for ``a op b (op c ...)`` evaluated left to right with the usual precedence, the
gold is GSM8K-style (``#### N``, task ``gsm8k``) so the standard checker grades it: a completion that
ends with (or boxes, or tags) the right integer is correct. Generation is seeded and cheap.
"""

from __future__ import annotations

import random

from megatron_gtpo.data.sources import Example
from megatron_gtpo.data.dataset import build_prompts
from megatron_gtpo.types import Prompt

OPERATORS = ("+", "-", "*")


def arithmetic_examples(*, num_prompts: int, seed: int = 0, max_operand: int = 20, num_operands: int = 2,
                        operators: tuple[str, ...] = ("+", "-")) -> list[Example]:
    """``num_prompts`` Examples "What is 7 + 12?" with gold "#### 19" (uids ``arithmetic:<seed>:<i>``)."""
    if num_prompts < 1 or max_operand < 1 or num_operands < 2:
        raise ValueError(f"arithmetic_examples needs num_prompts >= 1, max_operand >= 1, num_operands >= 2; "
                         f"got {num_prompts}, {max_operand}, {num_operands}")
    unknown = [op for op in operators if op not in OPERATORS]
    if unknown or not operators:
        raise ValueError(f"operators={operators!r}: expected a non-empty subset of {OPERATORS}")
    rng = random.Random(f"arithmetic:{seed}")
    examples = []
    for i in range(num_prompts):
        terms = [str(rng.randint(0, max_operand))]
        for _ in range(num_operands - 1):
            terms += [rng.choice(operators), str(rng.randint(0, max_operand))]
        expr = " ".join(terms)
        # eval of digits and + - * only: the expression is generated above, never user input.
        value = eval(expr, {"__builtins__": {}})  # noqa: S307
        examples.append(Example(uid=f"arithmetic:{seed}:{i}", question=f"What is {expr}?",
                                gold=f"#### {value}", task="gsm8k"))
    return examples


def arithmetic_prompts(*, tokenizer, num_prompts: int, seed: int = 0, max_operand: int = 20,
                       num_operands: int = 2, operators: tuple[str, ...] = ("+", "-"),
                       template: str = "plain", use_chat_template: bool = False) -> list[Prompt]:
    """Tokenised toy prompts (see module docstring). The default ``plain`` template without chat
    template renders "Question: What is 7 + 12?\\nAnswer:", which suits tiny random models;
    ``template="boxed", use_chat_template=True`` suits instruct models."""
    examples = arithmetic_examples(num_prompts=num_prompts, seed=seed, max_operand=max_operand,
                                   num_operands=num_operands, operators=operators)
    prompts, _ = build_prompts(examples, tokenizer=tokenizer, template=template,
                               use_chat_template=use_chat_template)
    return prompts
