"""The tracking journal: every record a run logs, on local disk before anything is sent.

Layout under ``<run dir>/tracking/``::

    journal.jsonl   one JSON record a line, append-only, in the order the driver logged them
    state.json      how far MLflow has it (byte offset), and each other backend (W&B,
                    TensorBoard: ``sinks``), the run id, the commit watermark, the wanted run
                    status; rewritten atomically
    files/          copies of logged artifact files (the originals may change before they are sent)
    lock            flock'ed by the live process that writes the journal

Records (``t`` = type): ``params`` {params}; ``metrics`` {step, ts (ms), m: {key: value}};
``text`` {path, text, step?}; ``file`` {file (under files/), dir?}; ``rewind`` {to}: the run
resumed from the checkpoint of step ``to``, so records logged before it for later steps were re-run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from megatron_gtpo.utils.atomic import write_text_atomic
from megatron_gtpo.utils.configuration import ConfigError

log = logging.getLogger("megatron_gtpo")

TERMINAL = ("FINISHED", "FAILED", "KILLED")


@dataclass(kw_only=True)
class JournalState:
    """What ``state.json`` holds: the MLflow side of the journal and the run's lifecycle."""

    uri: str
    """Tracking URI the records go to."""
    experiment: str
    """MLflow experiment name (created when missing)."""
    run_name: str
    """MLflow run name."""
    artifact_location: str | None = None
    """Artifact root of a new experiment in a local store (None: the server decides)."""
    journal_id: str = ""
    """Random id, also a tag of the MLflow run: finds the run again if a create_run reply was lost."""
    run_id: str | None = None
    """MLflow run id; None until the worker created the run in the store."""
    sent_offset: int = 0
    """Bytes of journal.jsonl published or skipped (always a prefix of whole lines)."""
    next_seq: int = 0
    """seq of the next record (rechecked against the journal's tail at open)."""
    committed_step: int = 0
    """Highest step covered by a committed checkpoint: stores that cannot delete publish up to it."""
    release_all: bool = False
    """The run ended FINISHED: every record is final, none waits for a checkpoint."""
    rewinds: list[list[int]] = field(default_factory=list)
    """[seq, step] per resume: a record with a seq below and a step above was re-run (superseded)."""
    status: str = "RUNNING"
    """MLflow status the run should have (RUNNING, FINISHED, FAILED, KILLED)."""
    reason: str | None = None
    """Why the run ended FAILED/KILLED (set as the run tag ``megatron_gtpo.end_reason``)."""
    published_status: str | None = None
    """Status last set in the store."""
    params_logged: bool = False
    """The params record is in the journal (a resumed run does not log them again)."""
    rejected: int = 0
    """Records the store refused as invalid; they stay in the journal and are not retried."""
    owner: dict[str, Any] = field(default_factory=dict)
    """pid, host and start time of the process that last opened the journal."""
    sinks: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Progress of each backend other than MLflow (``wandb``, ``tensorboard``): ``offset`` (bytes
    of journal.jsonl it has, as ``sent_offset`` for MLflow) and ``status`` (last run status set)."""


class Journal:
    """Append-only record log plus state, shared by the training thread (appends, commits) and
    the worker thread (reads, marks sent): ``update`` and ``snapshot`` take one lock."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.path = self.root / "journal.jsonl"
        self.state_path = self.root / "state.json"
        self._lock = threading.Lock()
        self._append_fh = None
        self._lock_fh = None
        self._state: JournalState | None = None

    # ------------------------------------------------------------------ state

    def load_state(self) -> JournalState | None:
        """The state on disk, or None when this directory holds no journal."""
        if not self.state_path.exists():
            return None
        data = json.loads(self.state_path.read_text())
        known = {f.name for f in dataclasses.fields(JournalState)}
        self._state = JournalState(**{k: v for k, v in data.items() if k in known})
        return self._state

    def set_state(self, state: JournalState) -> None:
        with self._lock:
            self._state = state
            self._save()

    def snapshot(self) -> JournalState:
        """A copy of the current state (safe to read while the other thread updates it)."""
        with self._lock:
            return dataclasses.replace(self._state, rewinds=[list(r) for r in self._state.rewinds],
                                       sinks={k: dict(v) for k, v in self._state.sinks.items()})

    def update(self, **changes: Any) -> None:
        """Sets fields of the state and writes state.json atomically."""
        with self._lock:
            for key, value in changes.items():
                setattr(self._state, key, value)
            self._save()

    def update_sink(self, name: str, **changes: Any) -> None:
        """Sets fields of backend ``name``'s entry in ``sinks`` (under the lock: the workers of
        several backends update the state at once)."""
        with self._lock:
            self._state.sinks = {**self._state.sinks, name: {**self._state.sinks.get(name, {}), **changes}}
            self._save()

    def _save(self) -> None:
        write_text_atomic(self.state_path, json.dumps(dataclasses.asdict(self._state), indent=1))

    # ------------------------------------------------------------------ owner lock

    def acquire(self, *, wait_s: float = 0.0) -> None:
        """Marks this process as the journal's writer (flock on ``lock``). While a live process
        holds it, retries for ``wait_s`` (a previous rank 0 still exiting, an NFS lock of a lost
        node until its lease ends), then raises ConfigError naming that process. On filesystems
        without flock, goes on unlocked."""
        import fcntl

        self.root.mkdir(parents=True, exist_ok=True)
        fh = open(self.root / "lock", "a+")
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() < deadline:
                    time.sleep(1.0)
                    continue
                fh.close()
                owner = (self.load_state() or JournalState(uri="", experiment="", run_name="")).owner
                raise ConfigError(f"output_dir: another live process ({_who(owner)}) writes the tracking journal "
                                  f"{self.root}; stop it, or use another --output-dir") from None
            except OSError as err:  # e.g. ENOLCK on some network filesystems
                log.warning("tracking: cannot lock %s (%s); make sure one process writes it", self.root, err)
                break
        self._lock_fh = fh

    def release(self) -> None:
        if self._lock_fh is not None:
            self._lock_fh.close()
            self._lock_fh = None

    @staticmethod
    def owner_record() -> dict[str, Any]:
        return {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}

    # ------------------------------------------------------------------ records

    def open_for_append(self) -> None:
        """Drops a torn last line (a kill mid-write), fixes next_seq from the tail, opens for append."""
        self.root.mkdir(parents=True, exist_ok=True)
        self.path.touch()
        state = self.snapshot()
        good_end, last_seq = state.sent_offset, state.next_seq - 1
        for record, end in self.read(state.sent_offset):
            good_end, last_seq = end, max(last_seq, record.get("seq", -1))
        size = self.path.stat().st_size
        if size > good_end:
            log.warning("tracking: dropping %d bytes of a torn record at the end of %s", size - good_end, self.path)
            os.truncate(self.path, good_end)
        self.update(next_seq=last_seq + 1)
        self._append_fh = open(self.path, "ab")

    def append(self, record: dict[str, Any]) -> int:
        """Writes one record (flushed to the OS: it survives a kill of this process); returns its seq."""
        with self._lock:
            seq = self._state.next_seq
            self._state.next_seq += 1
            line = json.dumps({"seq": seq, **record}, separators=(",", ":"), default=str) + "\n"
            self._append_fh.write(line.encode())
            self._append_fh.flush()
        return seq

    def fsync(self) -> None:
        """Forces appended records to disk (at checkpoints and at the end: survives a node crash)."""
        if self._append_fh is not None:
            with self._lock:
                os.fsync(self._append_fh.fileno())

    def close(self) -> None:
        if self._append_fh is not None:
            self.fsync()
            self._append_fh.close()
            self._append_fh = None
        self.release()

    def read(self, offset: int, *, max_records: int | None = None) -> Iterator[tuple[dict[str, Any], int]]:
        """(record, byte offset after it) of the whole lines from ``offset``; stops at a partial
        line (still being written) or after ``max_records``. A corrupt whole line is skipped."""
        if not self.path.exists():
            return
        count = 0
        with open(self.path, "rb") as fh:
            fh.seek(offset)
            while max_records is None or count < max_records:
                line = fh.readline()
                if not line.endswith(b"\n"):
                    return
                offset += len(line)
                try:
                    record = json.loads(line)
                except ValueError:
                    log.error("tracking: skipping a corrupt line ending at byte %d of %s", offset, self.path)
                    continue
                count += 1
                yield record, offset

    def keep_file(self, src: str | os.PathLike) -> str:
        """Copies an artifact file into files/ (sent later); returns its path relative to the root."""
        with self._lock:
            seq = self._state.next_seq
        rel = f"files/{seq:08d}/{Path(src).name}"  # the artifact keeps the file's name
        (self.root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, self.root / rel)
        return rel

    def archive(self) -> Path:
        """Moves the whole journal aside (a fresh, non-resumed run starts a new one here)."""
        target = self.root.with_name(f"{self.root.name}.{time.strftime('%Y%m%d-%H%M%S')}")
        self.release()
        os.replace(self.root, target)
        return target


def superseded(record: dict[str, Any], rewinds: list[list[int]]) -> bool:
    """True when a later resume rewound below this record's step: the step was re-run."""
    step = record.get("step")
    return step is not None and any(seq > record["seq"] and to < step for seq, to in rewinds)


def held(record: dict[str, Any], state: JournalState) -> bool:
    """Stores without delete: a step's records wait until a checkpoint covers the step."""
    step = record.get("step")
    return step is not None and not state.release_all and step > state.committed_step


def next_batch(journal: Journal, state: JournalState, offset: int, *, can_delete: bool,
               max_records: int) -> tuple[list[tuple[dict[str, Any], int]], int]:
    """The records a backend may publish now from ``offset`` (up to ``max_records``), each with the
    offset after it, and the offset after them all: every record for a backend that can delete
    re-run steps; for one that cannot, up to the first record still held for a checkpoint.
    Superseded records are included (the backend skips them, and the offset passes them)."""
    batch: list[tuple[dict[str, Any], int]] = []
    end = offset
    for record, after in journal.read(offset, max_records=max_records):
        if not superseded(record, state.rewinds) and not can_delete and held(record, state):
            break
        batch.append((record, after))
        end = after
    return batch, end


def backlog(journal: Journal, state: JournalState, *, can_delete: bool | None,
            offset: int | None = None) -> tuple[int, int]:
    """(unsent records, of which held for a checkpoint) from ``offset`` (default MLflow's
    ``state.sent_offset``) on. ``can_delete`` None: the store type is not known yet, nothing is
    counted as held."""
    unsent = waiting = 0
    for record, _ in journal.read(state.sent_offset if offset is None else offset):
        if record.get("t") == "rewind" or superseded(record, state.rewinds):
            continue
        unsent += 1
        waiting += int(can_delete is False and held(record, state))
    return unsent, waiting


def _who(owner: dict[str, Any]) -> str:
    return f"pid {owner.get('pid', '?')} on {owner.get('host', '?')}, started {owner.get('started', '?')}"


@contextlib.contextmanager
def locked_journal(root: str | os.PathLike) -> Iterator[Journal]:
    """A journal of a run that no process writes now (replay and status tools)."""
    journal = Journal(root)
    if journal.load_state() is None:
        raise FileNotFoundError(f"{root} holds no tracking journal (state.json); pass the run directory")
    journal.acquire()
    try:
        yield journal
    finally:
        journal.release()
