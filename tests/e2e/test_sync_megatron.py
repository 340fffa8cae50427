"""Megatron TP=2 (gloo) -> real vLLM engines through each transport (tests/e2e/scripts/sync_roundtrip.py).

Cases: colocated engines of TP=1 on each rank (full tensors, fp32 and bf16); one colocated engine of
TP=2 over both ranks (``engine_tp``: each rank pushes only its own shards); one rollout server
(``rollout_server``: the separate transport, staged). After a push vLLM's greedy tokens equal
Megatron's (fp32, 8 prompts x 32 tokens); after one optimizer step and a push, engine log-probs of
sampled tokens match the trainer's (mean |diff| <= 1e-4 fp32, <= 2e-2 bf16); a push from another
architecture and a truncated push are rejected before any byte moves (the engine serves its old
weights); a push whose export crashes half-way fails on every rank: a rollout server keeps the old
version, a colocated engine (streamed) refuses to generate until the next complete push repairs it.
The failed pushes carry perturbed weights (noise of the weights' scale), and the same weights
pushed completely change the greedy tokens: a half-applied push could not pass as "unchanged".
Each case is one torchrun launch (~2 min on 2 cores).
"""

from __future__ import annotations

import pytest

from megatron_gtpo.utils.vllm_shm import SHM_DIR, world_tag
from tests.helpers import REPO, free_port, torchrun

SCRIPT = REPO / "tests/e2e/scripts/sync_roundtrip.py"
LOGPROB_TOL = {"fp32": 1e-4, "bf16": 2e-2}


def by_check(results: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in results:
        out.setdefault(r["check"], []).append(r)
    return out


def check_roundtrip(transport: str, dtype: str, engine_tp: int = 1, env: dict[str, str] | None = None) -> None:
    checks = by_check(torchrun(SCRIPT, 2, "--transport", transport, "--dtype", dtype, "--engine-tp", str(engine_tp),
                               timeout=540, env=env))
    for name in ("push_v1", "bad_push", "broken_pushes", "train_step", "logprobs_v2"):
        assert len(checks.get(name, [])) == 2, f"{name} missing from a rank: {checks.get(name)}"
    mode = {"separate": "senders"}.get(transport, "local" if engine_tp == 2 else "full")

    for r in checks["push_v1"]:
        assert r["version"] == 1 and r["tensors"] == 27 and r["mode"] == mode, r  # tiny Qwen2: 2 layers x 12 + 3
        assert r["changed"] >= 6, r  # the engine started from other (HF) weights: the push shows

    if dtype == "fp32":
        for r in checks["greedy"]:
            assert all(r["equal"]) and r["lengths"] == [32] * 8, r

    for r in checks["bad_push"]:
        assert r["error"] and "does not match the engine" in r["error"] and "shape" in r["error"], r
        assert r["unchanged"] and r["versions"] == [1], r

    for r in checks["broken_pushes"]:  # pushes of perturbed weights (v1 + noise): a partial one would show
        assert len(r["errors"]) == 2, r
        rejected = "rejected before any byte moved" if transport == "separate" else "Nothing was loaded"
        assert "missing" in r["errors"][0] and rejected in r["errors"][0], r
        assert "export failed half-way" in r["errors"][1], r
        if transport == "separate":  # staged: the server never loaded any of it
            assert r["refused"] is None and r["unchanged"] == [True, True], r
        else:  # streamed: broken until the next complete push
            assert "unusable" in r["refused"] and r["unchanged"] == [True], r
        assert r["perturbed_changed"] >= 4, r  # the control: the perturbed weights, fully pushed, are visible
        assert r["restored"] and r["versions"] == [4], r  # v1 pushed again serves v1's greedy tokens

    tol = LOGPROB_TOL[dtype]
    for r in checks["train_step"]:
        assert r["mismatch/logprob_abs_mean"] <= tol, r  # the trainer's own view of the v1 samples
        assert r["optim/grad_norm"] > 0, r
    for r in checks["logprobs_v2"]:
        assert r["versions"] == [5], r
        assert r["v2:train_infer/num_tokens"] >= 100, r
        assert r["v2:train_infer/logprob_abs_diff_mean"] <= tol, r
        # v1 samples still carry the v1 engine's log-probs: far from the updated trainer, so the
        # match above can only come from the pushed weights.
        stale = r["v1_samples:train_infer/logprob_abs_diff_mean"]
        assert stale >= 0.05 and stale >= 20 * r["v2:train_infer/logprob_abs_diff_mean"], r


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_push_roundtrip_colocated(dtype: str):
    check_roundtrip("colocated", dtype)


@pytest.mark.slow
def test_engine_tp2_colocated_push_roundtrip():
    """One vLLM engine of TP=2 spanning the 2 trainer ranks (vLLM external_launcher), aligned with
    Megatron's TP=2: each rank hands its engine rank only its own shards (no gather).

    It starts beside shared-memory segments a killed run would have left, under vLLM's own names
    and under this world's (utils/vllm_shm.py). Catches the bug that failed a suite run: vLLM names
    them the same for every external-launcher engine of a host and creates them with O_EXCL, so the
    engine failed with ``create shm in SHMManager failed. errno: 17``; and a world that leaves its
    segments behind."""
    port = str(free_port())
    world = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    stale = [SHM_DIR / f"{prefix}-tp:0-[0-1]-cpushm_{rank}" for prefix in ("", world_tag(world)) for rank in (0, 1)]
    planted = [path for path in stale if not path.exists()]
    for path in planted:
        path.write_bytes(b"\0" * 4096)
    try:
        check_roundtrip("colocated", "fp32", engine_tp=2, env={"MASTER_PORT": port})
        assert not list(SHM_DIR.glob(world_tag(world) + "-*")), "the world's segments were left behind"
    finally:
        for path in planted:
            path.unlink(missing_ok=True)


@pytest.mark.slow
def test_rollout_server_push_roundtrip():
    """The separate transport: 2 trainer ranks + 1 local rollout server process."""
    check_roundtrip("separate", "fp32")
