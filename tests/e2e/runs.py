"""The e2e layer's training runs: how to start one, read its MLflow metrics, and the shared recipes.

A training CLI start costs tens of seconds before its first step, so the e2e layer trains a few
runs once per session (fixtures in tests/e2e/conftest.py, documented in tests/README.md) and many
tests read them. Each run is ``configs/tiny.yaml`` on 2 gloo ranks (TP=2) with real vLLM engines,
Megatron and MLflow; every CLI runs in its own process group, killed as a group on timeout.
"""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tests.helpers import REPO, child_env, kill_tree, run_group

CLI = [sys.executable, "-m", "megatron_gtpo.cli", "train", str(REPO / "configs" / "tiny.yaml")]
RUN_TIMEOUT_S = 540
"""One CLI run: below pytest's per-test limit (600 s, fixture set-up included)."""

# The toy task (a..m letter share, megatron_gtpo/reward/toy.py) with enough completions per step
# and a learning rate at which a random 2-layer policy moves visibly within a dozen steps.
LEARN = ["train.prompts_per_step=4", "rollout.n=8", "train.micro_batch_size=8", "optim.optimizer.lr=5e-3",
         "train.checkpoint_every=4"]
LEARN_STEPS = 12

CANON_STEPS = 4
ENTROPY_THRESHOLD = 4.8283
"""The tiny random policy's per-completion mean entropies <H>_i lie within a few thousandths of a
nat of 4.828 (its step-1 mean; ln 128 = 4.852): this threshold drops some completions and keeps
others at step 1. (4.82 dropped every one: no gradient at all.) Later steps may keep or drop all."""
CANON = ["train.checkpoint_every=1", "train.keep_last=2", "optim.scheduler.lr_decay_style=cosine",
         f"algo.entropy_threshold={ENTROPY_THRESHOLD}", "algo.entropy_gamma=0.1", "rollout.offload_trainer=true"]
"""The canonical GTPO run and its killed twin: a checkpoint after every step, a cosine LR (a wrong
step count after a resume moves the LR), GTPO's entropy filter and gamma shift on, and the trainer's
grads and optimizer state offloaded between push and train step (every save and resume runs with
the state offloaded: the copies are exact, so the trajectory is the same as without)."""

DAPO_BF16 = ["algo.name=dapo", "algo.overlong_buffer_len=8", "algo.dynamic_sampling_max_tries=6",
             "algo.dynamic_sampling_metric=accuracy", "reward.fn=tests.e2e.dapo_reward.half_constant_reward",
             "rollout.vllm.dtype=bfloat16", "model.lm_head_fp32=true", "algo.mismatch_correction=tis",
             "algo.mismatch_cap=1.0005", "train.micro_batch_tokens=null"]
"""DAPO with refills (a scripted reward makes some groups all-equal), a bf16 engine against the fp32
trainer with truncated importance sampling, and the default packed micro-batches."""
PACKED_TOKENS = 600
# configs/tiny_moe.yaml over configs/tiny.yaml (the CLI's recipe): the tiny mixture with EP=2 and replay
MOE = ["model.path=tiny-moe-char", "model.moe_routing_replay=rollout", "parallel.ep=2"]
"""A packing budget that holds 2-3 of the tiny recipe's rows (prompts of 150-256 characters plus 24
tokens): packed micro-batches mix rows. The default budget (one worst-case row, 280 tokens) runs in
the DAPO run."""

LORA = ["model.lora.rank=8", "model.lora.alpha=16", "optim.optimizer.lr=1e-2", "train.checkpoint_every=1",
        "train.keep_last=3"]
LORA_STEPS = 3
"""GTPO with rank-8 LoRA adapters on q, k, v, o, gate, up, down of the frozen tiny policy, a
checkpoint after every step; a learning rate at which the adapters visibly move the policy in a
step (B starts at zero: step 1 samples from the base, steps 2-3 from merged weights)."""

SAVING = "checkpoint: saving step {} into "  # logged by save_checkpoint right before the first write


@dataclass
class Run:
    """A finished CLI run."""

    out: Path
    """Its run directory (config.yaml, checkpoints/, mlflow.db, run_id)."""
    log: str
    """Everything it printed (stdout and stderr)."""
    returncode: int = 0


def train(out: Path, *args: str, steps: int, timeout: float = RUN_TIMEOUT_S, ok: bool = True,
          env: dict[str, str] | None = None) -> Run:
    """``megatron-gtpo train configs/tiny.yaml --output-dir out --steps steps *args``; its output is
    also kept in ``<out>-<n>.log`` next to the run dir. Fails the test unless it exits 0 (``ok``).
    ``env``: variables added to the run's environment."""
    proc = run_group([*CLI, "--output-dir", str(out), "--steps", str(steps), *args], timeout=timeout,
                     env=child_env(**(env or {})), cwd=REPO, warm=True)
    text = proc.stdout + proc.stderr
    n = len(list(out.parent.glob(f"{out.name}-*.log")))
    (out.parent / f"{out.name}-{n}.log").write_text(text)
    if ok:
        assert proc.returncode == 0, f"training failed rc={proc.returncode}:\n{text[-6000:]}"
    return Run(out, text, proc.returncode)


def start(out: Path, *args: str, steps: int, log: Path, env: dict | None = None):
    """The same CLI in the background (its own session), stdout and stderr to ``log``: for runs a
    test signals or kills. Forked from the warm interpreter when it can be (tests/warm.py: a
    ``WarmProc``, which the tests use as the ``Popen`` it is otherwise)."""
    from tests.warm import WARM

    cmd, env = [*CLI, "--output-dir", str(out), "--steps", str(steps), *args], child_env(**(env or {}))
    proc = WARM.start(cmd, env=env, cwd=REPO, log=log)
    if proc is not None:
        return proc
    with open(log, "w") as handle:
        return subprocess.Popen(cmd, stdout=handle, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)


def wait_for(proc, log: Path, text: str, *, timeout: float = RUN_TIMEOUT_S,
             poll: float = 0.02) -> None:
    """Until ``text`` appears in ``log``; fails (and kills the run) if the run exits or time runs out."""
    deadline = time.monotonic() + timeout
    while text not in log.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            kill_tree(proc.pid)
            proc.wait()
            raise AssertionError(f"{text!r} never logged (rc={proc.returncode}):\n{log.read_text()[-6000:]}")
        time.sleep(poll)


def history(out: Path, key: str, *, uri: str | None = None) -> list[tuple[int, float]]:
    """Every stored (step, value) of ``key``, sorted by step, duplicates included."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri or f"sqlite:///{out / 'mlflow.db'}")
    run_id = (out / "run_id").read_text().strip()
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def per_step(out: Path, key: str, steps: int, **kwargs) -> list[float]:
    """The values of ``key`` at steps 1..steps; fails unless each step is stored exactly once."""
    points = history(out, key, **kwargs)
    assert [s for s, _ in points] == list(range(1, steps + 1)), (key, points)
    return [v for _, v in points]
