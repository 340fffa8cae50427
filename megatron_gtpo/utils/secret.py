"""The job's secret: the key every rollout-server connection and transfer-group rendezvous proves.

One secret per job run, 32 random bytes written as 64 hex digits into a file that only the job's
owner can read (mode 0600, in a directory of mode 0700), and handed to the job's processes as the
*path* of that file in ``MGTPO_SECRET_FILE`` (the value itself is never in an environment, a
command line, a log, the config or MLflow):

* ``slurm/train.sbatch`` makes ``OUTPUT_DIR/.secret/job.key`` at every (re)start of the job and
  exports ``MGTPO_SECRET_FILE`` to every step (trainer ranks and rollout servers);
* without it, trainer rank 0 makes one in the private directory of the rollout servers it starts on
  its own node (``rollout/pool.py``: ``LocalServers``).

:func:`load_secret` refuses a file that anyone but its owner could read or that another user owns.
See docs/security.md.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

SECRET_ENV = "MGTPO_SECRET_FILE"
"""Environment variable holding the path of the job's secret file."""

SECRET_BYTES = 32
"""Random bytes of a secret (256 bits)."""


class SecretError(RuntimeError):
    """No usable job secret: unset, unreadable, too short, or readable by other users."""


def make_secret_file(directory: str | os.PathLike, name: str = "job.key") -> Path:
    """Writes a fresh secret into ``directory/name`` (created 0700 if missing), mode 0600 from the
    first byte on (the file is opened with that mode; never chmod-ed afterwards). Returns the path."""
    directory = Path(directory)
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = directory / name
    tmp = directory / f".{name}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(secrets.token_hex(SECRET_BYTES) + "\n")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def secret_path(path: str | os.PathLike | None = None) -> Path:
    """``path``, else ``$MGTPO_SECRET_FILE``; SecretError naming the variable when neither is set."""
    raw = path or os.environ.get(SECRET_ENV)
    if not raw:
        raise SecretError(
            f"no job secret: {SECRET_ENV} is unset. slurm/train.sbatch sets it; by hand, make one readable by "
            f"you only, e.g. `(umask 077; python -c 'import secrets; print(secrets.token_hex(32))' > job.key)`, "
            f"and export {SECRET_ENV}=$PWD/job.key to the rollout servers and every trainer rank")
    return Path(raw)


def load_secret(path: str | os.PathLike | None = None) -> bytes:
    """The secret in ``path`` (default ``$MGTPO_SECRET_FILE``), after checking that the file is a
    regular file of this user that nobody else can read or write."""
    path = secret_path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as err:
        raise SecretError(f"{SECRET_ENV}={path}: cannot open the job secret ({err.strerror})") from None
    with os.fdopen(fd) as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
            raise SecretError(f"{SECRET_ENV}={path}: not a regular file owned by this user")
        if info.st_mode & 0o077:
            raise SecretError(f"{SECRET_ENV}={path} has mode {stat.S_IMODE(info.st_mode):04o}: other users could "
                              f"read it; `chmod 600 {path}` (and make a new secret: this one may be known)")
        text = handle.read().strip()
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) < SECRET_BYTES:
        raise SecretError(f"{SECRET_ENV}={path}: expected at least {2 * SECRET_BYTES} hex digits "
                          f"({SECRET_BYTES} random bytes)")
    return key


def private_directory(path: str | os.PathLike) -> int | None:
    """Makes ``path`` (and missing parents) a directory only its owner can enter: created 0700, or,
    when it exists, its group and other bits cleared. Returns the mode it had when that changed it,
    else None. Run directories are made so (checkpoints, logs, the config and the tracking journal
    inside are then out of other users' reach whatever their own modes). A directory of another
    user is refused (PermissionError): its owner could read or replace what the run writes there,
    and a checkpoint is code once loaded."""
    path = Path(path)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.stat()
    if info.st_uid != os.geteuid():
        raise PermissionError(f"{path} belongs to uid {info.st_uid}, not to this user (uid {os.geteuid()}): its "
                              f"owner could read or replace the run's checkpoints, which are code once loaded; "
                              f"choose a directory of your own (--output-dir, checkpoint.dir)")
    if not info.st_mode & 0o077:
        return None
    path.chmod(stat.S_IMODE(info.st_mode) & 0o700)
    return stat.S_IMODE(info.st_mode)
