"""Local ranks of one host: forked from this warm interpreter on a CPU host, torchrun elsewhere.

``megatron-gtpo train`` / ``probe`` on one host, and the dist and e2e tests' gloo worlds, start
their ranks here. A rank's own imports of torch, Megatron-Core, transformers and vLLM cost ~12 s of
one core on the 2-core machine before any work, once per rank: on a host without CUDA this process
imports them once (``preload``) and forks the ranks, which start with them loaded (the tiny recipe's
start-up: 36 s -> 21 s, bench/startup.py, docs/performance.md). A CUDA host keeps torchrun's fresh interpreters: CUDA
cannot be used in a child forked after its parent initialised it, and vLLM probes the GPU when
imported. ``MGTPO_LAUNCHER=torchrun`` forces torchrun on CPU too (tests/unit/test_launch.py covers both
paths); multi-node jobs are launched by slurm/train.sbatch, which runs torchrun itself.

Forked ranks behave as torchrun's do: the same environment (RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR, ...), ``python -m module`` / ``python script.py`` semantics (``runpy``), SIGTERM and
SIGUSR1 to this process reach the ranks as SIGUSR1 (checkpoint, then exit 0), and when one rank
fails the others are killed with everything they started. A rank also dies with this process
(``PR_SET_PDEATHSIG``), so a killed launcher never leaves ranks training on.
"""

from __future__ import annotations

import argparse
import atexit
import ctypes
import importlib
import os
import random
import runpy
import signal
import socket
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path

from megatron_gtpo.utils.runtime import freeze_imported_heap
from megatron_gtpo.utils.vllm_shm import remove_world_segments

LAUNCHER_ENV = "MGTPO_LAUNCHER"
"""``fork`` / ``torchrun`` / unset (fork on a host without CUDA, torchrun with CUDA)."""
TRAINER_PRELOAD = ("megatron_gtpo.trainer", "megatron.core.dist_checkpointing", "vllm")
"""What a training rank imports anyway (``vllm`` when installed, with the engine classes that
``vllm.LLM`` would load lazily)."""


def use_fork() -> bool:
    """Whether this host forks ranks: ``MGTPO_LAUNCHER``, else fork unless torch sees CUDA (a CUDA
    host is never forked from: the check itself may initialise the driver, and then only torchrun's
    fresh interpreters are safe)."""
    choice = os.environ.get(LAUNCHER_ENV, "")
    if choice not in ("", "fork", "torchrun"):
        raise ValueError(f"{LAUNCHER_ENV}={choice!r}: use fork, torchrun or leave it unset")
    if choice:
        return choice == "fork"
    import torch

    return not torch.cuda.is_available()


def free_port() -> int:
    """A port free now for rank 0's store, picked below the kernel's ephemeral range: a port from
    ``bind(0)`` is an ephemeral one, which the host's own outgoing connections may take between this
    check and rank 0's bind (EADDRINUSE under load, seen in the suite); ports below the range are
    handed out by nobody but such explicit choices. Falls back to ``bind(0)`` when none is free."""
    low = _ephemeral_low()
    candidates = list(range(max(1024, low - 10000), low))
    random.SystemRandom().shuffle(candidates)
    for port in candidates[:64]:
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default range starts here


def launch(target: str, args: Sequence[str], world: int, *, preload: Sequence[str] = TRAINER_PRELOAD) -> int:
    """Runs ``python -m target *args`` (``target`` a module) or ``python target *args`` (a ``.py``
    path) on ``world`` local ranks and waits for them: 0, or 1 when a rank failed (named on stderr)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if use_fork():
        return _fork_ranks(target, list(args), world, preload)
    return _torchrun(target, list(args), world)


def _torchrun(target: str, args: list[str], world: int) -> int:
    """torchrun's launcher in this process (a separate agent would import torch once more)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    script = [target] if target.endswith(".py") else ["-m", target]
    # --master_port keeps torchrun's static rendezvous (torch's run() turns a one-node launch without it
    # into c10d, whose store state is pickled: docs/security.md); tests/unit/test_launch.py checks it.
    argv = [f"--nproc_per_node={world}", "--master_port", os.environ.get("MASTER_PORT", str(free_port())),
            *script, *args]
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = "SIGINT,SIGHUP,SIGQUIT"  # SIGTERM is forwarded below
    previous = _forward_signals(lambda: _children_running(target))
    try:
        run(get_args_parser().parse_args(argv))
        return 0
    except ChildFailedError as err:
        print(err.format_msg(), file=sys.stderr, flush=True)
        return 1
    finally:
        _restore(previous)


def _children_running(target: str) -> list[int]:
    """torchrun's ranks: this process's children that run ``target``."""
    import psutil

    pids = []
    for child in psutil.Process().children(recursive=False):
        try:
            if target in child.cmdline():
                pids.append(child.pid)
        except psutil.NoSuchProcess:
            pass
    return pids


def _fork_ranks(target: str, args: list[str], world: int, preload: Sequence[str]) -> int:
    for name in preload:
        try:
            importlib.import_module(name)
        except ImportError:  # vLLM is optional for scripts that never build an engine
            pass
    if "vllm" in sys.modules:
        importlib.import_module("vllm.entrypoints.llm")  # the engine classes `vllm.LLM` loads lazily
    freeze_imported_heap()  # the ranks' collections then skip what they inherit (utils/runtime.py)
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": os.environ.get("MASTER_PORT", str(free_port())),
           "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world), "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1",
           "ROLE_WORLD_SIZE": str(world), "TORCHELASTIC_RUN_ID": f"fork-{os.getpid()}",
           "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0"}
    sys.stdout.flush()
    sys.stderr.flush()
    ranks: dict[int, int] = {}
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            run_rank(target, args, {**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "ROLE_RANK": str(rank)})
        ranks[pid] = rank
    previous = _forward_signals(lambda: list(ranks))
    try:
        return _wait(ranks)
    except KeyboardInterrupt:  # the ranks got the terminal's SIGINT too, or only this process did
        _kill_all(ranks, signal.SIGKILL)
        raise
    finally:
        _restore(previous)
        remove_world_segments(env)  # what killed ranks' vLLM engines left in /dev/shm (utils/vllm_shm.py)


def run_rank(target: str, args: list[str], env: dict[str, str]) -> None:
    """Turns this freshly forked process into a rank: torchrun's environment ``env``, then
    ``target`` as ``__main__``, then the exit code; never returns (tests/warm.py uses it too)."""
    code = 1
    # The launcher's exit handlers are not the rank's: it starts with those a fresh interpreter has
    # (multiprocessing's stops the helper processes a rank starts, e.g. Megatron's checkpoint writer).
    atexit._clear()
    for module, handler in (("logging", "shutdown"), ("multiprocessing.util", "_exit_function")):
        if module in sys.modules:
            atexit.register(getattr(sys.modules[module], handler))
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the launcher
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
        os.environ.update(env)
        if "torch" in sys.modules and os.environ.get("OMP_NUM_THREADS", "").isdigit():
            # torch read OMP_NUM_THREADS when this process imported it, before launch() set it: a
            # rank that kept the host's thread count would oversubscribe the cores with its peers.
            sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        sys.argv = [target, *args]
        if target.endswith(".py"):
            sys.path[0] = os.path.dirname(os.path.abspath(target))
            runpy.run_path(target, run_name="__main__")
        else:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if not isinstance(stop.code, int | None):
            print(stop.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 -- a rank's traceback, as torchrun would show it
        traceback.print_exc()
    finally:
        # As a fresh interpreter ends: the rank's exit handlers, then its output.
        try:
            atexit._run_exitfuncs()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)


def _wait(ranks: dict[int, int]) -> int:
    """Waits for every rank; at the first failure kills the rest (and what they started)."""
    running, failed = dict(ranks), None
    while running:
        pid, status = os.waitpid(-1, 0)  # only this loop reaps the ranks (their exit codes)
        if pid not in running:
            continue
        rank = running.pop(pid)
        code = os.waitstatus_to_exitcode(status)
        if code != 0 and failed is None:
            failed = (rank, code)
            _kill_all(running, signal.SIGKILL)
    if failed is None:
        return 0
    rank, code = failed
    how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
    print(f"megatron-gtpo launch: rank {rank} failed ({how}); the other ranks were stopped", file=sys.stderr,
          flush=True)
    return 1


def _kill_all(running: dict[int, int], sig: int) -> None:
    """``sig`` to the ranks and everything they started (reward workers, engines, helpers), as
    torchrun stops the rest of a failed world; the caller reaps the ranks."""
    import psutil

    for pid in running:
        try:
            targets = [*psutil.Process(pid).children(recursive=True), psutil.Process(pid)]
        except psutil.NoSuchProcess:
            continue
        for proc in targets:
            try:
                proc.send_signal(sig)
            except psutil.NoSuchProcess:
                pass


def _forward_signals(pids):
    """SIGTERM / SIGUSR1 to this process -> SIGUSR1 to the ranks ``pids()`` (checkpoint, exit 0)."""
    def forward(signum, frame):
        for pid in pids():
            try:
                os.kill(pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass

    return {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGUSR1)}


def _restore(previous) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_gtpo.parallel.launch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, required=True, help="ranks to start on this host")
    parser.add_argument("--preload", default="torch,megatron.core,megatron.core.parallel_state",
                        help="comma-separated modules imported once before forking (fork mode)")
    parser.add_argument("target", help="a script (.py) or a module")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    ns = parser.parse_args(argv)
    return launch(ns.target, ns.args, ns.nproc, preload=[m for m in ns.preload.split(",") if m])


if __name__ == "__main__":
    raise SystemExit(main())
