"""``megatron-gtpo probe reward-scale``: argument and variant validation before anything starts, the
report summary, and the probe plot (the probe itself: tests/e2e/test_probe_reward_scale.py)."""

from __future__ import annotations

import json

import pytest

from megatron_gtpo.cli import probe as probe_cli
from megatron_gtpo.config import load_config
from megatron_gtpo.probe import ProbePlan, summarise, variant_config
from tests.helpers import REPO

TINY = str(REPO / "configs" / "tiny.yaml")


def test_plan_from_arguments():
    args = probe_cli.parse_args(["reward-scale", TINY, "optim.optimizer.clip_grad=0", "--phi", "0.1,1,10", "--steps",
                                 "3", "--output-dir", "/tmp/x", "--variant", "g0", "algo.entropy_gamma=0",
                                 "--variant", "eps", "algo.entropy_gamma=0", "optim.optimizer.adam_eps=1e-3"])
    plan = probe_cli.plan_of(args)
    assert plan == ProbePlan(phis=(0.1, 1.0, 10.0), steps=3, variants=(
        ("g0", ("algo.entropy_gamma=0",)), ("eps", ("algo.entropy_gamma=0", "optim.optimizer.adam_eps=1e-3"))))
    assert args.overrides == ["optim.optimizer.clip_grad=0"] and plan.reference_phi == 1.0
    default = probe_cli.plan_of(probe_cli.parse_args(["reward-scale", TINY, "--output-dir", "/tmp/x", "--phi", "2,5"]))
    assert default.variants == (("base", ()),) and default.reference_phi == 2.0


@pytest.mark.parametrize("argv, match", [
    (["--phi", "0.1,x"], "--phi"),
    (["--phi", "1,-1"], "> 0"),
    (["--phi", "1,1"], "distinct"),
    (["--steps", "0"], "--steps"),
    (["--variant", "a", "algo.mu=1", "--variant", "a"], "distinct names"),
])
def test_bad_plans_name_the_flag(argv, match):
    with pytest.raises(ValueError, match=match):
        probe_cli.plan_of(probe_cli.parse_args(["reward-scale", TINY, "--output-dir", "/tmp/x", *argv]))


def test_variants_may_change_only_algo_and_optim():
    cfg = load_config(TINY)
    assert variant_config(cfg, ["algo.entropy_gamma=0.5"]).algo.entropy_gamma == 0.5
    with pytest.raises(ValueError, match="only algo.. and optim.. keys"):
        variant_config(cfg, ["rollout.n=8"])


def test_cli_rejects_a_bad_variant_before_starting(tmp_path, capsys):
    rc = probe_cli.main(["reward-scale", TINY, "--output-dir", str(tmp_path), "--variant", "x", "model.dtype=bfloat16"])
    assert rc == 2 and "only algo.* and optim.*" in capsys.readouterr().err
    assert not (tmp_path / "probe_plan.json").exists()


def test_summary_and_plot(tmp_path):
    runs = [{"variant": v, "phi": phi, "reward_mean": [0.3, 0.2], "cosine_vs_reference": cos, "delta_norm_ratio": ratio,
             "small_v_frac": 0.1} for v, phi, cos, ratio in (("a", 1.0, 1.0, 1.0), ("a", 10.0, 0.5, 1.2),
                                                            ("b", 1.0, 1.0, 1.0), ("b", 0.1, 0.999, 0.99))]
    assert summarise(runs) == [{"variant": "a", "min_cosine": 0.5, "max_norm_ratio_deviation": pytest.approx(0.2)},
                               {"variant": "b", "min_cosine": 0.999, "max_norm_ratio_deviation": pytest.approx(0.01)}]
    from megatron_gtpo.plotting import plot_probe

    png = plot_probe({"runs": runs, "reference_phi": 1.0}, tmp_path / "probe.png")
    assert png.stat().st_size > 10_000
    json.dumps(runs)
