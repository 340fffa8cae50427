"""Crash-safe writes: build in a temporary sibling, then rename over the target in one step."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Writes ``text`` to ``path`` via a synced temp file and ``os.replace`` (never half-written)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


@contextlib.contextmanager
def atomic_directory(final: str | os.PathLike, *, replace: bool = True):
    """Yields an empty temp directory next to ``final``; when the block succeeds it becomes
    ``final``, when it raises the temp directory is deleted.

    ``replace=False`` is for caches that several processes may fill at once (torchrun ranks on a
    fresh machine): if another process committed ``final`` first, its copy is kept and ours is
    dropped, so no reader ever sees the directory disappear.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}-"))
    try:
        yield tmp
        if final.exists() and replace:
            shutil.rmtree(final)
        try:
            os.replace(tmp, final)
        except OSError:
            if replace or not final.exists():
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another process won the race
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
