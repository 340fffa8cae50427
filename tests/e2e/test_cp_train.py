"""Context parallelism from the CLI (issue 23): ``megatron-gtpo train configs/tiny.yaml parallel.cp=2``
on 4 torchrun ranks (TP=2 x CP=2), real vLLM (two colocated engines, one per CP rank's TP pair),
Megatron with the CPU stand-in CP attention, MLflow; then a resume from its step-2 checkpoint.

One CP run of 3 steps and its resume (the only CP=2 CLI runs of the suite). The CP=1 run it is
compared with is the stored one: tests/assets/tiny_reference.json holds configs/tiny.yaml's metrics
as recorded at CP=1, which tests/e2e/test_reference_values.py reproduces (its samples exactly, its
fp32 values within 1e-5), so no second CLI run is needed. The first step samples the same
completions (per-request seeds, the same initial weights in both engines) and trains on them with
each sequence split over two ranks: its metrics equal the CP=1 run's within 1e-5 (CP changes only
fp32 summation order).
"""

from __future__ import annotations

import json
import shutil

import pytest

from megatron_gtpo.checkpoint.files import step_dir, verify
from tests.e2e.runs import history, train
from tests.helpers import REPO

pytestmark = pytest.mark.slow

CP1 = json.loads((REPO / "tests" / "assets" / "tiny_reference.json").read_text())["cases"]["gtpo"]
CP = ["parallel.cp=2", "train.checkpoint_every=2", "train.keep_last=2"]


@pytest.fixture(scope="module")
def cp_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("cp") / "cp2"
    return out, train(out, *CP, steps=3).log


def test_cp_tiny_recipe_trains_from_the_cli_and_matches_cp1(cp_run):
    out, text = cp_run
    assert CP1["overrides"] == [] and "tp=2 cp=2 pp=1 dp=1" in text, text[-3000:]
    assert [s for s, _ in history(out, "loss")] == [1, 2, 3]
    for key, values in CP1["metrics"].items():  # the stored CP=1 run of the same recipe
        step, value = history(out, key)[0]
        assert step == 1 and value == pytest.approx(values[0], rel=1e-5, abs=1e-7), (key, value, values[0])
    # weights reach both engines: trainer and engine log-probs of the sampled tokens agree every step
    assert max(v for _, v in history(out, "mismatch/logprob_abs_mean")) < 1e-3
    assert history(out, "sync/version")[-1][1] == 3
    for step in (2, 3):  # saved once per weight copy, complete and verifiable
        assert verify(step_dir(out / "checkpoints", step), checksums=True) == []


def test_cp_run_resumes_from_its_checkpoint(cp_run, tmp_path):
    out, _ = cp_run
    resumed = tmp_path / "resumed"
    shutil.copytree(out, resumed)
    shutil.rmtree(step_dir(resumed / "checkpoints", 3))  # back to the step-2 checkpoint
    run_id = (resumed / "run_id").read_text()
    text = train(resumed, *CP, "--resume", steps=3).log
    assert "resumed from step 2" in text and "step 3/3 |" in text and "step 2/3 |" not in text, text[-3000:]
    assert (resumed / "run_id").read_text() == run_id
    for key in ("loss", "reward/mean", "optim/grad_norm", "entropy/mean"):  # step 3 again, as uninterrupted
        want = dict(history(out, key))[3]
        assert [v for s, v in history(resumed, key) if s == 3][-1] == pytest.approx(want, rel=1e-5, abs=1e-9), key
    assert verify(step_dir(resumed / "checkpoints", 3), checksums=True) == []
