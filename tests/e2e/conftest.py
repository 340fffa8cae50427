"""Shared runs of the e2e layer: each is trained once per session, on first use, and read by many
tests (tests/README.md lists them and says how to add a check to one instead of starting a run).

A fixture that fails (the run exits non-zero, a kill lands in the wrong place) fails every test
that reads it, with the run's log.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from megatron_gtpo.checkpoint.files import step_dir
from tests.e2e import runs
from tests.e2e.mlflow_server import MlflowServer
from tests.helpers import REPO, child_env, kill_tree, run_group

REFERENCE = json.loads((REPO / "tests" / "assets" / "tiny_reference.json").read_text())


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """One real ``mlflow server`` (SQLite) for the session; a test that kills it starts it again."""
    server = MlflowServer(tmp_path_factory.mktemp("mlflow_server")).start()
    yield server
    server.kill()


def _reference_run(tmp_path_factory, case: str) -> runs.Run:
    out = tmp_path_factory.mktemp("ref") / case
    return runs.train(out, *REFERENCE["cases"][case]["overrides"], steps=4)


@pytest.fixture(scope="session")
def run_ref_gtpo(tmp_path_factory) -> runs.Run:
    """configs/tiny.yaml as it is, 4 steps: the stored reference values (tests/assets/tiny_reference.json,
    case gtpo), and the run directory, MLflow and metric checks of test_train.py."""
    return _reference_run(tmp_path_factory, "gtpo")


@pytest.fixture(scope="session")
def run_ref_grpo_kl(tmp_path_factory) -> runs.Run:
    """GRPO with a KL term (beta 0.04), 4 steps, padded micro-batches: stored reference case grpo_kl."""
    return _reference_run(tmp_path_factory, "grpo_kl")


@pytest.fixture(scope="session")
def run_moe(tmp_path_factory) -> runs.Run:
    """configs/tiny_moe.yaml's settings (tiny-moe-char, a Qwen3-MoE of 4 experts, top-2) at TP=2 x EP=2
    with rollout routing replay, GTPO, 2 steps: the MoE path from the CLI (vLLM serving the experts
    and returning their routing, experts through the push, replay in the trainer, moe/* metrics)."""
    out = tmp_path_factory.mktemp("moe") / "gtpo"
    return runs.train(out, *runs.MOE, steps=2)


@pytest.fixture(scope="session")
def run_packed_grpo_kl(tmp_path_factory) -> runs.Run:
    """run_ref_grpo_kl's recipe with packed micro-batches that mix rows (runs.PACKED_TOKENS), 2 steps."""
    out = tmp_path_factory.mktemp("packed") / "grpo_kl"
    return runs.train(out, *REFERENCE["cases"]["grpo_kl"]["overrides"],
                      f"train.micro_batch_tokens={runs.PACKED_TOKENS}", steps=2)


@pytest.fixture(scope="session")
def run_canon(tmp_path_factory) -> runs.Run:
    """The canonical GTPO run (runs.CANON: filter and gamma on, cosine LR, a checkpoint every step,
    4 steps), started with --resume=auto in an empty directory (a fresh start)."""
    out = tmp_path_factory.mktemp("canon") / "gtpo"
    return runs.train(out, *runs.CANON, "--resume=auto", steps=runs.CANON_STEPS)


@dataclass
class KilledRun:
    """run_canon's recipe, SIGKILLed (launcher, ranks, engines at once) while step 3's checkpoint
    was being written, then resumed with --resume."""

    out: Path
    killed_log: str
    """Output of the killed run, up to the kill."""
    resumed: runs.Run
    run_id: str
    """The MLflow run ID the killed run had created."""
    tmp: Path
    """The partial checkpoint directory the kill left behind."""


@pytest.fixture(scope="session")
def run_killed(tmp_path_factory) -> KilledRun:
    root = tmp_path_factory.mktemp("killed")
    out, log = root / "gtpo", root / "killed.log"
    proc = runs.start(out, *runs.CANON, steps=runs.CANON_STEPS, log=log)
    tmp = out / "checkpoints" / ".tmp_step_00000003"
    runs.wait_for(proc, log, runs.SAVING.format(3), poll=0.01)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not (tmp.is_dir() and any(tmp.iterdir())):
        time.sleep(0.005)  # until the first shard file is being written
    kill_tree(proc.pid)  # launcher, ranks, engines, scorer: all at once, like an outage
    proc.wait()
    killed_at = log.read_text()
    time.sleep(1)
    assert log.read_text() == killed_at, "a process of the run survived the kill"
    assert proc.returncode == -9, proc.returncode
    assert not step_dir(out / "checkpoints", 3).exists(), "the save finished before the kill: not a mid-save kill"
    assert step_dir(out / "checkpoints", 2).is_dir(), killed_at[-4000:]
    run_id = (out / "run_id").read_text().strip()
    resumed = runs.train(out, *runs.CANON, "--resume", steps=runs.CANON_STEPS)
    return KilledRun(out=out, killed_log=killed_at, resumed=resumed, run_id=run_id, tmp=tmp)


@dataclass
class OutageRun:
    """runs.LEARN (GTPO, 12 steps) tracked by run_learn's MLflow server, which is SIGKILLed once
    step 3 is logged; after the run the server comes back and ``megatron-gtpo tracking replay``
    sends what the journal kept."""

    run: runs.Run
    server: MlflowServer
    after_kill_s: float
    """From the server kill to the run's exit."""
    replay: subprocess.CompletedProcess


@pytest.fixture(scope="session")
def run_learn_gtpo(tmp_path_factory, mlflow_server) -> OutageRun:
    if mlflow_server.proc is None:
        mlflow_server.start()
    root = tmp_path_factory.mktemp("learn")
    out, log = root / "gtpo", root / "learn.log"
    proc = runs.start(out, *runs.LEARN, f"tracking.uri={mlflow_server.uri}", steps=runs.LEARN_STEPS, log=log,
                      env={"PYTHONUNBUFFERED": "1"})
    try:
        runs.wait_for(proc, log, f"step 3/{runs.LEARN_STEPS} |")
        mlflow_server.kill()
        killed_at = time.monotonic()
        proc.wait(timeout=runs.RUN_TIMEOUT_S)
        after_kill_s = time.monotonic() - killed_at
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
            proc.wait()
    text = log.read_text()
    assert proc.returncode == 0, f"training failed rc={proc.returncode}:\n{text[-6000:]}"
    mlflow_server.start()  # same port and store: the server is back
    replay = run_group([sys.executable, "-m", "megatron_gtpo.tracking", "replay", str(out)], timeout=300,
                       env=child_env(), cwd=REPO)
    assert replay.returncode == 0, replay.stdout + replay.stderr
    return OutageRun(run=runs.Run(out, text), server=mlflow_server, after_kill_s=after_kill_s, replay=replay)


@pytest.fixture(scope="session")
def run_learn_grpo(tmp_path_factory) -> runs.Run:
    """runs.LEARN with GRPO and a KL term (beta 0.04), 12 steps."""
    out = tmp_path_factory.mktemp("learn") / "grpo"
    return runs.train(out, *runs.LEARN, "algo.name=grpo", "algo.kl_beta=0.04", steps=runs.LEARN_STEPS)


@pytest.fixture(scope="session")
def run_dapo_bf16(tmp_path_factory) -> runs.Run:
    """runs.DAPO_BF16, 3 steps: DAPO's refill loop, a bf16 engine with TIS (cap 1.0005), the fp32 head
    in the engines, and the default packed micro-batches."""
    out = tmp_path_factory.mktemp("dapo") / "bf16"
    return runs.train(out, *runs.DAPO_BF16, steps=3)


@pytest.fixture(scope="session")
def run_lora(tmp_path_factory) -> runs.Run:
    """runs.LORA (rank-8 LoRA GTPO, a checkpoint every step), 3 steps: tests/e2e/test_lora_train.py."""
    out = tmp_path_factory.mktemp("lora") / "gtpo"
    return runs.train(out, *runs.LORA, steps=runs.LORA_STEPS)
