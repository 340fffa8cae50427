"""The training loop end to end: real torchrun ranks (TP=2, gloo), real vLLM, Megatron and MLflow.

One module-scoped GTPO run serves several checks (metrics in the MLflow store, artifacts, the
learning margin, plots); GRPO learns on the same toy task; Dr. GRPO and DAPO run 2 steps; a run
killed with SIGKILL mid-step resumes and reproduces the uninterrupted run's losses.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import REPO, child_env, kill_tree, run_group

pytestmark = pytest.mark.slow

CLI = [sys.executable, "-m", "megatron_gtpo.cli", "train", str(REPO / "configs" / "tiny.yaml")]
# The toy task (a..m letter share, megatron_gtpo/reward/toy.py) with enough completions per step
# and a learning rate at which a random 2-layer policy moves visibly within a dozen steps.
LEARN = ["train.prompts_per_step=4", "rollout.n=8", "train.micro_batch_size=8", "optim.optimizer.lr=5e-3",
         "train.checkpoint_every=4"]
LEARN_STEPS = 12

DOCUMENTED = ["reward/mean", "reward/std", "reward/accuracy", "completion/length_mean", "completion/truncated_frac",
              "entropy/mean", "gtpo/filtered_frac", "gtpo/conflict_tokens_per_completion", "gtpo/lambda_zero_share",
              "gtpo/lambda_ge2_share", "clip/low_frac", "clip/high_frac", "optim/grad_norm", "optim/lr",
              "mismatch/logprob_abs_mean", "mismatch/logprob_abs_max", "time/rollout_s", "time/reward_s",
              "time/train_s", "time/sync_s", "time/step_s", "throughput/tokens_per_s", "loss"]


def train(out: Path, *args: str, steps: int, timeout: float = 900) -> subprocess.CompletedProcess:
    env = child_env()
    proc = run_group([*CLI, "--output-dir", str(out), "--steps", str(steps), *args], timeout=timeout, env=env,
                     cwd=REPO)
    (out.parent / f"{out.name}.log").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, f"training failed rc={proc.returncode}:\n{(proc.stdout + proc.stderr)[-6000:]}"
    return proc


def history(out: Path, key: str) -> list[tuple[int, float]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    run_id = (out / "run_id").read_text().strip()
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


@pytest.fixture(scope="module")
def gtpo_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("train") / "gtpo"
    train(out, *LEARN, steps=LEARN_STEPS)
    return out


def test_run_dir_holds_config_checkpoint_and_mlflow(gtpo_run):
    import yaml
    from mlflow.tracking import MlflowClient

    resolved = yaml.safe_load((gtpo_run / "config.yaml").read_text())
    assert resolved["algo"]["name"] == "gtpo" and resolved["train"]["steps"] == LEARN_STEPS
    assert (gtpo_run / "checkpoints" / f"step_{LEARN_STEPS:08d}").is_dir()
    assert not list((gtpo_run / "checkpoints").glob(".tmp*")), "a temporary checkpoint dir was left behind"
    client = MlflowClient(f"sqlite:///{gtpo_run / 'mlflow.db'}")
    run = client.get_run((gtpo_run / "run_id").read_text().strip())
    assert run.info.status == "FINISHED"
    assert run.data.params["algo.name"] == "gtpo"
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.yaml", "samples"} <= artifacts
    from megatron_gtpo.metrics import unknown

    assert unknown(run.data.metrics) == [], "logged metrics missing from megatron_gtpo/metrics.py"


@pytest.mark.parametrize("key", DOCUMENTED)
def test_documented_metric_logged_every_step(gtpo_run, key):
    points = history(gtpo_run, key)
    assert [step for step, _ in points] == list(range(1, LEARN_STEPS + 1)), key


def test_gtpo_raises_reward_on_toy_task(gtpo_run):
    rewards = [v for _, v in history(gtpo_run, "reward/mean")]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last > first + 0.2, f"GTPO did not learn: reward {rewards}"


def test_weights_reach_the_engine(gtpo_run):
    # The engine samples from the pushed weights: trainer and engine log-probs of the sampled
    # tokens agree (fp32), step after step, while the policy moves.
    mismatch = [v for _, v in history(gtpo_run, "mismatch/logprob_abs_mean")]
    assert max(mismatch) < 1e-3, mismatch
    assert history(gtpo_run, "sync/version")[-1][1] == LEARN_STEPS


def test_plot_run_renders_png(gtpo_run, tmp_path):
    out = tmp_path / "curves.png"
    subprocess.run([sys.executable, str(REPO / "tools" / "plot_run.py"), str(gtpo_run), "-o", str(out)],
                   check=True, timeout=300, cwd=REPO)
    assert out.stat().st_size > 10_000 and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_grpo_with_kl_learns_and_reports_its_kl(tmp_path, gtpo_run):
    out = tmp_path / "grpo"
    proc = train(out, *LEARN, "algo.name=grpo", "algo.kl_beta=0.04", steps=LEARN_STEPS)
    rewards = [v for _, v in history(out, "reward/mean")]
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.2, f"GRPO did not learn: reward {rewards}"
    kl = history(out, "train/kl_mean")
    assert [s for s, _ in kl] == list(range(1, LEARN_STEPS + 1)), kl
    assert kl[0][1] == 0.0 and all(v > 0 for _, v in kl[1:]), kl  # the policy leaves the reference after step 1
    assert "building the frozen reference model for the KL term (kl_beta=0.04)" in proc.stdout + proc.stderr
    # GTPO has no KL term: no reference model is built, and no KL is reported
    assert "reference model" not in (gtpo_run.parent / "gtpo.log").read_text()
    assert history(gtpo_run, "train/kl_mean") == []


def test_drgrpo_two_steps(tmp_path):
    out = tmp_path / "drgrpo"
    train(out, "algo.name=drgrpo", steps=2)
    assert [s for s, _ in history(out, "reward/mean")] == [1, 2]
    assert [s for s, _ in history(out, "loss")] == [1, 2]


def test_dapo_dynamic_sampling_refills_all_equal_groups(tmp_path):
    """A scripted reward makes every completion of some prompts wrong: DAPO drops those groups (its
    accuracy filter, Eq. 11) and draws new prompts until the batch is full again (the refill loop
    runs), with the overlong punishment on."""
    out = tmp_path / "dapo"
    train(out, "algo.name=dapo", "algo.overlong_buffer_len=8", "algo.dynamic_sampling_max_tries=6",
          "algo.dynamic_sampling_metric=accuracy", "reward.fn=tests.e2e.dapo_reward.half_constant_reward", steps=3)
    tries = [v for _, v in history(out, "rollout/tries")]
    dropped = [v for _, v in history(out, "rollout/dropped_groups")]
    assert [v for _, v in history(out, "rollout/groups")] == [2.0, 2.0, 2.0]  # always refilled to full
    assert sum(tries) > 3 and sum(dropped) > 0, (tries, dropped)
    assert history(out, "reward/overlong"), "DAPO's overlong punishment counter is logged"


def test_kill9_then_resume_matches_uninterrupted(gtpo_run, tmp_path):
    """SIGKILL in the middle of step 3 (checkpoint after step 2), then --resume: the run finishes,
    keeps its MLflow run, and steps 3-4 have the uninterrupted run's losses (fp32, same seeds)."""
    out = tmp_path / "killed"
    env = child_env()
    args = [*CLI, "--output-dir", str(out), "--steps", "4", *LEARN[:-1], "train.checkpoint_every=2"]
    log = open(tmp_path / "killed.log", "w")
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
    deadline = time.time() + 900
    while time.time() < deadline and "step 3/4 |" not in (tmp_path / "killed.log").read_text():
        if (out / "checkpoints" / "step_00000002").is_dir() and "step 2/4 |" in (tmp_path / "killed.log").read_text():
            time.sleep(2.0)  # inside step 3: rollout and training are under way
            break
        time.sleep(0.5)
    kill_tree(proc.pid)  # killpg alone misses the ranks: torchrun starts them in sessions of their own
    proc.wait()
    run_id = (out / "run_id").read_text().strip()
    assert (out / "checkpoints" / "step_00000002").is_dir()
    train(out, "--resume", *LEARN[:-1], "train.checkpoint_every=2", steps=4)
    assert (out / "run_id").read_text().strip() == run_id, "resume must continue the same MLflow run"
    losses = dict(history(out, "loss"))
    reference = dict(history(gtpo_run, "loss"))
    for step in (3, 4):
        assert losses[step] == pytest.approx(reference[step], rel=1e-5, abs=1e-7), (step, losses, reference)
