"""User reward functions for the reward tests, loaded by dotted path inside scoring workers.

Kept free of heavy imports (no torch, no pytest) so that a spawned worker starts quickly.
"""

import os
import signal
import time


def misbehaving_reward(completion, gold, task):
    """Sleeps (interruptible), hangs deaf to SIGALRM, kills its process, raises, or returns NaN on
    cue; else 0.5."""
    if "SLOW" in completion:
        time.sleep(60)
    if "HANG" in completion:  # what a hang inside C code looks like to the worker: no signal gets in
        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGALRM])
        time.sleep(60)
    if "DIE" in completion:  # a segfault-like death of the worker process
        os._exit(3)
    if "BOOM" in completion:
        raise RuntimeError("boom")
    if "NAN" in completion:
        return float("nan")
    return 0.5


def length_reward(completion, gold, task):
    """A user reward returning a bare float: a quarter point per character."""
    return 0.25 * len(completion)


def failing_reward(completion, gold, task):
    """Raises on every sample: KeyError for 'KEY' in the completion, else ValueError (two distinct
    errors, each raised on many samples)."""
    if "KEY" in completion:
        return {}["missing"]
    raise ValueError("cannot score this")


def dies_once_reward(completion, gold, task):
    """Kills its process the first time it sees a completion 'DIE_ONCE <marker path>' (creating the
    marker), scores it 0.5 the second time: a one-off crash, such as an out-of-memory kill."""
    if completion.startswith("DIE_ONCE "):
        marker = completion.split(" ", 1)[1]
        if not os.path.exists(marker):
            open(marker, "w").close()
            os._exit(4)
    return 0.5


def always_dies_reward(completion, gold, task):
    """Ends its process on every sample (a reward that segfaults on everything)."""
    os._exit(5)


def prompt_reward(completion, gold, task, *, prompt):
    """1.0 when the completion's first word appears in the prompt (needs the prompt), else 0.0."""
    return float(completion.split()[0] in prompt)


def row_reward(completion, gold, task, row, prompt=None):
    """The row's own ``points`` column, plus 0.5 when the prompt came along too."""
    return float(row["points"]) + (0.5 if prompt else 0.0)


def kwargs_reward(completion, gold, task, **kwargs):
    """TRL's style: 1.0 when **kwargs got exactly prompt and row."""
    return float(sorted(kwargs) == ["prompt", "row"])
