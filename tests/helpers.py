"""Helpers shared by the test layers: launching gloo worlds with torchrun and reading their results."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from megatron_gtpo.parallel.strict import ENV as STRICT_ENV

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun(script: str | Path, nproc: int, *args: str, timeout: float = 600,
             env: dict[str, str] | None = None) -> list[dict]:
    """Runs ``script`` on ``nproc`` gloo ranks with torchrun and returns every JSON line that any
    rank printed with the prefix ``RESULT `` (the scripts' way of reporting checks).

    Raises AssertionError with the combined output when the launch fails, so a failing rank's
    traceback appears in the pytest report. Strict device groups (megatron_gtpo/parallel/strict.py)
    are on unless ``env`` or the caller's environment sets the variable to 0: host data on a group
    that would be NCCL on a GPU raises here as it would there.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           f"--master_port={free_port()}", str(script), *args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO),
                STRICT_ENV: os.environ.get(STRICT_ENV, "1"), **(env or {})}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=REPO)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"torchrun {script} (nproc={nproc}) failed rc={proc.returncode}:\n{out[-8000:]}"
    return [json.loads(line.split("RESULT ", 1)[1]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
