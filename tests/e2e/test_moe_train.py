"""A tiny mixture-of-experts GTPO run from the CLI (shared fixture ``run_moe``: TP=2 x EP=2, real
vLLM serving the experts, rollout routing replay). The engine's routing reaches the trainer and is
replayed (agreement 1.0: a replay that drops the engine's experts, or routing lost on the way from
the engine, reads below 1), the router metrics are logged every step, and the run stays finite."""

from __future__ import annotations

import math

from tests.e2e import runs

STEPS = 2


def test_moe_cli_run_replays_the_engine_routing_and_logs_router_metrics(run_moe):
    out = run_moe.out
    assert runs.per_step(out, "moe/routing_agreement", STEPS) == [1.0] * STEPS
    loads = runs.per_step(out, "moe/expert_load_max", STEPS)
    assert all(1.0 <= v <= 4.0 for v in loads), loads  # max over mean tokens per expert, 4 experts
    assert all(v == 0.0 for v in runs.per_step(out, "moe/dropped_frac", STEPS))  # dropless
    entropy = runs.per_step(out, "moe/router_entropy", STEPS)
    assert all(0.0 < v <= math.log(4) + 1e-6 for v in entropy), entropy
    assert all(math.isfinite(v) for v in runs.per_step(out, "loss", STEPS))
