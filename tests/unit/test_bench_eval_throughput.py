"""bench/eval_throughput.py's summary line without an engine: the ratio is the median over repeats of
eval tok/s over generate tok/s measured in the same repeat (not a ratio of medians)."""

from __future__ import annotations

import pytest

from bench.eval_throughput import row, summarize
from megatron_gtpo.eval.config import EvalConfig


def test_summary_ratio_is_the_median_of_per_repeat_ratios():
    rates = [(100.0, 90.0), (50.0, 48.0), (80.0, 40.0)]  # (generate, eval) tok/s per repeat
    rows = []
    for repeat, (gen, ev) in enumerate(rates):
        for name, rate in (("generate", gen), ("eval", ev)):
            r = row(name, tokens=int(rate * 10), wall=10.0, cpu=5.0)
            rows.append({**r, "repeat": repeat})
    config = EvalConfig(model="smollm2", n=4, k=[1, 2], max_tokens=64)
    out = summarize(rows, config, num_prompts=16, engine_info={"engine_dtype": "float32"})
    assert out["ratio_vs_generate"] == pytest.approx(0.9)  # median of 0.9, 0.96, 0.5
    assert (out["ratio_min"], out["ratio_max"]) == (0.5, 0.96)
    assert out["generate_tok_per_s"] == 80.0 and out["eval_tok_per_s"] == 48.0  # medians of each variant
    assert out["eval_tok_per_cpu_s"] == 96.0 and out["repeats"] == 3 and out["engine_dtype"] == "float32"
