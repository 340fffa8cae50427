"""Making reward failures visible: each distinct error once with its traceback, and per-batch alarms.

    SampleScore(status error|timeout, error, traceback) --ErrorLog.record--> first occurrence of each
        distinct failure (status + first line of the message) logged once with its traceback and
        queued for the driver's artifact (``new()``); later ones only counted
    ScoringStats of a batch --FailureMonitor.observe--> warning when more than half failed; after
        reward.max_failed_batches batches in a row where every reward failed: RewardFunctionFailing

A failed sample scores 0 (pool.py); without these the run would go on training on zeros.
Both live on the process that scores (rank 0), so their log lines are rank 0's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from megatron_gtpo.reward.pool import STATUS_OK, SampleScore


log = logging.getLogger(__name__)

MAX_DISTINCT_ERRORS = 50
"""Distinct failures logged with a traceback; beyond that (messages that embed the sample) they are
only counted, so a run cannot flood its log."""


@dataclass(kw_only=True)
class ScoringStats:
    """Counters of one scoring call (log them: a rising timeout count means adversarial outputs)."""

    num_samples: int = 0
    """Completions scored."""
    num_timeouts: int = 0
    """Completions that hit the per-sample time limit (scored 0)."""
    num_errors: int = 0
    """Completions whose reward function raised or whose worker died (scored 0)."""
    num_overlong: int = 0
    """Completions that received a non-zero overlong punishment."""
    seconds: float = 0.0
    """Wall-clock time of the call."""

    def metrics(self, prefix: str = "reward/") -> dict[str, float]:
        """Flat metric names -> values for StepMetrics / MLflow."""
        return {f"{prefix}num_samples": float(self.num_samples), f"{prefix}timeouts": float(self.num_timeouts),
                f"{prefix}errors": float(self.num_errors), f"{prefix}overlong": float(self.num_overlong),
                f"{prefix}seconds": self.seconds}


class RewardFunctionFailing(RuntimeError):
    """Every reward failed for ``reward.max_failed_batches`` scoring batches in a row."""


@dataclass(frozen=True, kw_only=True)
class RewardError:
    """The first occurrence of one distinct reward failure (a row of the reward-errors artifact)."""

    fn: str
    """The reward function (``reward.fn``)."""
    status: str
    """'error' (the function raised or returned a non-finite value) or 'timeout'."""
    error: str
    """First line of the message (``RuntimeError: boom``): what makes two failures the same."""
    traceback: str
    """Formatted traceback (for a timeout: where the alarm interrupted it); '' when the worker was killed."""
    completion: str
    """Start of the completion that triggered it (2000 characters at most)."""
    gold: str
    """Its reference answer."""
    task: str
    """Its checker task."""
    batch: int
    """Scoring call (1-based) in which it first occurred."""


class ErrorLog:
    """Distinct reward failures of one scorer: logged once each, handed out once each."""

    def __init__(self, fn: str):
        self.fn = fn
        self.counts: dict[str, int] = {}
        """'status: first line of the message' -> occurrences so far."""
        self._new: list[RewardError] = []
        self._calls = 0
        self._capped = False

    def record(self, items: list[tuple[str, str, str]], scores: list[SampleScore]) -> None:
        """Counts the failures among ``scores`` (``items`` are the scored (text, gold, task))."""
        self._calls += 1
        for (text, gold, task), score in zip(items, scores):
            if score.status == STATUS_OK:
                continue
            first_line = (score.error.splitlines() or [""])[0]
            key = f"{score.status}: {first_line}"
            if key in self.counts:
                self.counts[key] += 1
                continue
            if len(self.counts) >= MAX_DISTINCT_ERRORS:
                if not self._capped:
                    log.warning("reward.fn=%s: more than %d distinct reward failures; further new ones are only "
                                "counted (reward/errors, reward/timeouts)", self.fn, MAX_DISTINCT_ERRORS)
                    self._capped = True
                continue
            self.counts[key] = 1
            error = RewardError(fn=self.fn, status=score.status, error=first_line, traceback=score.traceback,
                                completion=text[:2000], gold=gold, task=task, batch=self._calls)
            self._new.append(error)
            log.warning("reward.fn=%s: new reward %s (first of its kind; later ones are only counted): %s\n"
                        "completion: %r\n%s", self.fn, score.status, score.error, text[:300],
                        score.traceback.rstrip() or "(no traceback: the scoring worker was killed)")

    def new(self) -> list[RewardError]:
        """Distinct failures first seen since the previous call (oldest first)."""
        out, self._new = self._new, []
        return out


class FailureMonitor:
    """Per-batch failure alarms of one scorer (see module docstring)."""

    def __init__(self, fn: str, *, max_failed_batches: int):
        self.fn = fn
        self.max_failed_batches = max_failed_batches
        self.failed_in_a_row = 0
        """Scoring batches in a row in which every reward failed."""

    def observe(self, stats: ScoringStats) -> None:
        """Warns when more than half of a batch's rewards failed; raises RewardFunctionFailing when
        every reward failed in ``max_failed_batches`` batches in a row (0: never)."""
        failed, total = stats.num_errors + stats.num_timeouts, stats.num_samples
        if not total:
            return
        self.failed_in_a_row = self.failed_in_a_row + 1 if failed == total else 0
        what = f"{stats.num_errors} errors, {stats.num_timeouts} timeouts"
        if self.failed_in_a_row and self.max_failed_batches and self.failed_in_a_row >= self.max_failed_batches:
            raise RewardFunctionFailing(
                f"reward.fn={self.fn}: every reward failed in {self.failed_in_a_row} scoring batches in a row "
                f"({what} in the last one); stopping instead of training on rewards that are all 0. The first "
                f"traceback of each distinct failure is in the log. Fix the reward function, raise "
                f"reward.timeout_s if it times out, or set reward.max_failed_batches=0 to go on regardless")
        if self.failed_in_a_row:
            limit = (f"the run stops after reward.max_failed_batches={self.max_failed_batches}"
                     if self.max_failed_batches else "reward.max_failed_batches=0: the run goes on")
            log.warning("reward.fn=%s: EVERY reward of this batch failed (%d of %d: %s): this step trains on "
                        "rewards that are all 0. %d batch(es) in a row; %s", self.fn, failed, total, what,
                        self.failed_in_a_row, limit)
        elif 2 * failed > total:
            log.warning("reward.fn=%s: %d of %d rewards failed in this batch (%s); they score 0. The first traceback "
                        "of each distinct failure is in the log", self.fn, failed, total, what)
