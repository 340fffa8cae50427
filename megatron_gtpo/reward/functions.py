"""Named reward functions and the one place a reward name is resolved.

Contract of every reward function (built-in or user, picked by ``RewardConfig.fn``)::

    fn(completion: str, gold: str, task: str) -> float | RewardOutput
    fn(completion, gold, task, *, prompt: str, row: dict) -> ...   # either or both, when declared

A function that declares a ``prompt`` parameter also gets the rendered prompt text, one that declares
``row`` the dataset row the prompt came from (every column, as read); ``**kwargs`` gets both. The
signature is read once when the reward is loaded (``context_args``), so a function that declares
neither is called exactly as before and nothing more is sent to the scoring workers.
A plain float is the reward; correctness for the accuracy metric is then judged by ``is_correct``.
Functions run inside scorer worker processes, so a user function must be importable by dotted path
(``my_pkg.rewards.fn`` or ``my_pkg.rewards:fn``) and must not rely on state of the training process.
A function that raises or times out scores 0 for that sample (the first traceback of each distinct
error is logged); one that ends its process (``os._exit``, a segfault) on the same sample twice
stops the run with RewardFunctionCrashed (see ``pool.py`` and ``failures.py``).

Length shaping (DAPO's soft overlong punishment) is not a reward function: it needs token counts,
so ``score.py`` adds ``OverlongPunishment`` on top of whichever function is configured. Its one
setting lives in the algorithm config (``algo.overlong_buffer_len``/``overlong_penalty_factor``, with
L_max = ``rollout.max_tokens``); the driver hands the resolved values to the scorer.
"""

from __future__ import annotations

import importlib
import inspect
import math
from dataclasses import dataclass
from typing import Callable

from megatron_gtpo.reward.extract import matching_brace
from megatron_gtpo.reward.verify import _judge_cached


@dataclass(frozen=True, kw_only=True)
class RewardOutput:
    """What a reward function may return instead of a bare float."""

    reward: float
    """Scalar reward used for advantages."""
    correct: bool
    """Answer correctness (accuracy metric, DAPO's dynamic-sampling filter)."""



FORMAT_FULL = 10.0
"""Format reward of a completion with both tag pairs whose answer block ends the text."""


def paper_format_score(text: str) -> float:
    """The GTPO paper's format reward (docs/algorithms.md section 7), one of {10, 1.5, 1, 0}.

    10 when a ``<reasoning>...</reasoning>`` block is present and an ``<answer>...</answer>`` block
    ends the text. Otherwise partial credit for the one complete block: 1.5 when a stray tag of
    the other kind is present, 1.0 when not; 0 without a complete block. Trailing whitespace after
    ``</answer>`` is allowed (the reference regex's ``$`` already allowed one newline).
    """
    # The reference regexes, <reasoning>.*?</reasoning> and <answer>.*?</answer>$, as linear scans.
    opened = text.find("<reasoning>")
    has_reasoning = opened >= 0 and text.find("</reasoning>", opened + len("<reasoning>")) >= 0
    tail = text.rstrip()
    has_answer = tail.endswith("</answer>") and tail.rfind("<answer>", 0, len(tail) - len("</answer>")) >= 0
    if has_reasoning and has_answer:
        return FORMAT_FULL
    if has_reasoning:
        return 1.5 if "<answer>" in text or "</answer>" in text else 1.0
    if has_answer:
        return 1.5 if "<reasoning>" in text or "</reasoning>" in text else 1.0
    return 0.0


def correctness_reward(completion: str, gold: str, task: str) -> RewardOutput:
    """1.0 when the final answer is correct, else 0.0."""
    correct = _judge_cached(completion, gold, task).correct
    return RewardOutput(reward=float(correct), correct=correct)


def format_reward(completion: str, gold: str, task: str) -> RewardOutput:
    """1.0 when the paper's format is fully met (``paper_format_score == 10``), else 0.0."""
    full = paper_format_score(completion) == FORMAT_FULL
    return RewardOutput(reward=float(full), correct=_judge_cached(completion, gold, task).correct)


def gtpo_reward(completion: str, gold: str, task: str) -> RewardOutput:
    """The GTPO paper's 10+10 scheme: ``paper_format_score`` plus 10 for a correct answer, the
    latter only when the format score is 10; values in {0, 1, 1.5, 10, 20}.

    Transcribed from the authors' ``reward_math.py`` (github.com/winstonsmith1897/GTPO, commit
    ddbcca1, the file the reference ``train_model.py`` imports): ``compute_format_reward`` gives 10 for
    ``<reasoning>.*?</reasoning>`` plus ``<answer>.*?</answer>$``, else 1.0 per complete block (1.5
    with a stray tag of the other kind), and ``final_reward`` adds ``compute_correctness_reward``
    (10 or 0) only when the format reward is 10.

    Deviation from the reference code: correctness is ``is_correct`` (math-verify, exact numbers)
    instead of "float within 1e-2 or gold is a substring of the answer", which also paid "10" for
    gold "1". ``correct`` reports answer correctness whatever the format, for the accuracy metric.
    """
    fmt = paper_format_score(completion)
    correct = _judge_cached(completion, gold, task).correct
    bonus = FORMAT_FULL if fmt == FORMAT_FULL and correct else 0.0
    return RewardOutput(reward=fmt + bonus, correct=correct)


_BOX_TAIL = " \t\n.$\\]"
"""What may follow the final box and still count as "the box ends the text": whitespace, a full
stop, and the closing ``$``/``\\]`` of the math mode the box sits in."""


def boxed_format_score(text: str) -> float:
    """The paper's format term for ``\\boxed{}`` answers (the ``boxed`` template), one of {10, 1, 0}:
    10 when a closed, non-empty ``\\boxed{...}`` ends the text (the analogue of
    ``<answer>...</answer>$``), 1.0 when such a box is present but text follows it (the paper's credit
    for one complete block), 0 without one (a truncated completion cannot earn the 10, as in the paper).
    An empty ``\\boxed{}`` is no answer: the boxed template's own instruction contains one, and the
    first paper-reward study's policies learned to end with it within 10 steps (docs/results.md)."""
    box = _last_box(text)
    if box is None or not box[0].strip():
        return 0.0
    return FORMAT_FULL if text[box[1]:].strip(_BOX_TAIL) == "" else 1.0


def _last_box(text: str) -> tuple[str, int] | None:
    """``(content, end)`` of the last ``\\boxed{...}``/``\\fbox{...}``, ``end`` just past its closing
    brace; None when there is none or its braces never close."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    opened = text.index("{", start)
    close = matching_brace(text, opened)
    return None if close is None else (text[opened + 1:close], close + 1)


def gtpo_boxed_reward(completion: str, gold: str, task: str) -> RewardOutput:
    """The GTPO paper's reward structure (``gtpo_reward``) for the ``boxed`` template:
    ``boxed_format_score`` plus 10 for a correct answer when the format score is 10; values in
    {0, 1, 10, 20}. For models that do not produce the paper's XML tags (SmolLM2-135M: 0 of 256
    base samples at 128 tokens, docs/results.md), so that the format term still rewards finishing."""
    fmt = boxed_format_score(completion)
    correct = _judge_cached(completion, gold, task).correct
    bonus = FORMAT_FULL if fmt == FORMAT_FULL and correct else 0.0
    return RewardOutput(reward=fmt + bonus, correct=correct)


def dapo_reward(completion: str, gold: str, task: str) -> RewardOutput:
    """DAPO's rule reward (docs/algorithms.md section 4, Eq. 7): +1 correct, -1 otherwise."""
    correct = _judge_cached(completion, gold, task).correct
    return RewardOutput(reward=1.0 if correct else -1.0, correct=correct)


REWARDS: dict[str, Callable[[str, str, str], RewardOutput]] = {
    "correctness": correctness_reward,
    "format": format_reward,
    "gtpo": gtpo_reward,
    "gtpo_boxed": gtpo_boxed_reward,
    "dapo": dapo_reward,
}
"""Built-in reward functions by name: the only place a reward name is resolved."""

@dataclass(frozen=True, kw_only=True)
class OverlongPunishment:
    """DAPO's soft overlong punishment settings (spec 4.4), resolved from the algorithm config."""

    max_tokens: int
    """L_max: the rollout's max completion tokens."""
    cache_tokens: int
    """L_cache: length of the linear ramp before L_max (> 0)."""
    factor: float = 1.0
    """The punishment at and beyond L_max is ``-factor``."""

    def __call__(self, num_tokens: int) -> float:
        return overlong_penalty(num_tokens, max_tokens=self.max_tokens, cache_tokens=self.cache_tokens,
                                factor=self.factor)


def overlong_penalty(num_tokens: int, *, max_tokens: int, cache_tokens: int, factor: float = 1.0) -> float:
    """DAPO's soft overlong punishment R_len (docs/algorithms.md section 4), times ``factor``.

    0 up to ``max_tokens - cache_tokens`` tokens, then falls linearly to -1 at ``max_tokens``, and
    is -1 beyond it: 0, -0.5, -1 at ``L_max - L_cache``, ``L_max - L_cache/2``, ``L_max + 1``.
    """
    if max_tokens <= 0 or cache_tokens <= 0:
        raise ValueError(f"overlong_penalty needs max_tokens > 0 and cache_tokens > 0, "
                         f"got {max_tokens}, {cache_tokens}")
    free = max_tokens - cache_tokens
    if num_tokens <= free:
        return 0.0
    if num_tokens > max_tokens:
        return -1.0 * factor
    return (free - num_tokens) / cache_tokens * factor


def reward_path(name: str) -> str:
    """Import path (``module:attr``) of a reward given by built-in name or dotted path."""
    if name in REWARDS:
        return f"{__name__}:{REWARDS[name].__name__}"
    if ":" not in name:  # dotted form pkg.module.fn -> pkg.module:fn
        module_name, _, attr = name.rpartition(".")
        return f"{module_name}:{attr}"
    return name


def resolve_reward(name: str) -> Callable:
    """Imports the reward function ``name``: a key of REWARDS or ``pkg.module.fn`` / ``pkg.module:fn``.

    Raises ValueError naming ``reward.fn`` and the fix when it cannot be imported or is not callable.
    """
    if name in REWARDS:
        return REWARDS[name]
    module_name, sep, attr = name.partition(":") if ":" in name else name.rpartition(".")
    if not sep or not module_name or not attr:
        raise ValueError(f"reward.fn={name!r} is neither a built-in reward ({', '.join(REWARDS)}) nor a "
                         f"dotted import path such as 'my_pkg.rewards.my_fn'")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"reward.fn={name!r} could not be imported ({err}); make sure {module_name!r} is "
                         f"importable (on PYTHONPATH) and defines {attr!r}") from None
    if not callable(fn):
        raise ValueError(f"reward.fn={name!r} is a {type(fn).__name__}, not a function "
                         f"fn(completion, gold, task) -> float | RewardOutput")
    return fn


CONTEXT_ARGS = ("prompt", "row")
"""Keyword parameters a reward function may declare beyond (completion, gold, task): the rendered
prompt text and the dataset row (``Prompt.text``, ``Prompt.row``)."""


def context_args(fn: Callable) -> tuple[str, ...]:
    """Which of CONTEXT_ARGS ``fn`` takes: those it names as parameters, or all when it has ``**kwargs``
    (TRL's reward functions do). Read once per loaded reward, never per sample."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a callable without a readable signature (a C builtin): the plain contract
        return ()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return CONTEXT_ARGS
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return tuple(name for name in CONTEXT_ARGS if name in named)


def as_output(value: object, completion: str, gold: str, task: str) -> RewardOutput:
    """Normalises a reward function's return value (float or RewardOutput) to a RewardOutput."""
    if isinstance(value, RewardOutput):
        if not math.isfinite(value.reward):
            raise TypeError(f"reward function returned a non-finite reward {value.reward!r}")
        return value
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        # NaN/inf would poison the group's advantages; counted as an error and scored 0 instead.
        raise TypeError(f"reward function returned {type(value).__name__} {value!r}; "
                        f"expected a finite float or a RewardOutput")
    return RewardOutput(reward=float(value), correct=_judge_cached(completion, gold, task).correct)
