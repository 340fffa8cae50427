"""Integrity of the checkpoint folder: per-step manifests, stale-save cleanup, the resume decision.

Plain file-system code (no torch, no Megatron), so the launcher can check a run dir in well under
a second before any rank or engine starts; ``megatron_gtpo.checkpoint`` adds the collective,
parallel variants the ranks use.

Every committed ``step_*`` dir holds ``manifest.json``, written after all ranks finished writing
and before the rename that commits the dir::

    {"format": 1, "step": 100, "hash": "sha256",
     "files": {"common.pt": {"size": 2711, "sha256": "9f2c..."}, "__0_0.distcp": {...}, ...}}

A step dir is *usable* when its manifest is readable, lists ``common.pt`` and ``.metadata``, and
every listed file exists with the listed size (and, when checked, the listed sha256). The run dir
layout known here: ``<run dir>/checkpoints/step_<8 digits>``, ``<run dir>/PREEMPTED``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal

from megatron_gtpo.utils.atomic import write_text_atomic

log = logging.getLogger("megatron_gtpo")

CHECKPOINTS = "checkpoints"
"""Subfolder of the run dir that holds the step dirs."""
MANIFEST = "manifest.json"
HASH = "sha256"  # with SHA-NI ~1.4 GB/s per core here; blake2b 0.57 GB/s, md5 0.64 GB/s (xxhash not installed)
REQUIRED = ("common.pt", ".metadata")  # Megatron reads these first; a missing one must be named, not crash it
PREEMPTED = "PREEMPTED"
STEP_DIR = re.compile(r"^step_(\d{8,})$")
STALE = re.compile(r"^\.(tmp|old)_step_\d{8,}$")  # a save in progress, or a replaced step being deleted
_CHUNK = 1 << 20

ResumeMode = Literal["off", "auto", "require"]


class CheckpointError(RuntimeError):
    """No usable checkpoint where one is required, or a corrupt one was asked for by step; the
    message names the run dir or file, the problem and the fix."""


@dataclass(frozen=True)
class FileRecord:
    """One file of a step dir as the manifest lists it."""

    size: int
    """Bytes."""
    digest: str
    """Hex sha256 of the content."""


@dataclass(frozen=True)
class ResumePoint:
    """The checkpoint a run continues from."""

    step: int
    """Last completed step saved in it (the run continues with step + 1)."""
    path: Path
    """Its ``step_*`` dir."""
    skipped: tuple[str, ...] = ()
    """Problems of newer step dirs that were passed over (empty when the newest is used)."""


def step_dir(root: str | Path, step: int) -> Path:
    """``root/step_<step, 8 digits>``: where a completed save of ``step`` lives."""
    return Path(root) / f"step_{step:08d}"


def step_dirs(root: str | Path) -> list[tuple[int, Path]]:
    """Committed ``(step, dir)`` pairs under ``root``, newest first (unverified)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := STEP_DIR.match(p.name))]
    return sorted(found, reverse=True)


# ----------------------------------------------------------------------------- manifest


def digest_file(path: Path, *, sync: bool = False) -> FileRecord:
    """Size and sha256 of ``path``; ``sync`` also flushes it to stable storage (torch.save does not)."""
    digest = hashlib.new(HASH)
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb") as handle:
        while n := handle.readinto(buffer):
            digest.update(view[:n])  # hashlib drops the GIL on large updates
        if sync:
            os.fsync(handle.fileno())
        size = handle.tell()
    return FileRecord(size=size, digest=digest.hexdigest())


def hash_files(directory: Path, names: list[str], *, sync: bool = False) -> dict[str, FileRecord]:
    """``{name: FileRecord}`` for ``names`` inside ``directory``."""
    return {name: digest_file(directory / name, sync=sync) for name in names}


def list_files(directory: Path) -> list[str]:
    """Every regular file under ``directory`` (relative POSIX paths), the manifest excluded."""
    return sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*")
                  if p.is_file() and p.name != MANIFEST)


def write_manifest(directory: Path, step: int, records: dict[str, FileRecord]) -> Path:
    """Writes ``directory/manifest.json`` and syncs it and the directory entries (before the commit rename)."""
    body = {"format": 1, "step": step, "hash": HASH,
            "files": {name: {"size": r.size, HASH: r.digest} for name, r in sorted(records.items())}}
    path = directory / MANIFEST
    with open(path, "w") as handle:
        json.dump(body, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())
    fsync_dir(directory)
    return path


def fsync_dir(directory: Path) -> None:
    """Makes renames/creations inside ``directory`` durable (a power loss keeps them)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_manifest(directory: Path) -> tuple[dict[str, FileRecord], list[str]]:
    """``(files, problems)``: the manifest's records, or the reasons it cannot be used."""
    path = directory / MANIFEST
    if not path.is_file():
        return {}, [f"{path}: missing (the save never finished, or the dir was copied incompletely)"]
    try:
        body = json.loads(path.read_text())
        files = {name: FileRecord(size=int(entry["size"]), digest=str(entry[body["hash"]]))
                 for name, entry in body["files"].items()}
    except (OSError, ValueError, KeyError, TypeError) as err:
        return {}, [f"{path}: unreadable ({type(err).__name__}: {err})"]
    problems = [f"{directory / name}: not listed in {MANIFEST} (a required file)" for name in REQUIRED
                if name not in files]
    return files, problems


def file_problems(directory: Path, files: dict[str, FileRecord], *, checksums: bool) -> list[str]:
    """What is wrong with each of ``files`` inside ``directory``: missing, wrong size, wrong sha256."""
    problems = []
    for name, want in files.items():
        path = directory / name
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            problems.append(f"{path}: missing")
            continue
        if size != want.size:
            kind = "truncated" if size < want.size else "longer than saved"
            problems.append(f"{path}: {kind}: {size} bytes, the manifest says {want.size}")
        elif checksums and (got := digest_file(path).digest) != want.digest:
            problems.append(f"{path}: corrupt content: {HASH} {got[:16]}..., the manifest says {want.digest[:16]}...")
    return problems


def verify(directory: Path, *, checksums: bool) -> list[str]:
    """Every problem of one step dir (empty = usable). Single process; the ranks split the work
    with ``megatron_gtpo.checkpoint.verify_parallel``."""
    files, problems = read_manifest(directory)
    return problems + file_problems(directory, files, checksums=checksums)


def share_of(files: dict[str, FileRecord], rank: int, world: int) -> dict[str, FileRecord]:
    """This rank's part of ``files`` for parallel hashing: largest first onto the least loaded
    rank (deterministic, so the parts of all ranks cover every file exactly once)."""
    loads, mine = [0] * world, {}
    for name, record in sorted(files.items(), key=lambda item: (-item[1].size, item[0])):
        owner = loads.index(min(loads))
        loads[owner] += record.size + 1
        if owner == rank:
            mine[name] = record
    return mine


# ----------------------------------------------------------------------------- resume decision


def resolve_mode(resume: bool | str) -> ResumeMode:
    """``--resume`` -> "require" (error without a usable checkpoint), ``--resume=auto`` -> "auto"
    (fresh start without one), absent -> "off"."""
    if resume in (True, "require"):
        return "require"
    if resume in (False, None, "off"):
        return "off"
    if resume == "auto":
        return "auto"
    raise ValueError(f"resume={resume!r}: expected True/'require', 'auto' or False/'off'")


def add_resume_options(parser: argparse.ArgumentParser) -> None:
    """``--resume`` / ``--resume=auto`` as one ``resume`` attribute ("require" / "auto" / "off").
    ``--resume=auto`` is its own option string, so ``--resume key=value`` keeps reading the
    override as an override."""
    parser.add_argument("--resume", dest="resume", action="store_const", const="require", default="off",
                        help="continue from the newest usable checkpoint in the run dir; an error when there is none")
    parser.add_argument("--resume=auto", dest="resume", action="store_const", const="auto",
                        help="continue from the newest usable checkpoint, or start fresh when there is none")


def select(candidates: list[tuple[int, Path]], problems_of: Callable[[Path], list[str]], *,
           warn: bool = True) -> tuple[ResumePoint | None, list[str]]:
    """The newest candidate without problems, and the problems of those passed over (each bad
    candidate logged as a warning when ``warn``)."""
    passed: list[str] = []
    for step, path in candidates:
        problems = problems_of(path)
        if not problems:
            return ResumePoint(step=step, path=path, skipped=tuple(passed)), passed
        if warn:
            log.warning("checkpoint %s is unusable: %s", path, "; ".join(problems))
        passed.extend(problems)
    return None, passed


def no_checkpoint_error(run_dir: Path, problems: list[str], mode: ResumeMode = "require") -> CheckpointError:
    """The error of a resume without a usable checkpoint: names the run dir, why, and the fix."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        why = f"{root} does not exist"
    elif not problems:
        why = f"{root} holds no step_* checkpoint"
    else:
        why = "every checkpoint is unusable: " + "; ".join(problems)
    option = "--resume" if mode == "require" else "--resume=auto"
    return CheckpointError(
        f"{option}: no usable checkpoint in run dir {Path(run_dir)}: {why}. To continue this run, restore its "
        f"checkpoints into {root}; to start over, run without {option} (--resume=auto starts fresh only when there "
        "is no checkpoint at all), ideally with another --output-dir")


def check_resume(run_dir: str | Path, resume: bool | str) -> ResumePoint | None:
    """Launcher-side check before any rank starts (sizes only, no hashing: fast on any size):
    the step to resume from, or None for a fresh start. The ranks verify the sha256 sums too
    (``checkpoint.prepare_resume``)."""
    mode, run_dir = resolve_mode(resume), Path(run_dir)
    if mode == "off":
        refuse_fresh_start_over(run_dir)
        return None
    point, problems = select(step_dirs(run_dir / CHECKPOINTS), lambda p: verify(p, checksums=False))
    return resume_decision(run_dir, mode, point, problems)


def refuse_fresh_start_over(run_dir: Path) -> None:
    """CheckpointError when a run without ``--resume`` would start over a run dir that holds
    checkpoints: its saves would mix with the old steps (a later resume could pick an old one)."""
    root = Path(run_dir) / CHECKPOINTS
    if dirs := step_dirs(root):
        raise CheckpointError(
            f"run dir {Path(run_dir)} already holds checkpoints (newest: {dirs[0][1].name}) but neither --resume nor "
            f"--resume=auto was given: continue that run with --resume, or start a new one with another "
            f"--output-dir (or delete {root} first)")


def resume_decision(run_dir: Path, mode: ResumeMode, point: ResumePoint | None,
                    problems: list[str]) -> ResumePoint | None:
    """``point``, or None (fresh start) under "auto" when there is no step dir at all. With
    ``--resume``, or with step dirs that are all unusable, a CheckpointError: a run never
    silently restarts from step 0 over a run dir that holds (broken) progress."""
    if point is None and (mode == "require" or problems):
        raise no_checkpoint_error(run_dir, problems, mode)
    return point


# ----------------------------------------------------------------------------- housekeeping


def clean_stale(root: str | Path) -> list[Path]:
    """Deletes ``.tmp_step_*`` (saves cut short by a crash) and ``.old_step_*`` (replaced steps
    whose deletion was cut short) under ``root``; one log line each. Call on one rank, before the
    first save of the run."""
    root = Path(root)
    stale = sorted(p for p in root.iterdir() if STALE.match(p.name)) if root.is_dir() else []
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
        log.info("checkpoint: removed %s, left over by an interrupted save", path)
    return stale


def mark_preempted(run_dir: str | Path, step: int) -> None:
    """Writes ``<run dir>/PREEMPTED`` (the step whose checkpoint was saved before exiting)."""
    write_text_atomic(Path(run_dir) / PREEMPTED, f"{step}\n")


def clear_preempted(run_dir: str | Path) -> None:
    """Removes the PREEMPTED marker once the run continues (logged)."""
    marker = Path(run_dir) / PREEMPTED
    if marker.exists():
        marker.unlink()
        log.info("removed %s: the run continues", marker)


def prunable(root: Path, *, saved: int, keep_last: int) -> list[Path]:
    """Step dirs to delete after saving step ``saved``: every dir older than ``saved`` that is not
    among the newest ``keep_last`` usable ones (manifest + sizes). A corrupt dir never counts
    toward ``keep_last``, so the last good checkpoint survives; dirs newer than ``saved`` (left
    from before a resume) are replaced when their step is saved again."""
    kept, doomed = 0, []
    for step, path in step_dirs(root):
        if step > saved:
            continue
        if kept < keep_last and (step == saved or not verify(path, checksums=False)):
            kept += 1
        else:
            doomed.append(path)
    return doomed
