"""The background threads that publish the journal, one per backend (MLflow, W&B, TensorBoard):
the only threads that wait on a backend, so one backend's outage never delays another's records."""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from megatron_gtpo.tracking.journal import Journal
from megatron_gtpo.tracking.publisher import Publisher
from megatron_gtpo.tracking.uri import redact_uri

log = logging.getLogger("megatron_gtpo")

BACKOFF_S = (0.5, 15.0)
"""First and largest wait before retrying a store that failed (doubling in between)."""


class BackendUnavailable(RuntimeError):
    """A backend that cannot work in this process at all (its package is missing): its worker
    warns once with this message (which names the fix) and stops; the records stay in the journal."""


class Worker:
    """Runs a publisher's ``pump`` whenever records arrive; after a failure waits (backoff) instead.

    Bookkeeping with generation numbers: every ``notify`` bumps ``requested``; a pump that started
    at generation g and succeeded sets ``served = g``, so ``served >= g`` means every record
    appended before that notify is in the backend (or waits for a checkpoint)."""

    def __init__(self, journal: Journal, *, uri: str = "", name: str = "mlflow", label: str | None = None,
                 fix: str = "", make: Callable[[], object] | None = None):
        """``uri``: MLflow's (the default backend). Other backends: ``name``, ``label`` (how the
        warnings call it), ``fix`` (what to do when it fails) and ``make`` (builds its publisher:
        an object with ``can_delete`` and ``pump(stop)``, as ``Publisher``)."""
        self.journal = journal
        self.uri = uri
        self.name = name
        self.label = label or f"MLflow at {redact_uri(uri)}"
        self.fix = fix
        self._make = make or (lambda: Publisher(journal))
        self.unavailable: str | None = None
        """Why this backend is off for the whole process (BackendUnavailable), else None."""
        self.publisher = None
        """The backend's publisher, once built (by this worker's thread)."""
        self.can_delete: bool | None = None
        """Whether the store can delete re-run steps (None until the store was reached)."""
        self.outage_since: float | None = None
        self.last_error: str | None = None
        self._cv = threading.Condition()
        self._requested = 1  # the first pump creates the run
        self._served = 0
        self._failed_gen = 0
        self._failures = 0
        self._retry_at = 0.0
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name=f"{name}-tracking", daemon=True)
        self._thread.start()

    def notify(self) -> None:
        """New records or state: publish them (after the backoff when the store is down)."""
        with self._cv:
            self._requested += 1
            self._cv.notify_all()

    def flush(self, timeout_s: float) -> bool:
        """Waits until everything logged so far is published (True), or ``timeout_s``, or until a
        try that saw it all failed while the store has failed at least twice in a row (one
        failure may be a blip): a dead store costs one or two more failed tries, not the whole
        timeout; a slow but working one gets the time."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            self._requested += 1
            target = self._requested
            self._retry_at = 0.0  # skip the backoff: try now
            self._cv.notify_all()
            while self._served < target and not (self._failed_gen >= target and self._failures >= 2) \
                    and self.unavailable is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(left)
            return self._served >= target

    def wait_for_run(self, timeout_s: float) -> None:
        """Returns once the first try ended (run created, or store down) or after ``timeout_s``."""
        with self._cv:
            self._cv.wait_for(lambda: self._served >= 1 or self._failures > 0 or self.unavailable, timeout_s)

    def stop(self) -> None:
        """Ends the thread after its current request (it is a daemon: process exit never waits)."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        self._thread.join(timeout=1.0)

    def _due(self) -> bool:
        return self._served < self._requested and time.monotonic() >= self._retry_at

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._stopping and not self._due():
                    waiting = self._served < self._requested
                    self._cv.wait(max(self._retry_at - time.monotonic(), 0.01) if waiting else None)
                if self._stopping:
                    return
                gen = self._requested
            error = None
            try:
                self.publisher = self.publisher or self._make()
                self.can_delete = self.publisher.can_delete
                self.publisher.pump(stop=lambda: self._stopping)
            except BackendUnavailable as err:
                self._give_up(str(err))
                return
            except Exception as err:  # noqa: BLE001 - any store failure is retried, never raised into training
                error = err
            self._finish_try(gen, error)

    def _give_up(self, why: str) -> None:
        log.warning("tracking: %s", why)
        with self._cv:
            self.unavailable = why
            self._cv.notify_all()

    def _finish_try(self, gen: int, error: Exception | None) -> None:
        with self._cv:
            if error is None:
                self._served, self._failures = gen, 0
                down_since, self.outage_since = self.outage_since, None
            else:
                self._failed_gen = gen
                self._failures += 1
                self._retry_at = time.monotonic() + min(BACKOFF_S[0] * 2 ** (self._failures - 1), BACKOFF_S[1])
                self.last_error = f"{type(error).__name__}: {error}"[:400]
                first = self.outage_since is None
                if first:
                    self.outage_since = time.time()
            self._cv.notify_all()
        if error is None and down_since is not None:
            log.info("tracking: %s answers again after %.0fs; the backlog was sent", self.label,
                     time.time() - down_since)
        elif error is not None and first:
            log.warning("tracking: %s failed (%s); training goes on, records are kept in %s and sent "
                        "when it answers%s", self.label, self.last_error, self.journal.path,
                        f". Fix: {self.fix}" if self.fix else "")
