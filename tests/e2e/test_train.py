"""The training loop end to end, read from the session's shared runs (tests/e2e/conftest.py): real
torchrun ranks (TP=2, gloo), real vLLM, Megatron and MLflow.

configs/tiny.yaml as it is (run_ref_gtpo): run dir, MLflow, artifacts, every documented metric at
every step, the engines serving the pushed weights, plots. GTPO and GRPO learn the toy task
(run_learn_gtpo, run_learn_grpo); GRPO reports its KL. Packed micro-batches mixing rows reproduce
the padded step (run_packed_grpo_kl), and every collective of the production step went through
strict device-group checking. DAPO's dynamic sampling refills (run_dapo_bf16). The kill -9 resume
checks are in test_resume.py (run_killed), the tracking outage in test_tracking_train.py.
"""

from __future__ import annotations

import re
import sys

import pytest

from megatron_gtpo.metrics import unknown
from tests.e2e.runs import LEARN_STEPS, PACKED_TOKENS, history, per_step
from tests.helpers import REPO, run_group

DOCUMENTED = ["reward/mean", "reward/std", "reward/accuracy", "completion/length_mean", "completion/truncated_frac",
              "entropy/mean", "gtpo/filtered_frac", "gtpo/conflict_tokens_per_completion", "gtpo/lambda_zero_share",
              "gtpo/lambda_ge2_share", "clip/low_frac", "clip/high_frac", "optim/grad_norm", "optim/lr",
              "mismatch/logprob_abs_mean", "mismatch/logprob_abs_max", "time/rollout_s", "time/reward_s",
              "time/train_s", "time/sync_s", "time/step_s", "throughput/tokens_per_s", "loss"]
STEPS = 4  # run_ref_gtpo


def test_run_dir_holds_config_checkpoint_and_mlflow(run_ref_gtpo):
    import yaml
    from mlflow.tracking import MlflowClient

    out = run_ref_gtpo.out
    resolved = yaml.safe_load((out / "config.yaml").read_text())
    assert resolved["algo"]["name"] == "gtpo" and resolved["train"]["steps"] == STEPS
    assert (out / "checkpoints" / f"step_{STEPS:08d}").is_dir()
    assert not list((out / "checkpoints").glob(".tmp*")), "a temporary checkpoint dir was left behind"
    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    run = client.get_run((out / "run_id").read_text().strip())
    assert run.info.status == "FINISHED"
    assert run.data.params["algo.name"] == "gtpo"
    assert {"config.yaml", "samples"} <= {a.path for a in client.list_artifacts(run.info.run_id)}
    assert unknown(run.data.metrics) == [], "logged metrics missing from megatron_gtpo/metrics.py"


@pytest.mark.parametrize("key", DOCUMENTED)
def test_documented_metric_logged_every_step(run_ref_gtpo, key):
    per_step(run_ref_gtpo.out, key, STEPS)


def test_per_gpu_throughput_divides_by_the_trainer_ranks(run_ref_gtpo):
    """tokens / (step time x GPUs), the unit peers report: tiny.yaml runs TP=2 on 2 ranks. Injected
    bug: `gpus` not passed by trainer.one_step (default 1) -> equal to tokens_per_s, fails."""
    total = per_step(run_ref_gtpo.out, "throughput/tokens_per_s", STEPS)
    per_gpu = per_step(run_ref_gtpo.out, "throughput/tokens_per_gpu_s", STEPS)
    assert per_gpu == pytest.approx([t / 2 for t in total], rel=1e-9)


def test_step_line_ends_with_an_eta(run_ref_gtpo):
    """Each step line ends with the time left (h:mm:ss); the last step has none left."""
    etas = re.findall(r"step (\d)/4 \|.*\| ETA (\d+:\d\d:\d\d)", run_ref_gtpo.log)
    assert [s for s, _ in etas] == ["1", "2", "3", "4"] and etas[-1][1] == "0:00:00", etas


def test_startup_line_reports_time_and_peak_memory(run_ref_gtpo):
    """The start-up log line tells the user how long start-up took and how much host memory it used."""
    match = re.search(r"ready: .*\(start-up ([0-9.]+) s, peak host RSS ([0-9.]+) GiB\)", run_ref_gtpo.log)
    assert match, run_ref_gtpo.log[-3000:]
    seconds, gib = float(match.group(1)), float(match.group(2))
    assert 1 < seconds < 600 and 0.2 < gib < 20, match.group(0)


def test_weights_reach_the_engine(run_ref_gtpo):
    """The engines sample from the pushed weights: trainer and engine log-probs of the sampled tokens
    agree at every step (fp32 both sides, ~1e-6), while the policy moves. Bug caught: a push that
    leaves one tensor stale (a gap of 1e-4 to 1e-3 on some tokens)."""
    out = run_ref_gtpo.out
    assert max(per_step(out, "mismatch/logprob_abs_max", STEPS)) < 1e-4
    assert max(per_step(out, "mismatch/logprob_abs_mean", STEPS)) < 1e-5
    assert per_step(out, "sync/version", STEPS) == list(range(1, STEPS + 1))
    assert len(set(per_step(out, "entropy/mean", STEPS))) == STEPS  # the policy moved between the pushes


def test_plot_run_renders_png(run_ref_gtpo, tmp_path):
    out = tmp_path / "curves.png"
    proc = run_group([sys.executable, str(REPO / "tools" / "plot_run.py"), str(run_ref_gtpo.out), "-o", str(out)],
                     timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert out.stat().st_size > 10_000 and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_gtpo_builds_no_reference_model(run_ref_gtpo, run_ref_grpo_kl):
    """GTPO has no KL term: no reference model is built and no KL is reported; GRPO with beta 0.04
    builds one, its KL is 0 at step 1 (the policy is the reference) and positive after."""
    assert "reference model" not in run_ref_gtpo.log and history(run_ref_gtpo.out, "train/kl_mean") == []
    assert "building the frozen reference model for the KL term (kl_beta=0.04)" in run_ref_grpo_kl.log
    kl = per_step(run_ref_grpo_kl.out, "train/kl_mean", STEPS)
    assert kl[0] == 0.0 and all(v > 0 for v in kl[1:]), kl


def _learned(rewards: list[float]) -> bool:
    return sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.2


def test_gtpo_raises_reward_on_toy_task(run_learn_gtpo):
    out, server = run_learn_gtpo.run.out, run_learn_gtpo.server
    rewards = per_step(out, "reward/mean", LEARN_STEPS, uri=server.uri)  # replayed into the server
    assert _learned(rewards), f"GTPO did not learn: reward {rewards}"


def test_grpo_with_kl_learns_and_reports_its_kl(run_learn_grpo):
    rewards = per_step(run_learn_grpo.out, "reward/mean", LEARN_STEPS)
    assert _learned(rewards), f"GRPO did not learn: reward {rewards}"
    kl = per_step(run_learn_grpo.out, "train/kl_mean", LEARN_STEPS)
    assert kl[0] == 0.0 and all(v > 0 for v in kl[1:]), kl


def test_packed_micro_batches_reproduce_the_padded_step(run_packed_grpo_kl, run_ref_grpo_kl):
    """Packing (the product default) through the CLI: step 1 trains the same samples as the padded
    reference run, so every metric agrees to float rounding; the bits differ, because the rows were
    regrouped. Bugs caught: a budget that is not wired from the config (a silent fallback to the
    padded path is bit-identical), or packed rows whose loss or gradient differ."""
    packed, padded = run_packed_grpo_kl.out, run_ref_grpo_kl.out
    assert f"packed into micro-batches of <= {PACKED_TOKENS} tokens" in run_packed_grpo_kl.log
    for key in ("reward/mean", "completion/length_mean"):  # same weights, same seeds: same samples
        assert history(packed, key)[0] == history(padded, key)[0], key
    moved = []
    for key in ("loss", "optim/grad_norm", "entropy/mean", "train/kl_mean", "mismatch/logprob_abs_mean"):
        (step, got), want = history(packed, key)[0], history(padded, key)[0][1]
        # abs: the GRPO loss at step 1 is a near-cancelling sum (~1e-8 of float noise around 0)
        assert step == 1 and got == pytest.approx(want, rel=1e-5, abs=1e-7), (key, got, want)
        moved.append(got != want)
    assert any(moved), "bit-identical to the padded run: the rows were not packed"


def test_production_step_goes_through_strict_device_groups(run_packed_grpo_kl):
    """Strict device-group mode (parallel/strict.py; child_env turns it on for every test run)
    checked the collectives of the real run: the TP all-reduces and broadcasts of the training steps
    on device groups, the control plane's on host groups. (vLLM's own groups are left unclassified
    on purpose; that no collective of the train step itself is unclassified is checked per step in
    tests/dist/test_packing.py.) Bug caught: strict mode silently not checking a production run (a
    Megatron upgrade that builds its groups another way, a collective bound before install())."""
    match = re.search(r"strict device groups: (\d+) collective\(s\) checked: (.*)", run_packed_grpo_kl.log)
    assert match, run_packed_grpo_kl.log[-3000:]
    counts = {k: int(v) for k, v in re.findall(r"(\w+/\w+)=(\d+)", match.group(2))}
    assert counts.get("all_reduce/device", 0) > 100, counts  # 2 per layer, micro-batch and step at TP=2, and more
    assert counts.get("broadcast/device", 0) > 0 and counts.get("all_gather/host", 0) > 0, counts


def test_dapo_dynamic_sampling_refills_all_equal_groups(run_dapo_bf16):
    """A scripted reward makes every completion of some prompts wrong: DAPO drops those groups (its
    accuracy filter, Eq. 11) and draws new prompts until the batch is full again (the refill loop
    runs), with the overlong punishment on."""
    out = run_dapo_bf16.out
    tries = per_step(out, "rollout/tries", 3)
    dropped = per_step(out, "rollout/dropped_groups", 3)
    assert per_step(out, "rollout/groups", 3) == [2.0, 2.0, 2.0]  # always refilled to full
    assert sum(tries) > 3 and sum(dropped) > 0, (tries, dropped)
    assert history(out, "reward/overlong"), "DAPO's overlong punishment counter is logged"
