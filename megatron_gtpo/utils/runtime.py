"""Run-time helpers of the driver: preemption signals, logging set-up, the collector's view of
the imported heap, this process's host memory (resident set and its peak)."""

from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import os
import re
import signal
import sys
import time


class PreemptionFlag:
    """Turns SIGTERM / SIGUSR1 (SLURM's pre-timeout signal, scancel) into a flag the driver checks
    between steps: it then checkpoints and exits cleanly instead of dying mid-step."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self):
        self.received: int | None = None
        for sig in self.SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.received = signum
        logging.getLogger("megatron_gtpo").warning(
            "received %s: will checkpoint after the current step and exit", signal.Signals(signum).name)

    @property
    def set(self) -> bool:
        return self.received is not None


@contextlib.contextmanager
def signals_blocked():
    """Blocks SIGTERM/SIGUSR1 while helper processes are started, so they inherit a blocked mask.

    torchrun and SLURM deliver a preemption signal to a rank's whole process group; helpers
    (reward workers, Megatron's checkpoint writers) would die of it mid-save, since only the
    rank itself handles it. A blocked mask survives fork and exec; the rank's own mask is restored.
    """
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, set(PreemptionFlag.SIGNALS))
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def freeze_imported_heap() -> None:
    """Moves every object the garbage collector tracks now into its permanent generation
    (``gc.freeze``): after the imports of torch, Megatron-Core, transformers and vLLM, ~740k
    objects that live as long as the process.

    Why: vLLM's engine start runs full collections (after loading the weights, and before it
    freezes its own heap at the end of start-up), and each one scans every tracked object. With the
    imports frozen first, the tiny engine starts in 2.4-2.5 s instead of 4.0-5.4 s (1 rank, 2-core
    machine). Before a fork it also keeps the ranks' collections from writing into the memory
    pages they share with their parent (the use CPython's ``gc.freeze`` documentation describes).
    Objects frozen here are not collected while the process runs: call it once the imports are
    done, not in a loop. At exit they are unfrozen again, so that the interpreter's last collection
    frees them: extension modules that count their live objects at shutdown (nanobind's, under
    vLLM) would otherwise print a screen of leak warnings over the end of the log, where a failed
    start's error is read (a rollout server's log tail).

    A full collection runs first, as vLLM's own freeze does (``utils/gc_utils.py``): garbage in a
    reference cycle at this moment (a cycle holding CUDA tensors, say) would otherwise be frozen with
    the rest and never freed."""
    global _UNFREEZE_AT_EXIT
    gc.collect()
    gc.freeze()
    if not _UNFREEZE_AT_EXIT:
        atexit.register(gc.unfreeze)
        _UNFREEZE_AT_EXIT = True


_UNFREEZE_AT_EXIT = False


def setup_logging(rank: int, level: str = "INFO") -> logging.Logger:
    """Rank 0 logs at ``level``; other ranks only warnings (one readable stream per job)."""
    logger = logging.getLogger("megatron_gtpo")
    logger.handlers.clear()
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter(f"%(asctime)s [rank{rank}] %(levelname)s %(message)s", "%H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(level if rank == 0 else "WARNING")
    logger.propagate = False
    return logger


def host_rss_bytes() -> int:
    """This process's resident set now (``VmRSS``)."""
    return _status_kib("VmRSS") << 10


def reset_host_peak_rss() -> int:
    """Restarts :func:`host_peak_rss_bytes` from the resident set now and returns it.

    Why not ``getrusage().ru_maxrss``: Linux carries it over ``fork`` + ``exec``, so a process
    started by a large parent (a pytest run that has loaded models) reports the parent's size as its
    own peak. ``/proc/self/clear_refs`` (``5``) resets the kernel's ``VmHWM`` for this process."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return host_rss_bytes()


def host_peak_rss_bytes(pid: int | None = None) -> int:
    """Peak resident set (``VmHWM``) of this process since the last :func:`reset_host_peak_rss` (or
    since it started), or of process ``pid`` since it started or last reset itself (OSError once it
    is gone; AttributeError for a zombie, whose status has no memory fields)."""
    return _status_kib("VmHWM", pid) << 10


def _status_kib(field: str, pid: int | None = None) -> int:
    with open(f"/proc/{'self' if pid is None else pid}/status") as f:
        return int(re.search(rf"{field}:\s+(\d+)", f.read()).group(1))


START_TIME_ENV = "MEGATRON_GTPO_START_TIME"
"""Epoch seconds at which the user's command started: ``megatron-gtpo train`` exports it to its ranks."""


def seconds_since_start() -> float:
    """Since the user's command started (``START_TIME_ENV``), else since this process started."""
    started = os.environ.get(START_TIME_ENV)
    if started is None:
        import psutil

        started = psutil.Process().create_time()
    return time.time() - float(started)


def startup_report() -> str:
    """What start-up cost: wall time since the command, and this process's peak host memory."""
    return f"start-up {seconds_since_start():.1f} s, peak host RSS {host_peak_rss_bytes() / 2**30:.2f} GiB"
