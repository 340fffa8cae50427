"""A warm interpreter for the tests' CLI runs and gloo worlds: forked children instead of fresh starts.

A fresh ``python -m megatron_gtpo.cli train`` spends ~10 s of one core importing torch, Megatron-Core,
transformers and vLLM before its first check, and the suite starts ~60 such processes (training
runs of the e2e layer, launches of the dist layer). Per pytest process, one server (``python -m
tests.warm``) imports them once; ``run`` asks it to fork a child that becomes the requested
``python -m MODULE ARGS`` (``runpy``, as megatron_gtpo/parallel/launch.py starts a forked rank), in
its own session, with the request's environment, working directory and output files. From there
the child runs the real code: the CLI's checks, the launcher forking the ranks, engines, MLflow.

What it does not exercise is a fresh interpreter's start, so only the training runs of
``tests/e2e/runs.train``, the gloo worlds of ``tests/helpers.torchrun``, the probe and eval CLI runs
and the benchmarks' quick runs (``python -m bench.NAME --quick``) use it. Every test about
start-up, imports, ``--help`` or refusals "before torch loads" starts a fresh process
(``run_group``), and so do the SLURM, setup and launch-line tests. ``MGTPO_TEST_WARM=0`` turns it
off (every run a fresh process). A request whose environment differs from the server's in a
variable that libraries read when imported (``HF_*``, ``OMP_*``, ``LD_*``, ...: ``IMPORT_TIME``)
runs fresh too.
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ENV = "MGTPO_TEST_WARM"
MODULES = ("megatron_gtpo.cli", "megatron_gtpo.cli.eval", "megatron_gtpo.parallel.launch", "bench.")
"""What a warm child may become: ``python -m`` one of these, or, for a name ending in a dot, any
module under it (every benchmark script: the learning bench, tests/e2e/test_bench_quick.py's runs)."""
PRELOAD = ("megatron_gtpo.cli", "megatron_gtpo.cli.train", "megatron_gtpo.config", "megatron_gtpo.plan.preflight",
           "megatron_gtpo.trainer", "megatron.core.dist_checkpointing", "transformers", "vllm", "vllm.entrypoints.llm",
           "mlflow.store.tracking.sqlalchemy_store", "mlflow.tracking")
THREADS = "OMP_NUM_THREADS"
"""Read by torch at import, applied to a warm child by ``torch.set_num_threads`` (parallel/launch.py)."""
IMPORT_TIME = ("HF_", "HUGGINGFACE", "TRANSFORMERS_", "OMP_", "MKL_", "KMP_", "PYTHON", "LD_", "MALLOC")
"""Prefixes of variables read when a library is imported (the Hub's offline switches, thread pools,
the interpreter's own settings): a request that changes one is not served warm. vLLM's and
torchelastic's variables are read when used, after the fork (``vllm.envs`` reads lazily)."""


def _may_become(module: str) -> bool:
    return any(module == m or (m.endswith(".") and module.startswith(m)) for m in MODULES)


def _serve() -> None:
    """The server: preloads, then one request per stdin line -> ``{"pid"}`` then ``{"rc"}``."""
    from megatron_gtpo.parallel.launch import run_rank  # noqa: PLC0415 -- after the env is final

    from megatron_gtpo.utils.runtime import freeze_imported_heap  # noqa: PLC0415

    for name in PRELOAD:
        importlib.import_module(name)
    freeze_imported_heap()  # as the launcher does before it forks the ranks
    requests, replies = sys.stdin.buffer, os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # what the server itself prints goes to stderr, never into the reply pipe
    replies.write(json.dumps({"ready": os.getpid()}) + "\n")
    for line in requests:
        req = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _become(req, run_rank)
        replies.write(json.dumps({"pid": pid}) + "\n")
        _, status = os.waitpid(pid, 0)
        replies.write(json.dumps({"rc": os.waitstatus_to_exitcode(status)}) + "\n")


def _become(req: dict, rank_main) -> None:
    """In the forked child: a new session, the request's files, directory and environment."""
    os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    out = os.open(req["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    # One file for both (runs.start): one descriptor, one offset, as Popen's stderr=STDOUT.
    err = out if req["stderr"] == req["stdout"] else os.open(req["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    for src, dst in ((null, 0), (out, 1), (err, 2)):
        os.dup2(src, dst)
    os.closerange(3, 256)  # the server's reply pipe among them
    os.chdir(req["cwd"])
    os.environ.clear()
    rank_main(req["module"], req["args"], req["env"])  # never returns


class Warm:
    """Client side: one server per pytest process, started on first use, stopped at exit."""

    def __init__(self):
        self.proc: subprocess.Popen | None = None
        self._buf = b""
        self.background: WarmProc | None = None
        """The runs.start child not waited for yet: the server serves one child at a time."""
        self.env: dict[str, str] = {}
        self.dir = Path(tempfile.mkdtemp(prefix="mgtpo-warm-"))
        self.broken = False
        self.served = 0
        self.fresh: dict[str, int] = {}
        """Commands that asked for a warm start and started fresh, by reason (said at the end)."""

    def _start(self, env: dict[str, str], cwd: Path) -> bool:
        self.env = {k: v for k, v in env.items() if k != THREADS}  # torch's default, as in a fresh start
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.warm"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=self.env, cwd=cwd, bufsize=0, start_new_session=True)
        atexit.register(self.stop)
        if "ready" not in self._reply(timeout=300):  # e.g. an import failed: every run starts fresh
            self.broken = True
            self.stop()
        return not self.broken

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _reply(self, timeout: float) -> dict:
        """The server's next reply line; {} when none came within ``timeout`` s. Read from the raw
        descriptor into our own buffer: a buffered reader could hold the next line where select
        does not see it."""
        deadline = time.monotonic() + max(timeout, 0.0)
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            ready, _, _ = select.select([fd], [], [], max(deadline - time.monotonic(), 0.0))
            if not ready:
                return {}
            chunk = os.read(fd, 65536)
            if not chunk:
                return {"eof": True}
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def _request(self, cmd: list[str], env: dict[str, str], cwd: Path, stdout: Path, stderr: Path) -> int:
        """Asks the server to fork ``cmd`` (``[python, -m, MODULE, *args]``); the child's pid."""
        req = {"module": cmd[2], "args": cmd[3:], "env": env, "cwd": str(cwd), "stdout": str(stdout),
               "stderr": str(stderr)}
        self.proc.stdin.write((json.dumps(req) + "\n").encode())
        self.proc.stdin.flush()
        pid = self._reply(timeout=30).get("pid")
        if pid is None:
            self.broken = True
            raise AssertionError(f"tests.warm server did not fork {cmd[:6]}")
        return pid

    def eligible(self, cmd: list[str], env: dict[str, str]) -> str | None:
        """None when ``cmd`` can be forked from the server, else why not."""
        if os.environ.get(ENV, "1") == "0":
            return f"{ENV}=0"
        if self.broken:
            return "the warm server failed"
        if self.background is not None and self.background.poll() is None:
            return "a background run (runs.start) is still running"
        if len(cmd) < 3 or cmd[0] != sys.executable or cmd[1] != "-m" or not _may_become(cmd[2]):
            return "not python -m " + "|".join(m + "*" if m.endswith(".") else m for m in MODULES)
        changed = sorted(k for k in set(env) | set(self.env) if env.get(k) != self.env.get(k) and k != THREADS
                         and k.startswith(IMPORT_TIME)) if self.env else []
        return f"import-time settings differ from the server's: {', '.join(changed)}" if changed else None

    def note_fresh(self, reason: str) -> None:
        self.fresh[reason] = self.fresh.get(reason, 0) + 1

    def summary(self) -> str | None:
        """One line for the end of the run: how many commands were forked warm, how many not and why."""
        if not self.served and not self.fresh:
            return None
        why = "; ".join(f"{n} x {reason}" for reason, n in sorted(self.fresh.items()))
        return f"tests/warm.py: {self.served} command(s) forked from the warm interpreter" + (
            f", {sum(self.fresh.values())} started fresh ({why})" if self.fresh else "")

    def run(self, cmd: list[str], *, timeout: float, env: dict[str, str], cwd: Path
            ) -> subprocess.CompletedProcess | None:
        """``cmd`` (``[python, -m, MODULE, *args]``) forked from the server, like ``run_group``;
        None when the server cannot start (the caller starts the command fresh)."""
        from tests.helpers import kill_tree

        if self.proc is None and not self._start(env, cwd):
            return None
        out, err = self.dir / "stdout", self.dir / "stderr"  # one request at a time, removed after it
        pid = self._request(cmd, env, cwd, out, err)
        done = self._reply(timeout=timeout)
        timed_out = "rc" not in done
        if timed_out:
            kill_tree(pid)
            done = self._reply(timeout=60)
        text = lambda p: p.read_text(errors="replace") if p.exists() else ""  # noqa: E731
        stdout, stderr = text(out), text(err)
        out.unlink(missing_ok=True)
        err.unlink(missing_ok=True)
        self.served += 1
        if timed_out:
            raise AssertionError(f"{cmd[:6]} timed out after {timeout} s (warm child {pid}); process group "
                                 f"killed:\n{(stdout + stderr)[-8000:]}")
        return subprocess.CompletedProcess(cmd, done["rc"], stdout, stderr)

    def start(self, cmd: list[str], *, env: dict[str, str], cwd: Path, log: Path) -> WarmProc | None:
        """``cmd`` forked in the background with stdout and stderr into ``log`` (``runs.start``, for
        runs a test signals or kills); None when it cannot be (the caller starts it fresh, and
        ``note_fresh`` was told why)."""
        why = self.eligible(cmd, env)
        if why is None and self.proc is None and not self._start(env, cwd):
            why = "the warm server failed"
        if why is not None:
            self.note_fresh(why)
            return None
        log.write_bytes(b"")  # exists on return, as Popen's: the caller may read it before the child opens it
        pid = self._request(cmd, env, cwd, log, log)
        self.served += 1
        self.background = WarmProc(self, pid, cmd)
        return self.background


class WarmProc:
    """A background warm child as the tests use a ``Popen``: ``pid`` (its own session, so
    ``kill_tree`` reaches its ranks), ``poll``, ``wait``, ``send_signal``, ``returncode`` (-9 after
    SIGKILL: the server reports ``os.waitstatus_to_exitcode``)."""

    def __init__(self, warm: Warm, pid: int, args: list[str]):
        self.warm, self.pid, self.args = warm, pid, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self.wait(timeout=0.0, raise_timeout=False)

    def wait(self, timeout: float | None = None, *, raise_timeout: bool = True) -> int | None:
        if self.returncode is None:
            done = self.warm._reply(timeout=1e9 if timeout is None else timeout)
            if "rc" in done:
                self.returncode = done["rc"]
            elif "eof" in done:
                raise AssertionError(f"the tests.warm server died while serving {self.args[:6]}")
            elif raise_timeout:
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)


WARM = Warm()


if __name__ == "__main__":
    _serve()
