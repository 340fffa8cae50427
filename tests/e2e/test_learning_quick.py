"""``bench/learning.py --quick``: the learning study's pipeline end to end, in one process start.

GTPO, GRPO (the GTPO paper's recipe), Dr. GRPO, DAPO, GSPO and CISPO each train the tiny random model on the toy
reward for 6 steps through the real ``megatron-gtpo train`` (Megatron, vLLM, MLflow), one after the
other inside the bench's single process; the bench then reads every run back from MLflow, reports
one JSON line and renders the study plot through ``plotting.plot_runs``.

What fails it: a run that does not finish; an algorithm whose mean toy reward over its last 2 steps
is not more than 0.1 above its first 2 steps (a broken update shows a flat reward, e.g. a zero
gradient or a skipped optimizer step, or a falling one, e.g. a flipped advantage sign: each
algorithm starts at ~0.3 and a working one reaches ~0.6-0.7 by step 6); missing curves, GTPO's
conflict weights not acting, a loss that is not the D2 statistic, or a missing plot.
"""

from __future__ import annotations

import json
import sys

import pytest

from tests.helpers import REPO, child_env, run_group

pytestmark = pytest.mark.slow

ALGORITHMS = ["gtpo", "grpo", "drgrpo", "dapo", "gspo", "cispo"]


@pytest.fixture(scope="module")
def quick(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("learning") / "quick"
    proc = run_group([sys.executable, "-m", "bench.learning", "--quick", "--out", str(out)],
                     timeout=900, env=child_env(), cwd=REPO, warm=True)
    (out.parent / "quick.log").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, f"bench/learning.py --quick failed rc={proc.returncode}:\n" \
                                 f"{(proc.stdout + proc.stderr)[-6000:]}"
    line = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith('{"bench": "learning"')][-1])
    assert line["mode"] == "quick" and (out / "summary.json").is_file()
    return line


def test_every_algorithm_raises_the_toy_reward(quick):
    verdict = quick["quick_check"]
    assert verdict["passed"] and verdict["failed"] == [], verdict
    assert sorted(verdict["per_algorithm"]) == sorted(ALGORITHMS)
    for algo, row in verdict["per_algorithm"].items():
        assert row["reward_last"] - row["reward_first"] > verdict["margin"] >= 0.1, (algo, row)


def test_every_run_logged_every_step_and_its_diagnostics(quick):
    runs = {r["algo"]: r for r in quick["runs"]}
    assert sorted(runs) == sorted(ALGORITHMS)
    for algo, run in runs.items():
        assert run["status"] == "ok" and run["steps_logged"] == 6, run
        assert run["heldout_greedy"] and max(map(int, run["heldout_greedy"])) == 6, run  # the trainer's eval
        assert 0 < run["entropy_first"] < 5.0 and run["step_s_median"] > 0, run
        assert run["d2_loss_gap_max_abs"] is not None and run["d2_loss_gap_max_abs"] < 1e-4, run  # loss = D2 statistic
        assert "d1_wagg_common" in run and "filtered_frac" in run, run
    # GTPO's conflict weights act on the toy task (lambda = 2 on shared tokens of positives), and
    # only GTPO's: the baselines weight every token alike.
    assert runs["gtpo"]["lambda_ge2_share"] > 0, runs["gtpo"]
    assert all(runs[a].get("lambda_ge2_share", 0) == 0 for a in ALGORITHMS if a != "gtpo")
    for algo, agg in quick["algorithms"].items():
        assert agg["seeds"] == [0] and agg["reward_last"]["mean"] == runs[algo]["reward_last"], algo


def test_study_plot_is_rendered(quick):
    (curves,) = quick["figures"]
    data = open(curves, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000, curves
