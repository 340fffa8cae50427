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
