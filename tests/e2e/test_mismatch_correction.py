"""Train-inference mismatch correction end to end (run_dapo_bf16: DAPO on configs/tiny.yaml with a
bf16 vLLM engine against the fp32 Megatron trainer, real engines, 2 gloo ranks, packed micro-batches).

The engine's bf16 log-probs differ from the trainer's by ~1e-3 per token, so with a tight cap
(C = 1.0005) truncated importance sampling is active on some tokens in every step and every weight
is min(r, C); the first update's loss still equals the D2 decomposition once the weights' part is
counted. (C = 1.002 left one step with no cut token on an AVX-512 Zen 5 host, where the largest ratio of
that step was 1.0019; C = 1.0005 keeps a 4x margin in log r.)
``model.lm_head_fp32`` reaches this run's engines as vLLM's ``hf_overrides: {head_dtype: float32}``
(test_fp32_head_reaches_the_engines, from vLLM's own log of the engine's arguments). That the
override gives a bf16 engine an fp32 head, from the kwargs the colocated and rollout-server builds
make, is measured on a live engine in test_fp32_head_engine.py; neither check replaces the other.
"""

from __future__ import annotations

import math

import pytest

from tests.e2e.runs import per_step

CAP = 1.0005
STEPS = 3


def test_bf16_engine_gap_is_measured_and_bounded(run_dapo_bf16):
    """A real bf16-vs-fp32 gap, but no larger than bf16 rounding: a broken bf16 push (garbage or
    stale weights) gives a far larger gap and fails the upper bound."""
    gap = per_step(run_dapo_bf16.out, "mismatch/logprob_abs_mean", STEPS)
    assert all(1e-4 < g <= 2e-2 for g in gap), gap


def test_correction_is_active_and_exact(run_dapo_bf16):
    """Bugs caught: weights computed from other log-probs than the measured gap (the wrong step's
    sampler, pi_old against pi_theta), a cap applied as another value, cut tokens left uncut."""
    out = run_dapo_bf16.out
    cut, w_max = per_step(out, "mismatch/is_cut_frac", STEPS), per_step(out, "mismatch/is_weight_max", STEPS)
    r_max, r_min = per_step(out, "mismatch/is_ratio_max", STEPS), per_step(out, "mismatch/is_ratio_min", STEPS)
    gap_max = per_step(out, "mismatch/logprob_abs_max", STEPS)
    assert all(c > 0 for c in cut) and all(r > CAP for r in r_max), (cut, r_max)  # some ratios exceed C ...
    for step in range(STEPS):
        assert w_max[step] == pytest.approx(min(r_max[step], CAP), abs=1e-6), (step, w_max, r_max)  # ... cut to C
        # r and the gap come from the same token pairs: the largest |log r| is the largest |gap|
        assert max(math.log(r_max[step]), -math.log(r_min[step])) == pytest.approx(gap_max[step], abs=1e-6), step
    assert all(abs(v) > 0 for v in per_step(out, "bias/surrogate_is_term", STEPS))
    assert all(abs(v) < 1e-7 for v in per_step(out, "bias/surrogate_loss_gap", STEPS))


def test_fp32_head_reaches_the_engines(run_dapo_bf16):
    """The wiring of a real ``megatron-gtpo train``: trainer.build hands the engines it starts the
    settings of ``trainer.engine_rollout_config`` (vLLM logs its non-default engine arguments). Bug
    caught: build_engines given the recipe's rollout config instead. Proved against: trainer.build
    calling ``build_engines(cfg.rollout, ...)`` (no override in the log: this test failed). What vLLM
    does with the override is test_fp32_head_engine.py's check."""
    assert "'hf_overrides': {'head_dtype': 'float32'}" in run_dapo_bf16.log
