"""megatron_gtpo/parallel/launch.py: ranks forked from a warm interpreter behave as torchrun's do.

The targets here are plain scripts that import nothing heavy (``--preload=``), so each launch costs
well under a second; the training CLI and the dist layer use the same launcher with torch,
Megatron and vLLM preloaded.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from tests.helpers import REPO, child_env, free_port, kill_tree, run_group

LAUNCH = [sys.executable, "-m", "megatron_gtpo.parallel.launch", "--preload="]


def _script(tmp_path, body: str):
    path = tmp_path / "target.py"
    path.write_text(textwrap.dedent(body))
    return path


def _launch(tmp_path, body: str, *args: str, nproc: int = 2, launcher: str = "fork", timeout: float = 60):
    cmd = [*LAUNCH, f"--nproc={nproc}", str(_script(tmp_path, body)), *args]
    # A port of its own: an in-process gloo world of an earlier test left MASTER_PORT in os.environ
    # with its store still listening there (EADDRINUSE when test_optim_state.py ran first).
    return run_group(cmd, timeout=timeout, env=child_env(MGTPO_LAUNCHER=launcher, MASTER_PORT=str(free_port())),
                     cwd=REPO)


ENV_REPORT = """
    import json, os, sys
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    line = "ENV " + json.dumps({k: os.environ.get(k) for k in keys} | {"argv": sys.argv[1:], "main": __name__})
    os.write(1, (line + "\\n").encode())  # one write: the ranks share the pipe (PYTHONUNBUFFERED splits a print)
"""


@pytest.mark.parametrize("launcher", ["fork", "torchrun"])
def test_ranks_get_torchruns_environment_and_arguments(tmp_path, launcher):
    """Catches a forked rank that lacks the variables torch.distributed's env:// init and vLLM's
    external launcher read (or the script's arguments); torchrun's path is the reference."""
    proc = _launch(tmp_path, ENV_REPORT, "--flag", "x", launcher=launcher)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    seen = sorted((json.loads(line[4:]) for line in proc.stdout.splitlines() if line.startswith("ENV ")),
                  key=lambda e: e["RANK"])
    assert [(e["RANK"], e["LOCAL_RANK"], e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"]) for e in seen] == [
        ("0", "0", "2", "2"), ("1", "1", "2", "2")]
    assert {e["MASTER_PORT"] for e in seen} != {None} and len({e["MASTER_PORT"] for e in seen}) == 1
    assert all(e["argv"] == ["--flag", "x"] and e["main"] == "__main__" for e in seen)


def test_security_the_torchrun_path_uses_the_static_rendezvous(tmp_path):
    """torchrun's c10d rendezvous pickles its state into its store and unpickles what it reads back
    (docs/security.md); the static one, which the launcher asks for with --master_port, hands the
    ranks its own store at MASTER_PORT, where c10d would hand them a second store on a free port.
    Injected: `--master_port` dropped from `_torchrun`'s argv -> torch's run() switches a one-node
    static launch to c10d (localhost:0) and this test fails."""
    port = free_port()
    cmd = [*LAUNCH, "--nproc=2", str(_script(tmp_path, ENV_REPORT))]
    proc = run_group(cmd, timeout=60, env=child_env(MGTPO_LAUNCHER="torchrun", MASTER_PORT=str(port)), cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    seen = [json.loads(line[4:]) for line in proc.stdout.splitlines() if line.startswith("ENV ")]
    assert len(seen) == 2 and {(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in seen} == {("127.0.0.1", str(port))}, seen


def test_a_failed_rank_stops_the_others_and_is_named(tmp_path):
    """Catches a launcher that waits forever on the surviving rank (stuck in a collective with a
    dead peer) or reports success: rank 1 exits 3 while rank 0 would sleep for 5 minutes."""
    start = time.monotonic()
    proc = _launch(tmp_path, """
        import os, sys, time
        if os.environ["RANK"] == "1":
            sys.exit(3)
        time.sleep(300)
    """)
    assert proc.returncode == 1
    assert "rank 1 failed (exit code 3)" in proc.stderr
    assert time.monotonic() - start < 30


def test_helper_processes_of_a_rank_end_with_it(tmp_path):
    """Catches forked ranks that skip their exit handlers: a multiprocessing helper (here a
    Manager, as Megatron's asynchronous checkpoint writer starts one) outlived the rank, kept the output pipe
    open, and the caller waited until its timeout (found when the launcher was introduced)."""
    start = time.monotonic()
    proc = _launch(tmp_path, """
        import multiprocessing as mp, os
        if __name__ == "__main__":
            manager = mp.get_context("spawn").Manager()
            manager.dict()["x"] = 1
            os.write(1, b"helper started\\n")
    """, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("helper started") == 2
    assert time.monotonic() - start < 45


def test_sigterm_reaches_the_ranks_as_sigusr1(tmp_path):
    """Catches a launcher that dies of SIGTERM (a preemption) instead of letting the ranks
    checkpoint: each rank turns SIGUSR1 into a clean exit, as the training driver does."""
    script = _script(tmp_path, """
        import os, signal, sys, time
        say = lambda text: os.write(1, (text + "\\n").encode())  # one write per line: the ranks share the pipe
        signal.signal(signal.SIGUSR1, lambda *a: (say("USR1 " + os.environ["RANK"]), sys.exit(0)))
        say("ready")
        # Short sleeps, as the driver checks its preemption flag between steps: a signal that
        # arrives between the write above and the start of one long sleep(120) is handled only
        # when that sleep ends (CPython runs handlers between bytecodes; the kernel already
        # delivered it, so the sleep is not interrupted): 1 run in 6 hung here, a test race.
        for _ in range(1200):
            time.sleep(0.1)
        sys.exit(5)
    """)
    proc = subprocess.Popen([*LAUNCH, "--nproc=2", str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=child_env(MGTPO_LAUNCHER="fork"), cwd=REPO, start_new_session=True)
    try:
        ready = 0
        while ready < 2:
            line = proc.stdout.readline()
            assert line, proc.stderr.read()
            ready += line.startswith("ready")
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        kill_tree(proc.pid)
    assert proc.returncode == 0, err
    assert sorted(line for line in out.splitlines() if line.startswith("USR1")) == ["USR1 0", "USR1 1"]


def test_ranks_die_with_a_killed_launcher(tmp_path):
    """Catches orphaned ranks that train on after the launcher was SIGKILLed (an OOM kill, a
    scancel --signal=KILL of the step): PR_SET_PDEATHSIG ends them."""
    script = _script(tmp_path, """
        import os, time
        os.write(1, f"pid {os.getpid()}\\n".encode())  # one write per line: the ranks share the pipe
        time.sleep(120)
    """)
    proc = subprocess.Popen([*LAUNCH, "--nproc=2", str(script)], stdout=subprocess.PIPE, text=True,
                            env=child_env(MGTPO_LAUNCHER="fork"), cwd=REPO, start_new_session=True)
    try:
        pids = [int(proc.stdout.readline().split()[1]) for _ in range(2)]
        proc.kill()
        proc.wait(timeout=10)
        gone, alive = psutil.wait_procs([psutil.Process(pid) for pid in pids if psutil.pid_exists(pid)], timeout=10)
        assert not alive, f"ranks {alive} outlived the launcher"
    finally:
        kill_tree(proc.pid)


def test_a_bad_launcher_choice_is_named(tmp_path):
    proc = _launch(tmp_path, ENV_REPORT, launcher="spawn")
    assert proc.returncode != 0 and "MGTPO_LAUNCHER='spawn'" in proc.stderr


def test_ranks_failing_together_are_reported_not_a_launcher_crash(tmp_path):
    """Catches the launcher's own crash (ChildProcessError: another waiter reaped a rank it was
    still waiting for) when every rank fails at about the same time, as a bad config does."""
    proc = _launch(tmp_path, """
        import sys, time
        time.sleep(0.5)
        sys.exit(4)
    """)
    assert proc.returncode == 1 and "failed (exit code 4)" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_forked_ranks_start_with_the_parents_heap_frozen(tmp_path):
    """Catches a launcher that forks without freezing its imported heap (utils/runtime.py
    ``freeze_imported_heap``): every full collection in a rank, vLLM's start-up runs several, would
    scan the ~740k objects of the preloaded imports again (tiny engine start 4.0-5.4 s instead of
    2.4-2.5 s) and write into the pages the ranks share with the launcher."""
    proc = _launch(tmp_path, """
        import gc, os
        os.write(1, f"frozen {gc.get_freeze_count()}\\n".encode())
    """)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    frozen = [int(line.split()[1]) for line in proc.stdout.splitlines() if line.startswith("frozen ")]
    assert len(frozen) == 2 and min(frozen) > 1000, proc.stdout  # even a bare interpreter tracks thousands


def test_a_killed_worlds_vllm_segments_are_removed(tmp_path):
    """Catches a launcher that leaves a killed world's vLLM shared-memory segments in /dev/shm
    (utils/vllm_shm.py: ~4 MiB per rank of a TP>1 CPU engine, never freed until reboot): each rank
    writes one under its world's name, then one rank is killed."""
    from megatron_gtpo.utils.vllm_shm import SHM_DIR, world_tag

    if not SHM_DIR.is_dir():
        pytest.skip("no /dev/shm on this host")
    proc = _launch(tmp_path, """
        import os, signal, time
        name = f"mgtpo-{os.environ['MASTER_ADDR']}_{os.environ['MASTER_PORT']}-tp:0-[0-1]-cpushm_{os.environ['RANK']}"
        with open(os.path.join("/dev/shm", name), "wb") as f:
            f.write(bytes(4096))
        os.write(1, f"wrote {name}\\n".encode())
        time.sleep(0.5)
        if os.environ["RANK"] == "1":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(30)
    """)
    assert proc.returncode == 1 and "signal SIGKILL" in proc.stderr, proc.stdout + proc.stderr
    written = [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("wrote ")]
    assert len(written) == 2 and all(name.startswith(world_tag({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": ""}))
                                     for name in written), proc.stdout
    assert not [name for name in written if (SHM_DIR / name).exists()], written


def test_free_port_is_below_the_ephemeral_range_and_bindable():
    """Rank 0's store port comes from below the kernel's ephemeral range, which outgoing connections
    draw from: ``bind(0)``'s port (the injected bug: free_port back to ``bind(0)``) lies inside it, and
    a busy host took it before rank 0 bound it (EADDRINUSE in bench/train_limit.py --quick under load)."""
    import socket

    from megatron_gtpo.parallel.launch import _ephemeral_low, free_port

    low = _ephemeral_low()
    ports = {free_port() for _ in range(8)}
    assert all(1024 <= p < low for p in ports), (ports, low)
    assert len(ports) > 1  # random, so two jobs starting together do not pick the same one
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports.pop()))
