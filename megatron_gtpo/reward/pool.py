"""Parallel scoring with a per-sample time limit: math-verify can hang on adversarial LaTeX.

    parent: queue of sample indices --chunks--> worker 1..N (own processes, own pipes)
    worker: for each sample: SIGALRM(timeout_s) -> reward fn -> (index, result) back to the parent
    parent: a worker silent for timeout_s + grace (stuck in C code, deaf to signals) is killed and
            respawned; its current sample scores 0 as a timeout, the rest of its chunk is re-queued
    parent: a worker that dies (os._exit, segfault, OOM kill) is respawned and its chunk re-queued,
            the fatal sample first; a sample that kills a worker twice raises RewardFunctionCrashed

Two layers because a Python-level hang (sympy) is interrupted cheaply by the in-worker alarm, which
keeps the worker and its warm caches alive, while only the parent's kill can stop a hang that never
returns to the interpreter. A timeout or an exception gives reward 0, correct False and a status
the caller counts with the traceback of the failure; nothing here raises because of one bad
sample, except a sample that kills its worker process twice (the function cannot be scored at all).

Workers are started with ``spawn`` by default: the training process holds CUDA contexts and vLLM
threads, which ``fork`` would copy in a broken state. They import only ``megatron_gtpo.reward``
(no torch) and warm math-verify up before reporting ready, so start-up never counts as a timeout.
"""

from __future__ import annotations

import collections
import importlib
import logging
import multiprocessing as mp
import signal
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait

from tqdm import tqdm

from megatron_gtpo.reward.functions import as_output
from megatron_gtpo.reward.verify import _judge_cached, _mv_parse

STATUS_OK, STATUS_TIMEOUT, STATUS_ERROR = "ok", "timeout", "error"
MAX_WORKER_DEATHS = 2
"""Worker deaths one sample may cause before its reward function is declared fatal (the first
is retried on a fresh worker: an out-of-memory kill can be a one-off)."""
_READY = "ready"
_STARTUP_LIMIT_S = 300.0  # importing sympy on a loaded 2-core CI box takes seconds, not minutes
_TRACEBACK_CHARS = 8000  # the tail of a deep traceback holds the frame that failed
_IGNORED_SIGNALS = {signal.SIGINT, signal.SIGUSR1}  # the parent's to handle (see _worker_main)

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class SampleScore:
    """The scorer's result for one completion."""

    reward: float
    """Reward from the reward function; 0.0 on timeout or error."""
    correct: bool
    """Answer correctness; False on timeout or error."""
    answer: str | None
    """Canonical extracted answer (maj@k voting key); None when not asked for (``with_answers``),
    absent, timed out or failed."""
    status: str = STATUS_OK
    """'ok', 'timeout' (over the per-sample limit) or 'error' (the reward function raised)."""
    error: str = ""
    """Short description of the error or timeout, empty when ok."""
    traceback: str = ""
    """Formatted traceback of the failure (for a timeout: where the alarm interrupted the
    function); empty when ok or when the worker process was killed."""


class RewardFunctionCrashed(RuntimeError):
    """The reward function ended its scoring worker process twice on the same sample."""


class SampleTimeout(BaseException):
    """Raised by the in-worker alarm. A BaseException so that libraries' ``except Exception``
    (math-verify wraps its parsing in one) cannot swallow it."""


def _failed(status: str, message: str, trace: str = "") -> SampleScore:
    return SampleScore(reward=0.0, correct=False, answer=None, status=status, error=message[:500],
                       traceback=trace[-_TRACEBACK_CHARS:])


def load_callable(path: str):
    """Imports ``module:attr``."""
    module_name, _, attr = path.partition(":")
    return getattr(importlib.import_module(module_name), attr)


def score_one(fn, text: str, gold: str, task: str, timeout_s: float | None, with_answer: bool = False,
              context: dict | None = None) -> SampleScore:
    """Runs reward ``fn`` on one sample, under a SIGALRM time limit when ``timeout_s`` is set (only
    valid in a process's main thread); ``with_answer`` also extracts the canonical answer (maj@k
    needs it, training does not); ``context`` holds the keyword arguments the function declared
    (``prompt``/``row``, see ``functions.context_args``). Never raises for a bad sample."""

    try:
        if timeout_s:
            signal.setitimer(signal.ITIMER_REAL, timeout_s)
        try:
            out = as_output(fn(text, gold, task, **(context or {})), text, gold, task)
            answer = _judge_cached(text, gold, task).answer if with_answer else None
        finally:
            if timeout_s:
                signal.setitimer(signal.ITIMER_REAL, 0)
    except SampleTimeout:
        return _failed(STATUS_TIMEOUT, f"scoring took longer than {timeout_s} s", traceback.format_exc())
    except Exception as err:  # a bad sample or a buggy user reward must not stop the run
        return _failed(STATUS_ERROR, f"{type(err).__name__}: {err}", traceback.format_exc())
    return SampleScore(reward=out.reward, correct=out.correct, answer=answer)


def _raise_timeout(signum, frame):
    raise SampleTimeout()


def install_alarm() -> bool:
    """Installs the SIGALRM handler used by ``score_one``; False when not in the main thread."""
    if threading.current_thread() is not threading.main_thread():
        return False
    signal.signal(signal.SIGALRM, _raise_timeout)
    return True


def _worker_main(conn: Connection, fn_path: str, timeout_s: float) -> None:
    """Worker loop: receive ``(with_answers, [(index, text, gold, task, context), ...])``, send
    ``(index, score)`` per sample; ``None`` ends the loop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    # SIGUSR1 is the trainer's "checkpoint and exit" (SLURM preemption), sent to the whole process
    # group; the rank handles it and stops its pool in order, so a worker must not die of it.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _IGNORED_SIGNALS)  # blocked by _Worker until now
    try:
        fn = load_callable(fn_path)
        _mv_parse("1")  # warm math-verify (sympy import) before the first deadline starts
        install_alarm()
    except BaseException:
        conn.send(("failed", traceback.format_exc()))
        return
    conn.send(_READY)
    while True:
        try:
            chunk = conn.recv()
        except EOFError:
            return
        if chunk is None:
            return
        with_answers, samples = chunk
        for index, text, gold, task, context in samples:
            conn.send((index, score_one(fn, text, gold, task, timeout_s, with_answers, context)))


class _Worker:
    """Parent-side handle of one worker process."""

    def __init__(self, ctx, fn_path: str, timeout_s: float):
        self.conn, child = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=_worker_main, args=(child, fn_path, timeout_s), daemon=True)
        # Workers start lazily, possibly mid-run: a preemption signal that reaches the process
        # group while a new worker imports would kill it before it can ignore the signal. The
        # blocked mask is inherited through fork and exec; _worker_main unblocks it.
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, _IGNORED_SIGNALS)
        try:
            self.proc.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        child.close()  # so that the parent sees EOF when the worker dies
        self.ready = False
        self.pending: collections.deque[int] = collections.deque()
        self.since = time.monotonic()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(timeout=5)
        self.conn.close()


class ScoringPool:
    """A persistent pool of scoring workers; reuse one across training steps (start-up costs ~2 s).

    ``num_workers=0`` scores in the calling process (SIGALRM limit only in the main thread, and
    no protection: a hang in C code hangs the caller, an ``os._exit`` or a segfault ends it).
    ``label`` names the reward in messages (default ``fn_path``). Use as a context manager or call
    ``close()``.
    """

    def __init__(self, *, fn_path: str, num_workers: int, timeout_s: float,
                 start_method: str = "spawn", chunk_size: int = 16, label: str | None = None):
        self.fn_path, self.num_workers, self.timeout_s = fn_path, num_workers, timeout_s
        self.chunk_size = chunk_size
        self.label = label or fn_path
        self.grace_s = max(2.0, timeout_s)
        self._ctx = mp.get_context(start_method)
        self._workers: list[_Worker] = []
        self._items: list[tuple[str, str, str]] = []  # the batch being scored (named in crash reports)
        self._contexts: list[dict] = []  # its reward keyword arguments, one dict per item
        self._deaths: collections.Counter[int] = collections.Counter()  # worker deaths per sample index

    def __enter__(self) -> ScoringPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        """Spawns the workers now rather than at the first ``score``, without waiting for them: they
        import and warm up in the background while the caller does other start-up work."""
        if self.num_workers > 0:
            self._ensure_workers()

    def close(self) -> None:
        """Stops the workers (idempotent)."""
        for worker in self._workers:
            try:
                worker.conn.send(None)
            except (OSError, ValueError):
                pass
        for worker in self._workers:
            worker.proc.join(timeout=5)
            if worker.proc.is_alive():
                worker.kill()
        self._workers = []

    def score(self, items: list[tuple[str, str, str]], *, with_answers: bool = False, desc: str = "scoring",
              progress: bool = False, contexts: list[dict] | None = None) -> list[SampleScore]:
        """Scores ``[(completion_text, gold, task), ...]`` in order; one SampleScore per item.
        ``with_answers`` fills ``SampleScore.answer`` (the maj@k voting key); ``contexts`` (one dict per
        item, or None for none) are extra keyword arguments of the reward function."""
        bar = tqdm(total=len(items), desc=desc, unit="sample", disable=not progress, leave=False)
        contexts = contexts if contexts is not None else [{}] * len(items)
        if len(contexts) != len(items):
            raise ValueError(f"ScoringPool.score: {len(contexts)} contexts for {len(items)} items; give one per item")
        try:
            if self.num_workers == 0:
                return self._score_inline(items, contexts, bar, with_answers)
            return self._score_parallel(items, contexts, bar, with_answers)
        finally:
            bar.close()

    def _score_inline(self, items, contexts, bar, with_answers: bool) -> list[SampleScore]:
        fn = load_callable(self.fn_path)
        in_main = threading.current_thread() is threading.main_thread()
        previous = signal.getsignal(signal.SIGALRM) if in_main else None
        timeout = self.timeout_s if install_alarm() else None
        try:
            out = []
            for (text, gold, task), context in zip(items, contexts):
                out.append(score_one(fn, text, gold, task, timeout, with_answers, context))
                bar.update(1)
            return out
        finally:
            if in_main:  # hand the caller's SIGALRM handler back
                signal.signal(signal.SIGALRM, previous)

    def _ensure_workers(self) -> None:
        if self._ctx.get_start_method() == "fork" and len(self._workers) < self.num_workers:
            _mv_parse("1")  # forked workers then inherit a warm math-verify instead of importing it each
        while len(self._workers) < self.num_workers:
            self._workers.append(_Worker(self._ctx, self.fn_path, self.timeout_s))

    def _score_parallel(self, items, contexts, bar, with_answers: bool) -> list[SampleScore]:
        self._ensure_workers()
        self._items, self._contexts, self._deaths = items, contexts, collections.Counter()
        queue = collections.deque(range(len(items)))
        results: list[SampleScore | None] = [None] * len(items)
        while queue or any(w.pending for w in self._workers):
            self._dispatch(queue, with_answers)
            busy = {w.conn: w for w in self._workers if w.pending or not w.ready}
            for conn in wait(list(busy), timeout=0.5):
                self._receive(busy[conn], queue, results, bar)
            self._enforce_deadlines(queue, results, bar)
        return results  # type: ignore[return-value]

    def _dispatch(self, queue, with_answers: bool) -> None:
        for worker in self._workers:
            if worker.ready and not worker.pending and queue:
                size = max(1, min(self.chunk_size, -(-len(queue) // len(self._workers))))
                chunk = [queue.popleft() for _ in range(min(size, len(queue)))]
                worker.conn.send((with_answers, [(i, *self._items[i], self._contexts[i]) for i in chunk]))
                worker.pending.extend(chunk)
                worker.since = time.monotonic()

    def _receive(self, worker: _Worker, queue, results, bar) -> None:
        try:
            message = worker.conn.recv()
        except (EOFError, OSError):
            if not worker.ready:  # crashed while importing: respawning would crash again
                self.close()
                raise RuntimeError(f"a scoring worker for reward {self.fn_path!r} died during start-up "
                                   f"(exit code {worker.proc.exitcode})") from None
            self._worker_died(worker, queue)
            return
        if message == _READY:
            worker.ready, worker.since = True, time.monotonic()
            return
        if isinstance(message, tuple) and message[0] == "failed":
            self.close()
            raise RuntimeError(f"a scoring worker could not start reward {self.fn_path!r}:\n{message[1]}")
        index, score = message
        if worker.pending and worker.pending[0] == index:
            worker.pending.popleft()
        results[index] = score
        worker.since = time.monotonic()
        bar.update(1)

    def _enforce_deadlines(self, queue, results, bar) -> None:
        now = time.monotonic()
        for worker in list(self._workers):
            if not worker.ready and now - worker.since > _STARTUP_LIMIT_S:
                self.close()
                raise RuntimeError(f"scoring workers did not start within {_STARTUP_LIMIT_S:.0f} s")
            if worker.ready and worker.pending and now - worker.since > self.timeout_s + self.grace_s:
                self._replace(worker, queue, results, bar, STATUS_TIMEOUT,
                              f"worker unresponsive for {self.timeout_s + self.grace_s:.0f} s; killed")

    def _replace(self, worker: _Worker, queue, results, bar, status: str, message: str) -> None:
        """Kills ``worker``, fails its current sample, re-queues the rest of its chunk, respawns."""
        worker.kill()
        if worker.pending:
            results[worker.pending.popleft()] = _failed(status, message)
            bar.update(1)
            queue.extendleft(reversed(worker.pending))
        self._respawn(worker)

    def _respawn(self, worker: _Worker) -> None:
        self._workers[self._workers.index(worker)] = _Worker(self._ctx, self.fn_path, self.timeout_s)

    def _worker_died(self, worker: _Worker, queue) -> None:
        """A ready worker ended (os._exit, segfault, OOM kill): its whole chunk goes back to the
        queue, the sample it was scoring first, on a fresh worker. That sample's second kill stops
        scoring: respawning forever would hide a reward function that cannot run."""
        worker.proc.join(timeout=5)
        how = _exit_text(worker.proc.exitcode)
        worker.kill()
        if worker.pending:
            index = worker.pending[0]
            self._deaths[index] += 1
            if self._deaths[index] >= MAX_WORKER_DEATHS:
                self.close()
                text, gold, task = self._items[index]
                raise RewardFunctionCrashed(
                    f"reward.fn={self.label!r} killed its worker process ({how}) on sample {index} of this batch, "
                    f"{self._deaths[index]} times, so scoring stopped. A reward function must return a "
                    f"reward or raise; something in it ends the process (os._exit, sys.exit, a segfault or abort in "
                    f"C code, an out-of-memory kill). The sample: completion {text[:300]!r}, gold {gold!r}, "
                    f"task {task!r}.")
            log.warning("reward.fn=%r killed its scoring worker (%s) on sample %d; retrying the sample once on a "
                        "fresh worker", self.label, how, index)
            queue.extendleft(reversed(worker.pending))
        self._respawn(worker)


def _exit_text(code: int | None) -> str:
    if code is None:
        return "no exit status"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
