"""A real ``mlflow server`` on 127.0.0.1 for tests: SQLite backend and artifacts in a tmp dir,
its own process group (killed as a group), restartable on the same port and store."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from tests.helpers import free_port

START_TIMEOUT_S = 420  # a cold `mlflow server` takes 45-90 s on a loaded 2-core machine


class MlflowServer:
    def __init__(self, root: Path, port: int | None = None):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def backend(self) -> str:
        """The server's own store: read it directly to count rows."""
        return f"sqlite:///{self.root / 'backend.db'}"

    def start(self) -> MlflowServer:
        # The job executor (huey workers) is not needed for tracking and costs 7 processes.
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", "MLFLOW_DISABLE_TELEMETRY": "true"}
        self.starts += 1
        log = open(self.root / f"server{self.starts}.log", "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(self.port),
             "--backend-store-uri", self.backend, "--artifacts-destination", str(self.root / "artifacts"),
             "--workers", "1"], stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited rc={self.proc.returncode}:\n"
                                   f"{(self.root / f'server{self.starts}.log').read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as response:
                    if response.status == 200:
                        return self
            except OSError:
                time.sleep(1.0)
        self.kill()
        raise RuntimeError(f"mlflow server on port {self.port} did not answer within {START_TIMEOUT_S}s")

    def kill(self) -> None:
        """SIGKILL to the whole process group (uvicorn worker included)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=60)
        self.proc = None

    def pause(self) -> None:
        """SIGSTOP: the port still accepts connections, nothing answers (a hung server)."""
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.killpg(self.proc.pid, signal.SIGCONT)


def metric_rows(server: MlflowServer, run_id: str, key: str) -> list[tuple[int, float]]:
    """Every stored row of ``key`` (duplicates included), sorted by step, read through the server."""
    from mlflow.tracking import MlflowClient

    return sorted((m.step, m.value) for m in MlflowClient(server.uri).get_metric_history(run_id, key))
