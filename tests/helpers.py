"""Helpers shared by the test layers: launching gloo worlds with torchrun and reading their results."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def kill_tree(pid: int, sig: int = 9) -> None:
    """Sends ``sig`` (SIGKILL) to ``pid`` and every descendant at once, as a crash or outage would.

    ``os.killpg`` on the launcher's group is not enough: torchrun starts each rank in a new
    session (its own process group), so the ranks would survive the kill and keep training.
    """
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]  # collected first: orphans are re-parented
    except psutil.NoSuchProcess:
        return
    for proc in procs:
        try:
            proc.send_signal(sig)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=60)


def torchrun(script: str | Path, nproc: int, *args: str, timeout: float = 600,
             env: dict[str, str] | None = None) -> list[dict]:
    """Runs ``script`` on ``nproc`` gloo ranks with torchrun and returns every JSON line that any
    rank printed with the prefix ``RESULT `` (the scripts' way of reporting checks).

    Raises AssertionError with the combined output when the launch fails, so a failing rank's
    traceback appears in the pytest report.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           f"--master_port={free_port()}", str(script), *args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **(env or {})}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=REPO)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"torchrun {script} (nproc={nproc}) failed rc={proc.returncode}:\n{out[-8000:]}"
    return [json.loads(line.split("RESULT ", 1)[1]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
