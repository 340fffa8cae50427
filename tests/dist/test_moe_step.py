"""The mixture-of-experts train step in expert-parallel layouts equals one process (one 4-rank launch).

tests/dist/scripts/moe_step.py runs GTPO (entropy filter and conflict masks live) and GRPO (KL
term), with free and with replayed routing, padded and packed micro-batches, at EP=2 (DP4),
TP=2 x EP=2 and PP=2 x EP=2 against a single-process reference (plain autograd on the whole
batch, float64 log-softmax). Loss, grad norm, GTPO's filter/conflict metrics and the moe/* metrics
must agree to 1e-6 (relative; the expert loads are ratios of integer counts), every parameter's
gradient to 1e-5 of its tensor's largest entry (fp32 sums in another order: measured up to 2.4e-6
at TP=2). Replay must move the router's weights (the gate's probabilities of the replayed experts
carry the gradient) and report agreement 1.0 against the engine routing, free routing a lower one.

The synthetic-routing replay cases check distribution (EP/TP/PP against one process), but their
reference replays through the same ``RouterWatch``/``tokens_of`` as the step. The ``*_captured``
cases do not: they replay the experts HF transformers' Qwen2-MoE picks (captured by hooks on its
routers, through ``batch_routing`` as the rollout hands them over) and must equal FREE routing's
loss and gradients in every layout. They are the regression cases for the replay bugs
other stacks met: replay of the wrong layer, of another micro-batch's rows, of shifted or padded
positions (the padded ``gtpo_captured`` case: sequence-major order with padding between rows), and
across a pipeline stage boundary (PP=2: stage 2's routers must replay their global layers).
Measured (one launch on the 2-core CI host): the captured cases match free routing to 5.9e-8 in
loss and 1.9e-6 in gradients in every layout. Proved against (each bug injected once, one launch
each, then reverted; relative errors):
* replay of the wrong layer (``tokens.engine[:, (layer + 1) % L]`` in ``RouterWatch.micro_batch``):
  both captured cases failed at EP=2 and TP=2 x EP=2 by loss (1.7e-5, 1.2e-3) and grad norm (3.7e-3,
  5.4e-3), while the synthetic replay cases kept the reference's loss (it replays through the same
  bug) and failed only on the agreement.
* the layer index after a pipeline stage boundary (``enumerate`` over a chunk's routers instead of
  ``layer_number - 1`` in ``RouterWatch.__init__``): every case of PP=2 x EP=2 failed, the captured
  ones by grad norm (gtpo 1.4e-4, grpo_kl 2.9e-3; grpo_kl's loss 1.6e-3), the others by the moe/*
  metrics (1.0: stage 2's statistics filed under layers 0 and 1); the one-stage layouts passed.
* padded positions in row-major order (no ``.transpose(0, 1)`` in ``tokens_of``'s padded branch):
  the padded ``gtpo_captured`` failed in every layout by grad norm (1.3e-3, 9.7e-4, 1.3e-3); the
  synthetic replay cases (their one-process reference is one padded micro-batch) by loss up to
  3.2e-4 and the moe/* metrics; the free cases by the agreement (moe/* 0.02 to 0.06).
* routing shifted by one token (``out[row, 1:len(rows) + 1]`` in ``batch_routing``): both captured
  cases failed in every layout by loss (grpo_kl 1.1e-3, gtpo 8.6e-6) and grad norm (1.2e-3,
  2.6e-3); the synthetic cases passed (their routing does not pass through ``batch_routing``).
* the wrong micro-batch order (each micro-batch given the next one's ``tokens_of`` in
  ``plan.rank_micro_batches``): the launch failed at its first layout on a shape error in the
  replayed forward (that rank's micro-batches have 24 and 26 tokens). Its silent form (handed over
  only where the two have one length, as every micro-batch has at PP=2): every case of every
  layout failed, the captured ones by grad norm 3.6e-4 to 2.6e-3 (loss up to 1.3e-3).
"""

from __future__ import annotations

import pytest

from tests.helpers import REPO, torchrun
from tests.tiny_hf import save_tiny_hf_model

TOL, GRAD_TOL = 1e-6, 1e-5
LAYOUTS = ["tp1_pp1_ep2_dp4", "tp1_pp2_ep2_dp2", "tp2_pp1_ep2_dp2"]
pytestmark = pytest.mark.slow


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def _check(r: dict) -> dict[str, float]:
    """One record's checks; returns its errors against the reference."""
    assert r["nonfinite"] == [], r
    assert set(r["moe"]) == set(r["moe_ref"]) and "moe/routing_agreement" in r["moe"], r
    assert set(r["gtpo"]) == set(r["gtpo_ref"]), r
    # Judged against free routing by loss and gradients only: each row's last token (never fed to the
    # engine) replays experts 0..k-1 where free routing picks its own, which moves that token's loads,
    # later layers' router entropy (it feeds no scored position), and the agreement is another one.
    captured = r["case"].endswith("_captured")
    compared = [] if captured else list(r["moe"])
    errors = {"loss": _rel(r["loss"], r["loss_ref"]), "grad_norm": _rel(r["grad_norm"], r["grad_norm_ref"]),
              "moe": max((_rel(r["moe"][k], r["moe_ref"][k]) for k in compared), default=0.0),
              "gtpo": max((abs(r["gtpo"][k] - r["gtpo_ref"][k]) for k in r["gtpo"]), default=0.0)}
    assert max(errors.values()) <= TOL, (r["layout"], r["case"], errors)
    assert r["grad_err"] <= GRAD_TOL, (r["layout"], r["case"], r["worst"], r["grad_err"])
    assert r["router_grad"] > 0, r  # the router learns, with and without replay
    replay = r["case"].endswith(("_replay", "_captured"))
    agreement = r["moe"]["moe/routing_agreement"]
    assert (agreement == 1.0) == replay, ("agreement", agreement)  # random engine routing: free routing differs
    assert r["moe"]["moe/dropped_frac"] == 0.0 and r["moe"]["moe/expert_load_max"] >= 1.0, r
    if r["case"].startswith("gtpo"):  # the threshold splits the completions; the groups share tokens
        assert 0.0 < r["gtpo"]["gtpo/filtered_frac"] < 1.0, r
        assert r["gtpo"]["gtpo/conflict_tokens_per_completion"] > 0.0, r
    return {**errors, "grads": r["grad_err"]}


@pytest.mark.timeout(900)  # 6 cases x 3 layouts: ~10 min on the 2-core host at load 40-100
def test_moe_step_expert_parallel_layouts_equal_one_process(tmp_path):
    hf_dir = save_tiny_hf_model("qwen2_moe", tmp_path / "hf", seed=4)
    results = torchrun(REPO / "tests/dist/scripts/moe_step.py", 4, str(hf_dir), timeout=840)
    cases = {"gtpo", "gtpo_replay", "grpo_kl", "grpo_kl_replay", "gtpo_captured", "grpo_kl_captured"}
    assert sorted((r["layout"], r["case"], r["rank"]) for r in results) == sorted(
        (layout, case, rank) for layout in LAYOUTS for case in cases for rank in range(4)), results
    worst: dict[str, float] = {}
    failed: dict[tuple[str, str], str] = {}  # every failing layout and case (first rank's reason), not just the first
    for r in results:
        try:
            errors = _check(r)
        except AssertionError as err:
            failed.setdefault((r["layout"], r["case"]), f"rank {r['rank']}: {str(err).splitlines()[0]}")
            continue
        for k, v in errors.items():
            worst[k] = max(worst.get(k, 0.0), v)
    print("worst errors against one process over layouts, cases and ranks:", worst)
    assert not failed, "\n".join(f"{layout} {case} {why}" for (layout, case), why in sorted(failed.items()))
