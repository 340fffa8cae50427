"""Recipes, dotted overrides and validation of the whole RunConfig."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from megatron_gtpo.config import RunConfig, dump_resolved, load_config
from megatron_gtpo.utils.configuration import ConfigError, apply_overrides, describe, field_docs
from tests.helpers import REPO

RECIPES = ["gtpo", "grpo", "drgrpo", "dapo", "gspo", "cispo", "tiny", "demo", "grpo_gtpo_paper"]


@pytest.mark.parametrize("name", RECIPES)
def test_every_recipe_loads(name):
    # The demo writes its arithmetic prompts at run time and adds them to data.paths.
    overrides = ["data.paths=[arithmetic.jsonl]"] if name == "demo" else []
    cfg = load_config(REPO / "configs" / f"{name}.yaml", overrides)
    assert isinstance(cfg, RunConfig)


def spec_of_recipe(name: str, overrides=()):
    cfg = load_config(REPO / "configs" / f"{name}.yaml", list(overrides))
    return cfg.algorithm


def test_recipes_carry_the_spec_defaults():
    gtpo = spec_of_recipe("gtpo")
    # the paper's regime: the authors' filter rule (decided at step 1), gamma 0.005 x the 10+10 reward's range 20
    assert (gtpo.conflict_weight, gtpo.entropy_threshold, gtpo.entropy_gamma, gtpo.kl_beta, gtpo.mu) == (2.0, None, 0.1, 0.0, 1)
    assert spec_of_recipe("gtpo", ["reward.fn=correctness"]).entropy_gamma == pytest.approx(0.005)
    assert gtpo.adv_std_scale is False and gtpo.conflict_overlap == "product"
    grpo = spec_of_recipe("grpo")
    assert (grpo.adv_std_scale, grpo.kl_beta, grpo.agg_mode) == (True, 0.04, "seq-mean-token-mean")
    dapo = spec_of_recipe("dapo")
    assert (dapo.clip_eps_low, dapo.clip_eps_high, dapo.agg_mode, dapo.dynamic_sampling) == (0.2, 0.28, "token-mean", True)
    drgrpo = spec_of_recipe("drgrpo")
    assert (drgrpo.adv_std_scale, drgrpo.agg_mode, drgrpo.constant) == (False, "seq-mean-token-sum-norm", 1500.0)
    # the code-exact GTPO choices (spec 5.5, 5.8); tiny.yaml keeps the averaged prompts of its stored values
    assert (gtpo.gtpo_prompt_reduction, gtpo.entropy_logits, gtpo.mismatch_correction) == ("sum", "raw", "none")
    assert spec_of_recipe("tiny").gtpo_prompt_reduction == "mean"
    gspo, cispo = spec_of_recipe("gspo"), spec_of_recipe("cispo")    # spec 13, 14
    assert (gspo.surrogate, gspo.clip_eps_low, gspo.clip_eps_high, gspo.agg_mode, gspo.kl_beta, gspo.mu) == (
        "gspo", 3e-4, 4e-4, "seq-mean-token-mean", 0.0, 4)
    assert (cispo.surrogate, cispo.clip_eps_low, cispo.clip_eps_high, cispo.agg_mode, cispo.adv_std_scale) == (
        "cispo", 1.0, 0.28, "token-mean", True)


def test_gtpo_paper_grpo_recipe():
    """configs/grpo_gtpo_paper.yaml: the GRPO baseline of the GTPO paper (spec 2, 5.10), not DeepSeekMath's."""
    cfg = load_config(REPO / "configs" / "grpo_gtpo_paper.yaml")
    spec = cfg.algorithm
    assert (spec.name, spec.adv_std_scale, spec.adv_eps, spec.agg_mode, spec.mu) == ("grpo", True, 1e-4,
                                                                                 "seq-mean-token-mean", 1)
    assert spec.kl_beta in (0.0, 1e-6) and not spec.needs_reference
    assert (cfg.rollout.n, cfg.rollout.max_tokens, cfg.rollout.temperature) == (8, 1500, 0.9)
    assert cfg.train.prompts_per_step == 1
    opt = cfg.optim.optimizer
    assert (opt["lr"], opt["clip_grad"], opt["weight_decay"]) == (1e-6, 0.1, 0.1)
    assert cfg.optim.scheduler["lr_decay_style"] == "cosine"
    assert load_config(REPO / "configs" / "grpo_gtpo_paper.yaml", ["algo.kl_beta=1e-6"]).algo.kl_beta == 1e-6


def test_overrides_are_typed_and_nested():
    cfg = load_config(REPO / "configs" / "gtpo.yaml",
                      ["algo.entropy_threshold=0.69", "rollout.n=12", "train.micro_batch_size=4", "optim.optimizer.lr=1e-6",
                       "data.benchmarks=[gsm8k]"])
    assert cfg.algo.entropy_threshold == 0.69 and cfg.rollout.n == 12
    assert cfg.optim.optimizer["lr"] == 1e-6 and cfg.data.benchmarks == ["gsm8k"]
    assert apply_overrides({"a": {"b": 1}}, ["a.c=x", "d=null"]) == {"a": {"b": 1, "c": "x"}, "d": None}


@pytest.mark.parametrize("override, fragment", [
    ("algo.entropy_treshold=0.7", "unknown key algo.entropy_treshold"),
    ("algo.entropy_threshold=abc", "algo.entropy_threshold='abc' is not allowed: expected float or one of 'auto'"),
    ("algo.entropy_threshold=-1", "algo.entropy_threshold=-1.0 is not allowed"),
    ("algo.name=ppo", "algo.name='ppo' is not allowed: expected one of"),
    ("rollout.n=1", "rollout.n=1 is not allowed"),
    (("train.micro_batch_tokens=0", "train.micro_batch_size=3"),
     "is not divisible by parallel.dp x train.micro_batch_size = 1 x 3"),
    ("train.micro_batch_tokens=64", "train.micro_batch_tokens=64 cannot hold the longest possible row"),
    ("parallel.tp=0", "parallel.tp=0 is not allowed"),
    ("model.make_vocab_size_divisible_by=0", "model.make_vocab_size_divisible_by=0 is not allowed"),
    ("optim.optimizer.adam_betas=0.9", "adam_betas"),
    ("algo.mu=2.5", "algo.mu: expected int, got float 2.5"),
    ("noequals", "must look like key.path=value"),
])
def test_bad_values_name_the_key(override, fragment):
    with pytest.raises(ConfigError) as err:
        load_config(REPO / "configs" / "gtpo.yaml", [override] if isinstance(override, str) else list(override))
    assert fragment in str(err.value), str(err.value)


def test_missing_recipe_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("algo: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_base_inheritance_and_resolved_dump(tmp_path):
    child = tmp_path / "child.yaml"
    child.write_text(f"base: {REPO / 'configs' / 'gtpo.yaml'}\nrollout:\n  n: 6\ntrain:\n  micro_batch_size: 2\n")
    cfg = load_config(child, [f"output_dir={tmp_path / 'run'}"])
    assert cfg.rollout.n == 6 and cfg.algo.name == "gtpo" and cfg.reward.fn == "gtpo"
    path = dump_resolved(cfg)
    data = yaml.safe_load(path.read_text())
    assert data["rollout"]["n"] == 6 and data["algo"]["entropy_threshold"] == "auto"
    assert load_config(path).rollout.n == 6  # the resolved file is itself a valid recipe
    assert not list(path.parent.glob(".*.tmp"))


def test_every_field_is_documented():
    rows = describe(RunConfig)
    missing = [key for key, _, _, doc in rows if not doc]
    assert not missing, f"fields without a docstring: {missing}"
    assert field_docs(RunConfig)["algo"]


@pytest.mark.parametrize("sub", ["", "train", "eval", "convert", "dry-run", "config", "demo"])
def test_every_cli_has_help(sub):
    args = [sys.executable, "-m", "megatron_gtpo.cli", *([sub] if sub else []), "--help"]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage" in proc.stdout.lower()


def test_train_rejects_bad_config_before_starting(tmp_path):
    args = [sys.executable, "-m", "megatron_gtpo.cli", "train", str(REPO / "configs" / "tiny.yaml"),
            "--output-dir", str(tmp_path / "run"), "algo.entropy_treshold=1"]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 2 and "unknown key algo.entropy_treshold" in proc.stderr
    assert not (tmp_path / "run").exists(), "a rejected config must not create the run directory"


@pytest.mark.parametrize("override, fragment", [
    ("algo.nam=grpo", "unknown key algo.nam (did you mean algo.name?); every key: `megatron-gtpo config algo`"),
    ("trian.steps=3", "unknown key trian (did you mean train"),
    ("algo.name=grpoo", "algo.name='grpoo' is not allowed (did you mean 'grpo'"),
    ("algo.agg_mode=token_mean", "(did you mean 'token-mean'"),
    ("model.moe_routing_replay=rolout", "(did you mean 'rollout'?)"),
    ("optim.optimizer.lrr=1e-6", "unknown key optim.optimizer.lrr (did you mean optim.optimizer.lr?)"),
    ("optim.ddp.bucketsize=10", "unknown key optim.ddp.bucketsize (did you mean optim.ddp.bucket_size?)"),
])
def test_misspelt_keys_and_values_suggest_the_fix(override, fragment):
    """A misspelt key listed all 25 keys of its section, a misspelt optimizer key read "optim.unknown
    key(s) optimizer.lrr" (build() prefixed its path to a message that already had one). Injected bugs:
    `did_you_mean` returning '' -> no suggestion, fails; `located=True` dropped in train/optim.py ->
    the message starts "optim.unknown", fails the exact start check."""
    with pytest.raises(ConfigError) as err:
        load_config(REPO / "configs" / "gtpo.yaml", [override])
    assert fragment in str(err.value), str(err.value)
    assert str(err.value).startswith(("unknown key", override.split("=")[0])), str(err.value)


def test_unknown_key_without_a_close_match_lists_the_allowed_keys():
    with pytest.raises(ConfigError) as err:
        load_config(REPO / "configs" / "gtpo.yaml", ["algo.zzz=1"])
    assert "did you mean" not in str(err.value) and "allowed keys under algo: adv_eps, " in str(err.value)


def test_config_shows_the_allowed_values_of_a_choice():
    """`megatron-gtpo config` printed `algo.name (Literal, ...)`. Injected bug: `type_name` without
    its Literal branch -> "Literal", fails."""
    types_ = {key: type_name for key, type_name, _, _ in describe(RunConfig)}
    assert types_["algo.name"] == "one of 'gtpo', 'grpo', 'drgrpo', 'dapo', 'gspo', 'cispo'"
    assert types_["algo.conflict_overlap"] == "one of 'product', 'union'"
    assert types_["algo.agg_mode"].endswith("'seq-mean-token-sum-norm' | None")
    assert types_["train.steps"] == "int" and types_["algo.kl_beta"] == "float | None"
