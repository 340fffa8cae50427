"""A real local SLURM cluster for the e2e tests: start it, submit to it, watch jobs, stop it.

``local_slurm(dir)`` runs ``tests/e2e/local_slurm.sh start`` (munged, slurmctld and one slurmd per
fake node, all under ``dir`` on free ports) and ``stop`` afterwards, which ends exactly those
daemons by their pid files. Jobs see the cluster through ``SLURM_CONF``.

The tests skip only when the SLURM/munge binaries are missing (``.ci/install_slurm.sh`` installs
them; CI runs it). Anything else that goes wrong starting the cluster is a failure.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import REPO

BINARIES = ("slurmctld", "slurmd", "sbatch", "srun", "scontrol", "scancel", "sinfo", "munged", "munge", "unmunge")
MISSING = [b for b in BINARIES if shutil.which(b) is None]
requires_slurm = pytest.mark.skipif(
    bool(MISSING), reason=f"SLURM binaries missing ({', '.join(MISSING)}): run .ci/install_slurm.sh")

HARNESS = REPO / "tests" / "e2e" / "local_slurm.sh"
FINISHED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")


def free_port_block(count: int, start: int = 40000, stop: int = 60000) -> int:
    """First port p of ``count`` consecutive free loopback ports p..p+count-1 (slurmd ports must be consecutive)."""
    for base in range(start + os.getpid() % 1000 * 7, stop, count + 1):
        try:
            with contextlib.ExitStack() as stack:
                for port in range(base, base + count):
                    sock = stack.enter_context(socket.socket())
                    sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise RuntimeError(f"no {count} consecutive free ports in {start}-{stop}")


REQUEUE_SETTLE_S = 3.0
"""Seconds a requeued job stays held before the harness starts it (see LocalSlurm.wait)."""


@dataclass
class LocalSlurm:
    """Handle on a running local cluster."""

    root: Path
    """Directory holding slurm.conf, state, spool, logs and pid files."""

    @property
    def env(self) -> dict[str, str]:
        """Environment for client commands and jobs (they inherit SLURM_CONF)."""
        return {**os.environ, "SLURM_CONF": str(self.root / "slurm.conf")}

    def run(self, *cmd: str, env: dict[str, str] | None = None, cwd: Path | None = None,
            check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**self.env, **(env or {})},
                              cwd=cwd, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} failed rc={proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
        return proc

    def sbatch(self, script: Path, *args: str, options: tuple[str, ...] = (), env: dict[str, str] | None = None,
               cwd: Path | None = None) -> int:
        """Submits ``script`` and returns the job id."""
        out = self.run("sbatch", "--parsable", *options, str(script), *args, env=env, cwd=cwd).stdout
        return int(out.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, ExitCode, Restarts, StdOut ...)."""
        out = self.run("scontrol", "show", "job", "-o", str(job_id)).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait(self, job_id: int, *, timeout: float, restarts: int = 0, poll: float = 1.0) -> dict[str, str]:
        """Waits until the job has finished after ``restarts`` requeues; returns its final record.

        A requeued job waits ~2 min for its new begin time (slurmctld's requeue delay); the harness
        moves that to now, as an admin would, so tests do not sleep through it, but only once the
        requeue is REQUEUE_SETTLE_S old. The delay is what lets slurmd drop the old run's revoked
        job credential (it compares whole seconds): a relaunch in the requeue's own second is refused
        ("Killing non-startable batch JobId=N: Job credential revoked", the run ends FAILED 1:0
        with no output), which the fast requeue paths hit under load.
        """
        deadline = time.monotonic() + timeout
        pending_since: dict[int, float] = {}  # restart count -> when this wait first saw it held
        while time.monotonic() < deadline:
            info = self.job(job_id)
            state, count = info.get("JobState", ""), int(info.get("Restarts", "0"))
            if state == "PENDING" and info.get("Reason") == "BeginTime" and count > 0:
                since = pending_since.setdefault(count, time.monotonic())
                if time.monotonic() - since >= REQUEUE_SETTLE_S:
                    self.run("scontrol", "update", f"JobId={job_id}", "StartTime=now", check=False)
            elif state in FINISHED and count >= restarts:
                return info
            time.sleep(poll)
        raise AssertionError(f"job {job_id} not finished after {timeout:.0f} s: {self.job(job_id)}\n{self.logs()}")

    def logs(self) -> str:
        """Tail of the daemons' logs, for failure messages."""
        parts = []
        for log in sorted((self.root / "log").glob("*.log")):
            parts.append(f"--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-15:]))
        return "\n".join(parts)


@contextlib.contextmanager
def local_slurm(root: Path, *, nodes: int = 2, gpus: int = 8, cpus: int = 2) -> Iterator[LocalSlurm]:
    """Starts a cluster of ``nodes`` fake nodes with ``gpus`` fake GPUs each; stops it on exit."""
    ctld = free_port_block(1)
    slurmd = free_port_block(nodes, start=ctld + 2)
    env = {**os.environ, "LOCAL_SLURM_NODES": str(nodes), "LOCAL_SLURM_GPUS": str(gpus),
           "LOCAL_SLURM_CPUS": str(cpus), "LOCAL_SLURM_CTLD_PORT": str(ctld),
           "LOCAL_SLURM_SLURMD_PORT": str(slurmd)}
    start = subprocess.run([str(HARNESS), "start", str(root)], capture_output=True, text=True, env=env, timeout=120)
    cluster = LocalSlurm(root)
    try:
        assert start.returncode == 0, f"local SLURM did not start:\n{start.stdout}\n{start.stderr}\n{cluster.logs()}"
        yield cluster
    finally:
        subprocess.run([str(HARNESS), "stop", str(root)], capture_output=True, text=True, timeout=120)


# ----------------------------------------------------------------------------- pytest glue

SLURM_DIR = REPO / "slurm"


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalSlurm]:
    """A 2-node x 8-fake-GPU cluster per test module, removed with its files afterwards."""
    # Not pytest's tmp dir: munged (user munge) must traverse the path, and /tmp/pytest-of-root is 0700.
    root = Path(tempfile.mkdtemp(prefix="mgtpo-slurm-"))
    root.chmod(0o755)
    try:
        with local_slurm(root / "cluster", nodes=2, gpus=8, cpus=2) as c:
            yield c
    finally:
        shutil.rmtree(root, ignore_errors=True)


def new_job_dir(cluster: LocalSlurm, name: str) -> Path:
    """A fresh directory next to the cluster's (runs, batch logs, inputs of one test)."""
    path = cluster.root.parent / re.sub(r"[^\w.-]+", "-", name)
    path.mkdir()
    return path


def submit(cluster: LocalSlurm, job_dir: Path, script: str, *args: str, options: tuple[str, ...],
           env: dict[str, str] | None = None) -> int:
    """sbatch slurm/<script> from ``job_dir``, batch output to ``job_dir/<job name>-<job id>.out``."""
    return cluster.sbatch(SLURM_DIR / script, *args, options=(*options, f"--output={job_dir}/%x-%j.out"),
                          env=env, cwd=job_dir)


def batch_log(job_dir: Path, job_id: int) -> str:
    return "\n".join(p.read_text() for p in job_dir.glob(f"*-{job_id}.out"))
