"""Issue 15 in the Megatron train step (tests/dist/scripts/bias_train_step.py, 2 gloo ranks): GTPO's
raw-logit entropy statistic, the fp32 LM head of a bf16 model, and the bias / mismatch metrics of
train_step (D2's terms and the mismatch metrics against one process on the whole batch, with KL and
mismatch weights over DP; D4's Adam step ratio against the measured parameter updates at mu = 3)."""

from __future__ import annotations

import pytest

from tests.helpers import REPO, torchrun

SCRIPT = REPO / "tests/dist/scripts/bias_train_step.py"
pytestmark = pytest.mark.slow

D1 = {"bias/prefix_wagg_common", "bias/prefix_wagg_common_sum", "bias/prefix_common_len", "bias/prefix_wagg_abs_mean",
      "bias/prefix_mixed_nodes_per_group", "bias/conflict_beyond_prefix_frac"}
D2 = {"bias/surrogate_adv_term", "bias/surrogate_entropy_term", "bias/surrogate_kl_term", "bias/surrogate_cov",
      "bias/surrogate_loss_gap", "bias/surrogate_is_term"}
MISMATCH = {"mismatch/is_weight_mean", "mismatch/is_weight_max", "mismatch/is_ratio_min", "mismatch/is_ratio_max",
            "mismatch/is_cut_frac"}


@pytest.fixture(scope="module")
def records():
    return torchrun(SCRIPT, 2, timeout=540)


def test_raw_logit_entropy_statistic(records):
    mine = [r for r in records if r["check"] == "raw_entropy"]
    assert len(mine) == 2
    for r in mine:
        assert r["raw_err"] < 1e-5 and r["sampling_err"] < 1e-5 and r["logp_err"] < 1e-5, r
        assert r["gap"] > 0.05, r  # temperature 0.7 vs 1 really changes <H>: the check can fail


def test_fp32_lm_head(records):
    heads = [r for r in records if r["check"] == "lm_head"]
    assert len(heads) == 2
    for r in heads:
        assert r["fp32_err"] < 1e-5 < 1e-3 < r["bf16_err"], r  # bf16 logits are rounded, fp32 ones exact
    steps = [r for r in records if r["check"] == "lm_head_step"]
    assert len(steps) == 2 and all(r["moved"] > 0 and r["logits_dtype"] == "torch.float32" for r in steps), steps


CAPS = {"grpo_kl_tis": 1.1, "gtpo_mis": 1.2, "dapo_mu3": 1.5}
D2_TERMS = ("bias/surrogate_adv_term", "bias/surrogate_entropy_term", "bias/surrogate_kl_term", "bias/surrogate_is_term")


def _close(got: float, want: float) -> bool:
    """fp32 distributed against float64 in one process: 1e-4 relative, or 1e-6 absolute (the loss's
    own rounding, as for D2's gap); a misattributed term moves by a good part of itself."""
    return abs(got - want) <= max(1e-6, 1e-4 * abs(want))


def test_train_step_bias_and_mismatch_metrics(records):
    """D2's terms and the mismatch metrics of the distributed step (DP = 2, micro-batches of 2 rows)
    equal a single-process computation on the whole batch. Bugs caught: a term moved into another
    (their sum, the loss, would still agree: the gap alone cannot tell), a weight capped at another
    value than the case's C, MIS cut tokens left with a weight, a reduction over DP that is off."""
    got = {(r["case"], r["rank"]): r for r in records if r["check"] == "metrics"}
    assert {case for case, _ in got} == set(CAPS)
    for case, cap in CAPS.items():
        a, b = got[(case, 0)], got[(case, 1)]
        assert a["metrics"] == b["metrics"] and a["nonfinite"] == [], (a, b)  # identical on every rank
        m, ref = a["metrics"], a["reference"]
        assert D1 | D2 | MISMATCH <= set(m), sorted(set(D1 | D2 | MISMATCH) - set(m))
        assert abs(m["bias/surrogate_loss_gap"]) <= 1e-6 * max(1.0, abs(m["loss"])), m  # the loss is the sum
        for key in D2_TERMS:
            assert _close(m[key], ref[key]), (case, key, m[key], ref[key])
        for key in MISMATCH:
            assert _close(m[key], ref[key]), (case, key, m[key], ref[key])
        assert 0 < m["mismatch/is_cut_frac"] < 0.5, m  # active on some tokens
        if case == "gtpo_mis":  # cut tokens weigh 0; the others r in [1/C, C]
            assert m["mismatch/is_ratio_max"] > cap and m["mismatch/is_weight_max"] <= cap + 1e-6, m
        else:  # TIS: min(r, C)
            assert m["mismatch/is_weight_max"] == pytest.approx(min(m["mismatch/is_ratio_max"], cap), abs=1e-6), m
    assert abs(got[("grpo_kl_tis", 0)]["metrics"]["bias/surrogate_kl_term"]) > 1e-4
    assert abs(got[("gtpo_mis", 0)]["metrics"]["bias/surrogate_entropy_term"]) > 1e-4  # gamma 0.1
    # D1 on the groups' common prefixes (spec 10.2): 0 for DAPO's uniform weights, > 0 for GTPO
    assert got[("gtpo_mis", 0)]["metrics"]["bias/prefix_common_len"] > 0
    assert abs(got[("dapo_mu3", 0)]["metrics"]["bias/prefix_wagg_common"]) < 1e-7
    assert got[("gtpo_mis", 0)]["metrics"]["bias/prefix_wagg_common"] > 1e-4


def test_d4_adam_step_ratio_is_the_measured_update_ratio(records):
    """D4 at mu = 3: the logged Adam step ratio is the ratio of the parameter updates actually taken
    (||theta_3 - theta_2|| / ||theta_1 - theta_0||, measured around each optimizer step), and the
    overshoot rate is a share of clipped tokens. Bug caught: a norm summed twice over DP shards or
    read from the wrong update (a consistent factor would cancel in last/first, a wrong update not)."""
    for r in (r for r in records if r["check"] == "metrics" and r["case"] == "dapo_mu3"):
        m, norms = r["metrics"], r["update_norms"]
        assert len(norms) == 3 and norms[0] > 0 and len(set(norms)) == 3, norms
        assert m["bias/adam_step_ratio"] == pytest.approx(norms[-1] / norms[0], rel=1e-4), (m, norms)
        assert 0.0 <= m["bias/clip_overshoot_rate"] <= 1.0 and 0 < m["bias/adam_step_ratio_momentum"] < 1, m
