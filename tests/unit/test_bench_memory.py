"""bench/memory.py: the JSON summary of a rank, the phase meter, and the run it configures."""

from __future__ import annotations

import pytest

from bench import memory as bench
from bench.memory_meter import Meter, summarise
from tests.helpers import leave_freed_resident_heap, resident_block

MIB = 1 << 20


def call(phase, peak, accounted=None, **extra):
    out = {"phase": phase, "peak": peak * MIB, "after": peak * MIB, **extra}
    return out if accounted is None else {**out, "accounted": accounted * MIB}


def test_summary_compares_the_run_peak_with_the_largest_accounted_call():
    calls = [call("startup", 400), call("build", 3000), call("rollout", 3500, 3000), call("train", 5400, 4500, seq=200),
             call("push", 3600, 3200), call("other", 3400), call("rollout", 3400, 3000),
             call("train", 6000, 5000, seq=300), call("push", 3500, 3200)]
    terms = {"baseline": 400 * MIB, "weights": 500 * MIB, "activations": 1500 * MIB}
    row = summarise(calls=calls, terms=terms, rank=1, extra={"world": 2})
    assert row["rank"] == 1 and row["world"] == 2
    assert (row["peak"], row["accounted"], row["peak_phase"]) == (6000 * MIB, 5000 * MIB, "train")
    assert row["peak_over_accounted"] == 1.2
    assert row["terms"] == terms
    # Per phase: the largest peak, the largest total, the largest ratio of one call to its own total.
    assert row["phases"]["train"] == {"peak": 6000 * MIB, "accounted": 5000 * MIB, "over": 1.2}
    assert row["phases"]["rollout"] == {"peak": 3500 * MIB, "accounted": 3000 * MIB, "over": 1.167}
    assert row["phases"]["push"]["over"] == 1.125
    assert row["phases"]["build"] == {"peak": 3000 * MIB}  # no plan total of its own


def test_a_step_with_longer_sequences_is_judged_by_its_own_total():
    calls = [call("train", 5000, 4000, seq=200), call("train", 5500, 5400, seq=320)]
    row = summarise(calls=calls, terms={}, rank=0)
    assert row["phases"]["train"]["over"] == 1.25  # the first step, against its own smaller total
    assert row["peak_over_accounted"] == round(5500 / 5400, 3)


def test_peak_over_accounted_uses_the_run_peak_even_outside_the_planned_phases():
    row = summarise(calls=[call("build", 900), call("train", 500, 600), call("rollout", 300, 300)], terms={}, rank=0)
    assert (row["peak_over_accounted"], row["peak_phase"]) == (1.5, "build")


def test_meter_gives_each_phase_its_own_peak_and_the_run_its_largest():
    pin = leave_freed_resident_heap(200)  # the state CI's shard was in: the test must not depend on it
    meter = Meter()
    with meter.phase("big"):
        block = resident_block(128 * MIB)
        block.close()
    with meter.phase("small"):
        resident_block(MIB).close()
    meter.switch("end")
    start = meter.calls[0]["after"]
    assert meter.peaks["big"] - start >= 120 * MIB
    assert meter.peaks["small"] < meter.peaks["big"] - 100 * MIB
    assert [c["phase"] for c in meter.calls] == ["startup", "big", "startup", "small", "startup"]
    assert max(meter.peaks.values()) == meter.peaks["big"]
    del pin


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


def test_a_rank_is_told_it_is_a_worker_even_after_overrides():
    """The ranks' command line: ``--worker`` must survive a ``--`` of recipe overrides (after which
    argparse takes every word as an override), or each rank would start the bench again."""
    argv = ["--steps", "1", "--", "train.micro_batch_tokens=0"]
    args = bench.build_parser().parse_args(bench.worker_args(argv, "/rows", "/run"))
    assert (args.worker, args.out, args.steps) == ("/rows", "/run", 1)
    assert args.overrides == ["train.micro_batch_tokens=0"]


def test_train_calls_record_the_longest_row_and_packed_micro_batch():
    """``instrument`` meters each learner step with its batch's longest row and (packing) the
    longest packed micro-batch this rank builds: what the plan is asked with for that call."""
    from types import SimpleNamespace

    from bench.memory_meter import instrument
    from tests.unit.test_train_batching import ROWS, batch_of

    def parts(budget):
        settings = SimpleNamespace(micro_batch_tokens=budget, micro_batch_size=4, pad_to_multiple=1, moe=False)
        dims = SimpleNamespace(dp=1, dp_rank=0, cp=1, cp_rank=0, pp=1, vpp=None)
        learner = SimpleNamespace(step=lambda batch: {}, settings=settings, dims=dims)
        return SimpleNamespace(collector=SimpleNamespace(collect=lambda: None), learner=learner,
                               checkpointer=SimpleNamespace(after_step=lambda: None))

    batch = batch_of(ROWS * 2, pad=99)  # rows of 5, 5, 1, 7 tokens, twice (36 tokens)
    # budget 13: three bins of 7+5, 7+5, 5+5+1+1 tokens (train/batching.py pack_rows), the longest 12, not
    # the budget; 0: padded
    for budget, packed in ((13, 12), (0, 0)):
        meter = Meter()
        instrument(meter, parts(budget)).learner.step(batch)
        (train,) = [c for c in meter.calls if c["phase"] == "train"]
        assert (train["seq"], train["packed"]) == (7, packed)
