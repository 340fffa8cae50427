"""Context parallelism's building blocks equal one process (issue 23, phase A).

One 4-rank launch (tests/dist/scripts/cp_equivalence.py) runs TP=2 x CP=2 and CP=2 x DP=2 from the
same weights, after a CP=1 run of the whole batch on every rank (the one-process reference). Under
CP: the CPU stand-in attention against Megatron's local attention (outputs, q/k/v gradients, padded
and packed), GPTModel's logits at every global position, and one
forward/backward through Megatron's schedule and DDP (gradients reduced over DP x CP, rescaled by
``cp_loss.megatron_loss_scale``) for GTPO with its entropy filter deciding, GRPO with a KL term and
DAPO, padded and packed: loss, gradients, per-token log-probs, <H>_i and the filter's decisions.

The attention check runs in fp32 (<= 1e-6); the model checks in fp64, so that rounding cannot hide
a CP error: CP=2 then equals CP=1 to 1e-12 in loss, logits, log-probs and <H>_i, and to 1e-8 in the
gradients, whose floor is Megatron's local-spec norms (their weights stay fp32 whatever the model
dtype; measured against the same reference: TP2 x CP1 x DP2, no CP, 0.9-1.6e-9; the CP layouts
1.2-1.9e-9). In fp32 the same step checks measured 5e-7-1.5e-6 (gradients, norm-wise), i.e. fp32's
own rounding, which is why they run in fp64 here.
"""

from __future__ import annotations

import pytest

from tests.helpers import REPO, torchrun

SCRIPT = REPO / "tests/dist/scripts/cp_equivalence.py"
pytestmark = pytest.mark.slow
FP32, FP64, GRAD = 1e-6, 1e-12, 1e-8


def _check_step(r: dict) -> None:
    assert abs(r["loss"] - r["loss_ref"]) <= FP64 * r["magnitude"], r  # judged on the loss's |A| magnitude
    assert r["logp_err"] <= FP64 and r["mean_h_err"] <= FP64 and r["grad_err"] <= GRAD, r
    assert r["delta_equal"], r


def test_cp_building_blocks_equal_one_process():
    records = torchrun(SCRIPT, 4, "2,2", "1,2")
    by = {}
    for r in records:
        by.setdefault(r["check"], []).append(r)
    for r in by["reference"]:  # the CP=1 code path against the dense fp64 reference loss
        assert abs(r["loss"] - r["dense"]) <= 1e-6 * abs(r["dense"]) and r["logp_err"] <= FP64, r
        assert r["mean_h_err"] <= FP64, r
    assert len(by["attention"]) == 2 * 4 * 2, by["attention"]  # (padded, packed) x 4 ranks x 2 CP layouts
    for r in by["attention"]:
        assert r["out_err"] <= FP32 and r["grad_err"] <= FP32, r
    assert len(by["ddp"]) == 8, by["ddp"]
    for r in by["ddp"]:  # DDP over DP x CP, gradients scaled by 1 / |DP x CP| (megatron_loss_scale's premise)
        expected = {"tp2_cp2_dp1": 2, "tp1_cp2_dp2": 4}[r["layout"]]
        assert r["dp_cp_group"] == r["dp_cp"] == expected and r["scaling"], r
        assert all(abs(f - 1.0 / expected) < 1e-15 for f in r["scaling"]), r
    assert len(by["logits"]) == 8 and all(r["logits_err"] <= FP64 for r in by["logits"]), by["logits"]
    steps = by["step"]
    layouts = {"tp2_cp2_dp1": ("gtpo", "dapo"), "tp1_cp2_dp2": ("gtpo", "grpo_kl", "dapo")}
    for layout, names in layouts.items():
        mine = [r for r in steps if r["layout"] == layout]
        assert sorted((r["case"], r["packed"], r["rank"]) for r in mine) == sorted(
            (n, p, k) for n in names for p in (False, True) for k in range(4)), mine
    for r in steps:
        _check_step(r)
        assert r["split"]["exact_partition"], r  # every completion token held by exactly one CP rank
    gtpo = [r for r in steps if r["case"] == "gtpo"]
    # GTPO's filter really decides, and conflict runs really straddle ranks and completion ends
    assert all(r["filtered"] > 0 for r in gtpo) and any(r["kept"] > 0 for r in gtpo), gtpo
    assert all(r["split"]["conflicts_span_ranks"] > 0 and r["split"]["conflict_off_end_rank"] > 0 for r in gtpo), gtpo
