"""The world-size rule (``ParallelConfig.world_size_problem``: the launched ranks must equal the product
of the parallel sizes), checked before anything loads: in ``megatron-gtpo train --world-size`` (the
prepare step of slurm/train.sbatch) and on every rank (``megatron_gtpo.cli.worker``)."""

from __future__ import annotations

import pytest

from megatron_gtpo.parallel.dims import ParallelConfig
from tests.helpers import REPO

RECIPE_3B = str(REPO / "configs" / "gpu" / "gtpo_qwen2.5-3b_1x8.yaml")


def test_world_must_equal_tp_x_pp_x_dp():
    par = ParallelConfig(tp=2, pp=2, dp=2)
    assert par.sizes() == {"tp": 2, "cp": 1, "pp": 2, "dp": 2} and par.world_size == 8
    assert par.world_size_problem(8, launcher="x") is None
    assert par.world_size_problem(16, launcher="sbatch") == (
        "sbatch starts 16 rank(s), but parallel.tp=2 x parallel.cp=1 x parallel.pp=2 x parallel.dp=2 = 8: "
        "set parallel.dp=4, or launch 8 rank(s)")
    assert "launch 8 rank(s) (a multiple of 4 for this model split)" in par.world_size_problem(6, launcher="x")


def test_prepare_step_refuses_the_wrong_world_before_anything_loads(monkeypatch, tmp_path, capsys):
    """The 3B recipe (TP=1 x DP=8) submitted on 2 nodes x 8 GPUs: refused by the prepare step, before
    the preflight (model, tokenizer, data) runs, naming the fix."""
    import megatron_gtpo.plan.preflight as preflight
    from megatron_gtpo.cli import train

    monkeypatch.setattr(preflight, "preflight", lambda cfg: pytest.fail("preflight ran before the world check"))
    code = train.main([RECIPE_3B, "--world-size", "16", "--output-dir", str(tmp_path / "run"), "--prepare-only"])
    err = capsys.readouterr().err
    assert code == 2 and "the launcher (--world-size 16) starts 16 rank(s), but parallel.tp=1 x parallel.cp=1 x " \
                          "parallel.pp=1 x parallel.dp=8 = 8: set parallel.dp=16, or launch 8 rank(s)" in err, err
    assert not (tmp_path / "run").exists()


def test_every_rank_refuses_the_wrong_world(monkeypatch, tmp_path, capsys):
    import megatron_gtpo.cli.worker as worker
    from megatron_gtpo.config import dump_resolved, load_config

    config = dump_resolved(load_config(RECIPE_3B), tmp_path / "config.yaml")
    monkeypatch.setattr(worker, "run", lambda cfg, resume: pytest.fail("the driver started"))
    monkeypatch.setenv("WORLD_SIZE", "16")
    assert worker.main([str(config)]) == 2
    assert "torchrun (WORLD_SIZE) starts 16 rank(s)" in capsys.readouterr().err
