"""Issue 16: the one-pass train step (GTPO's <H>_i and, at mu > 1, pi_old from the first update's
own forward) equals the former pre-pass step (``tests/prepass.py``) to 1e-6 in loss,
metrics, gradients and updated weights, in TP=2, PP=2 and DP=2 layouts on 2 gloo ranks
(tests/dist/scripts/onepass_step.py)."""

from __future__ import annotations

import functools

import pytest

from tests.helpers import REPO, torchrun

SCRIPT = REPO / "tests/dist/scripts/onepass_step.py"
LAYOUTS = {"tp2_pp1_dp1", "tp1_pp2_dp1", "tp1_pp1_dp2"}
CASES = {"gtpo", "gtpo_raw_mu2", "dapo_mu2_tis"}
pytestmark = pytest.mark.slow


@functools.cache
def torchrun_records() -> list[dict]:
    return torchrun(SCRIPT, 2, "2,1", "1,2", "1,1", timeout=900)


@pytest.fixture(scope="module")
def records():
    return [r for r in torchrun_records() if r["check"] == "onepass"]


def test_every_layout_and_case_ran_both_paths(records):
    assert sorted((r["layout"], r["case"], r["rank"]) for r in records) == sorted(
        (layout, case, rank) for layout in LAYOUTS for case in CASES for rank in range(2))
    for r in records:
        assert r["pre_passes"] == [1, 0], r  # the reference really ran its no-grad forward, one pass none
        assert r["names_equal"] and r["nonfinite"] == [], r


def test_one_pass_equals_pre_pass(records):
    for r in records:
        assert r["metric_err"] <= 1e-6 and r["grad_err"] <= 1e-6 and r["param_err"] <= 1e-6, r
        assert r["moved"] > 0, r  # the step changed the weights: equal weights are not untouched ones


def test_the_compared_features_are_active(records):
    """What makes the comparison meaningful: GTPO's filter keeps some rows and drops others (so
    <H>_i decides the loss), the raw-logit statistic differs from the sampling one, and at mu = 2
    the second update's ratio moves away from 1 (pi_old is a real, kept tensor) and is clipped."""
    by = {(r["layout"], r["case"]): r for r in records if r["rank"] == 0}
    for layout in LAYOUTS:
        gtpo, raw, dapo = by[(layout, "gtpo")], by[(layout, "gtpo_raw_mu2")], by[(layout, "dapo_mu2_tis")]
        assert 0 < gtpo["filtered"] < 1 and gtpo["loss"] != 0, gtpo
        assert raw["entropy"] != gtpo["entropy"], (raw, gtpo)
        for r in (raw, dapo):
            assert r["ratio_max"] > 1.0 and r["clip"] > 0, r


def test_nonfinite_values_stop_every_rank_before_the_optimizer_step():
    got = [r for r in torchrun_records() if r["check"] == "nonfinite"]
    assert sorted((r["layout"], r["rank"]) for r in got) == sorted((lay, rank) for lay in LAYOUTS for rank in range(2))
    for r in got:
        assert r["error"].startswith("update 0 of the step: non-finite values in") and r["unchanged"], r
        # the last stage names what it found; a first pipeline stage learns it from the flag
        assert ("'loss'" in r["error"] and "<H>_i" in r["error"]) or "another rank" in r["error"], r


def test_one_pass_is_bit_identical_on_cpu(records):
    """Stronger than 1e-6 on CPU: the same operations in the same order (the first update's forward
    equals the no-grad one, <H>_i is taken in the global batch's width), so stored reference values
    (tests/assets/tiny_reference.json) cannot move."""
    for r in records:
        assert r["metric_same"] and r["grad_same"] and r["param_same"], r
