"""A mixture at TP=2 with sequence parallelism: the router of each TP rank routes its SP slice of the
tokens, and routing replay and the router metrics index that slice (tests/dist/scripts/moe_sp.py,
one 2-rank launch; the real Megatron TopKRouter and the project's RouterWatch)."""

from __future__ import annotations

import pytest

from tests.helpers import REPO, torchrun

SCRIPT = REPO / "tests/dist/scripts/moe_sp.py"
pytestmark = pytest.mark.slow


def test_replay_and_router_metrics_index_the_sequence_parallel_slice():
    """N3 (GPU review round 3): with sequence parallelism a TP rank's router sees ``[S/tp, b, h]``,
    but the replay's target indices and the watch's token masks covered the whole ``S * b``: the
    replay's ``scores.gather`` and the metrics' masks failed on the shapes at the first update of any
    MoE model at TP > 1 on GPU. Injected: ``MoeTokens.share`` returning the whole token set -> the
    launch fails with the shape error (RuntimeError in the replay), this fails; metrics not summed
    over the TP group -> counts of one half, metric_err ~0.5, this fails."""
    records = torchrun(SCRIPT, 2, timeout=300)
    assert sorted((r["case"], r["tp_rank"]) for r in records) == [("packed", 0), ("packed", 1), ("padded", 0),
                                                                  ("padded", 1)], records
    for r in records:
        assert r["tokens"] * 2 == r["total"], r  # each rank routed its half of the tokens
        assert r["replayed_exact"], r  # the engine's experts of exactly those tokens
        assert r["keys"] == [] and r["agreement"] == 1.0 and r["metric_err"] <= 1e-6, r
