"""Resume end to end (real torchrun ranks, vLLM, Megatron, MLflow): a resume never silently
restarts, and a crash loses at most the current step, after which the run goes on exactly as if
nothing had happened.

The reference is the session's canonical run (run_canon: GTPO with the entropy filter and gamma on,
cosine LR, a checkpoint every step, started with --resume=auto in an empty dir). Against it:
--resume with the checkpoints gone (an error within seconds), a truncated shard in the newest
checkpoint (resumes from the previous one), and run_killed: the same recipe SIGKILLed in the
middle of step 3's checkpoint save, then resumed.

"The same trajectory" is judged on metrics that depend on the weights, the optimizer state, the
RNG and the data cursor (TRAJECTORY), bit for bit (fp32 on CPU is deterministic here), at every
step, with every stored value (a step logged twice counts twice). The loss alone could not tell: on
this recipe it is ~0 whenever no token is in conflict, and the LR depends on the step alone.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from megatron_gtpo.checkpoint.files import step_dir, verify
from tests.e2e.runs import CANON, CANON_STEPS, history, per_step, train

STEPS = CANON_STEPS
TRAJECTORY = ("entropy/mean", "optim/grad_norm", "reward/mean", "completion/length_mean", "mismatch/logprob_abs_mean",
              "mismatch/logprob_abs_max", "gtpo/filtered_frac", "loss", "optim/lr")
VARYING = ("entropy/mean", "optim/lr")
"""Keys that must take a different value at every step of the reference: the oracle is not constant.
(The grad norm is 0 at a step whose completions the entropy filter all dropped; Adam's momentum
still moves the weights then, which the entropy shows.)"""


def assert_same_trajectory(out: Path, ref: Path, steps: list[int]) -> None:
    """Every stored value of TRAJECTORY at ``steps`` equals the reference's, bit for bit, and each
    of ``steps`` is stored exactly once."""
    for key in TRAJECTORY:
        expected = dict(history(ref, key))
        got = [(s, v) for s, v in history(out, key) if s in steps]
        assert [s for s, _ in got] == steps, (key, got)
        for step, value in got:
            assert value == expected[step], (key, step, got, expected)


def _copy(src: Path, dst: Path, *, checkpoints: bool = True) -> Path:
    shutil.copytree(src, dst, ignore=None if checkpoints else shutil.ignore_patterns("checkpoints"))
    return dst


def test_auto_starts_fresh_without_checkpoints(run_canon):
    out, text = run_canon.out, run_canon.log
    assert "--resume=auto: no checkpoint under" in text and f"starting at step 0 of {STEPS}" in text
    for key in VARYING:  # the trajectory oracle moves at every step
        assert len(set(per_step(out, key, STEPS))) == STEPS, (key, history(out, key))
    assert per_step(out, "optim/grad_norm", STEPS)[0] > 0, "step 1 must train: Adam's moments are non-zero"
    for step in (3, 4):  # keep_last=2; every kept step verifies (sizes + sha256)
        assert verify(step_dir(out / "checkpoints", step), checksums=True) == []
    assert not (out / "checkpoints" / "step_00000002").exists()


def test_gtpo_entropy_filter_and_gamma_are_active(run_canon):
    """The canonical run trains with GTPO's entropy filter dropping some completions and keeping
    others at some step, and the gamma <H> shift contributing to the loss wherever a completion is
    kept (D2's entropy term is exactly 0 when gamma is 0 or the filter drops every completion)."""
    filtered = per_step(run_canon.out, "gtpo/filtered_frac", STEPS)
    assert any(0 < f < 1 for f in filtered), filtered
    shift = per_step(run_canon.out, "bias/surrogate_entropy_term", STEPS)
    assert all(abs(v) > 0 for v, f in zip(shift, filtered) if f < 1), (shift, filtered)


def test_resume_without_checkpoints_fails_in_seconds(run_canon, tmp_path):
    out = _copy(run_canon.out, tmp_path / "gone", checkpoints=False)
    run_id, config = (out / "run_id").read_text(), (out / "config.yaml").read_text()
    t0 = time.perf_counter()
    run = train(out, *CANON, "--resume", steps=STEPS, timeout=120, ok=False)
    elapsed = time.perf_counter() - t0
    assert run.returncode == 2, run.log
    assert f"--resume: no usable checkpoint in run dir {out}: {out / 'checkpoints'} does not exist" in run.log
    assert "run without --resume" in run.log and "building the policy" not in run.log
    assert elapsed < 30, f"took {elapsed:.1f}s: the launcher must refuse before any rank starts"
    assert (out / "run_id").read_text() == run_id and (out / "config.yaml").read_text() == config


def test_truncated_newest_checkpoint_resumes_from_the_previous_one(run_canon, tmp_path):
    ref = run_canon.out
    out = _copy(ref, tmp_path / "truncated")
    shard = step_dir(out / "checkpoints", 4) / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:1000])
    run_id = (out / "run_id").read_text()
    text = train(out, *CANON, "--resume=auto", steps=STEPS).log
    assert f"checkpoint {shard.parent} is unusable: {shard}: truncated: 1000 bytes" in text, text
    assert f"resuming from {step_dir(out / 'checkpoints', 3)}, the newest intact checkpoint" in text
    assert "resumed from step 3" in text and "step 4/4 |" in text and "step 3/4 |" not in text
    assert (out / "run_id").read_text() == run_id
    assert_same_trajectory(out, ref, [1, 2, 3, 4])
    assert verify(step_dir(out / "checkpoints", 4), checksums=True) == []  # saved again over the bad one


def test_kill9_during_checkpoint_save_then_resume_matches_uninterrupted(run_killed, run_canon):
    """Bugs caught: a resume that restores the wrong step's weights, re-initialises the model, loses
    Adam's moments, the RNG state or the data cursor (each changes entropy, grad norm or rewards
    from step 3 on), or stores a re-run step twice in MLflow."""
    out, text = run_killed.out, run_killed.resumed.log
    assert f"removed {run_killed.tmp}, left over by an interrupted save" in text, text
    assert "resumed from step 2" in text
    # The loop's journal: only the step in progress at the kill (3) is done again.
    assert "step 3/4 |" in text and "step 4/4 |" in text and "step 1/4 |" not in text and "step 2/4 |" not in text
    assert "step 3/4 |" in run_killed.killed_log  # step 3 had been logged before its save was killed
    assert (out / "run_id").read_text().strip() == run_killed.run_id, "resume must continue the same MLflow run"
    assert not list((out / "checkpoints").glob(".tmp_step_*"))
    assert_same_trajectory(out, run_canon.out, [1, 2, 3, 4])


def test_step_rerun_after_sigkill_is_stored_once(run_killed):
    """Step 3 reached MLflow before the kill and ran again after the resume: every per-step key has
    steps 1..4 exactly once (data/* has step 0 once), one MLflow run, FINISHED, and the resume
    reported the run the killed process left RUNNING."""
    from mlflow.tracking import MlflowClient

    out = run_killed.out
    assert "left RUNNING by pid" in run_killed.resumed.log
    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    run = client.get_run(run_killed.run_id)
    assert run.info.status == "FINISHED"
    assert "data/prompts" in run.data.metrics
    for key in run.data.metrics:
        steps = sorted(m.step for m in client.get_metric_history(run_killed.run_id, key))
        # data/* describe the prompt set: logged once, at step 0 of the fresh run, never on resume
        assert steps == ([0] if key.startswith("data/") else list(range(1, STEPS + 1))), (key, steps)
