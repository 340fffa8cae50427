"""bench/memory.py: the JSON summary of a rank, the phase meter, and the run it configures."""

from __future__ import annotations

import pytest

from bench import memory as bench
from bench.memory_meter import Meter, summarise

MIB = 1 << 20


def test_summary_compares_the_run_peak_with_the_largest_accounted_phase():
    peaks = {"startup": 400 * MIB, "build": 3000 * MIB, "rollout": 3500 * MIB, "train": 6000 * MIB,
             "push": 3600 * MIB, "other": 3400 * MIB}
    terms = {"baseline": 400 * MIB, "weights": 500 * MIB, "activations": 1500 * MIB}
    accounted = {"rollout": 3000 * MIB, "train": 5000 * MIB, "push": 3200 * MIB}
    row = summarise(peaks=peaks, terms=terms, accounted=accounted, rank=1, extra={"world": 2})
    assert row["rank"] == 1 and row["world"] == 2
    assert (row["peak"], row["accounted"], row["peak_phase"]) == (6000 * MIB, 5000 * MIB, "train")
    assert row["peak_over_accounted"] == 1.2
    assert row["terms"] == terms
    assert row["phases"]["rollout"] == {"peak": 3500 * MIB, "accounted": 3000 * MIB, "over": 1.167}
    assert row["phases"]["push"]["over"] == 1.125
    assert row["phases"]["build"] == {"peak": 3000 * MIB}  # no plan total of its own


def test_peak_over_accounted_uses_the_run_peak_even_outside_the_planned_phases():
    row = summarise(peaks={"build": 900, "train": 500}, terms={}, accounted={"train": 600, "rollout": 300}, rank=0)
    assert (row["peak_over_accounted"], row["peak_phase"]) == (1.5, "build")


def test_meter_gives_each_phase_its_own_peak_and_the_run_its_largest():
    import torch

    meter = Meter()
    with meter.phase("big"):
        block = torch.ones(128 * MIB // 4)  # touched: resident
        del block
    with meter.phase("small"):
        torch.ones(MIB // 4)
    meter.switch("end")
    assert meter.peaks["big"] - meter.after["startup"] >= 120 * MIB
    assert meter.peaks["small"] < meter.peaks["big"] - 100 * MIB
    assert [name for name, _, _ in meter.calls] == ["startup", "big", "startup", "small", "startup"]


def test_bench_configures_the_issue_run_and_quick_mode(tmp_path):
    from megatron_gtpo.config import load_config

    args = bench.build_parser().parse_args([])
    recipe, overrides = bench.recipe_and_overrides(args, str(tmp_path))
    cfg = load_config(recipe, overrides)
    assert (cfg.algo.name, cfg.model.path, cfg.model.dtype) == ("grpo", "smollm2", "float32")
    assert (cfg.train.prompts_per_step, cfg.rollout.n, cfg.rollout.max_tokens) == (8, 8, 128)
    assert cfg.rollout.vllm["kv_cache_memory_bytes"] == 1 << 30 and cfg.parallel.world_size == 1
    quick = bench.build_parser().parse_args(["--quick", "--ranks", "2", "--", "train.seed=7"])
    recipe, overrides = bench.recipe_and_overrides(quick, str(tmp_path))
    cfg = load_config(recipe, overrides)
    assert (cfg.model.path, cfg.parallel.dp, cfg.parallel.tp, cfg.train.seed) == ("tiny-char", 2, 1, 7)


def test_help_names_the_sizes(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--help"])
    out = capsys.readouterr().out
    for flag in ("--quick", "--prompts", "--kv-gib", "--ranks", "--micro-batch-size", "peak_over_accounted"):
        assert flag in out
