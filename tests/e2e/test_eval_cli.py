"""``megatron-gtpo eval`` end to end on a tiny random model: real vLLM engine (RolloutEngine), real
benchmark files, spawned scoring workers, JSON report, samples file and MLflow metrics.

The model is random, so its scores carry no meaning; this test checks the plumbing: every problem
is accounted for, the report agrees with the samples file and with MLflow, and the workers'
verdicts agree with ``is_correct`` run in this process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import REPO, run_group

pytestmark = pytest.mark.slow


def run_eval(tmp_path, *args: str, timeout: float = 540) -> subprocess.CompletedProcess:
    # The benchmarks shipped in this checkout (no MEGATRON_GTPO_DATA override).
    env = {**{k: v for k, v in os.environ.items() if k != "MEGATRON_GTPO_DATA"}, "PYTHONPATH": str(REPO)}
    # cwd = tmp_path: MLflow's sqlite store puts artifacts under ./mlruns of the working directory
    proc = run_group([sys.executable, "-m", "megatron_gtpo.cli.eval", *args], timeout=timeout, env=env, cwd=tmp_path,
                     warm=True)
    (tmp_path / "eval.log").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, f"eval failed rc={proc.returncode}:\n{(proc.stdout + proc.stderr)[-6000:]}"
    return proc


def test_eval_cli_tiny_model_report_samples_and_mlflow(tmp_path):
    from mlflow.tracking import MlflowClient

    from megatron_gtpo.reward import is_correct

    report_path = tmp_path / "report.json"
    tracking = f"sqlite:///{tmp_path / 'mlflow.db'}"
    proc = run_eval(tmp_path, "--model", "tiny", "--benchmarks", "gsm8k,mmlu", "--limit", "3", "--n", "2",
                    "--k", "1,2", "--max-tokens", "16", "--workers", "2",
                    "--save-samples", "--output", str(report_path), "--mlflow-tracking-uri", tracking,
                    "--mlflow-experiment", "eval-e2e", "--mlflow-step", "7",
                    "--vllm", "dtype=float32", "--vllm", "kv_cache_memory_bytes=67108864")
    assert "pass@1" in proc.stdout and "mmlu_stem" in proc.stdout  # the printed table
    # the tiny model's 512-token context caps prompts at 512 - 16 instead of failing inside vLLM
    assert "prompts limited to 496 tokens" in proc.stderr
    report = json.loads(report_path.read_text())
    assert list(report["benchmarks"]) == ["gsm8k", "mmlu_stem"]
    samples = [json.loads(line) for line in report_path.with_suffix(".samples.jsonl").read_text().splitlines()]
    for name, bench in report["benchmarks"].items():
        assert bench["num_problems"] + bench["num_too_long"] == 3 and bench["n"] == 2
        mine = [s for s in samples if s["benchmark"] == name]
        assert len(mine) == 2 * bench["num_problems"]
        assert bench["metrics"]["mean@2"] == pytest.approx(sum(s["correct"] for s in mine) / max(1, len(mine)))
        assert bench["mean_completion_tokens"] == pytest.approx(sum(s["num_tokens"] for s in mine) / len(mine))
    task = {"gsm8k": "gsm8k", "mmlu_stem": "mmlu"}
    for s in samples:  # the spawned workers agree with the in-process checker
        assert s["status"] == "ok" and s["correct"] == is_correct(s["text"], s["gold"], task[s["benchmark"]])
    client = MlflowClient(tracking)
    (run,) = client.search_runs([client.get_experiment_by_name("eval-e2e").experiment_id])
    for name, bench in report["benchmarks"].items():
        for key, value in bench["metrics"].items():
            (metric,) = client.get_metric_history(run.info.run_id, f"eval/{name}/{key.replace('@', '_at_')}")
            assert metric.value == pytest.approx(value) and metric.step == 7
    assert [a.path for a in client.list_artifacts(run.info.run_id, "eval")] == ["eval/report.json"]
