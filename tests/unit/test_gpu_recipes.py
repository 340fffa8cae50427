"""Every GPU recipe (configs/gpu/*.yaml) passes the dry-run line written in its header: the
layout is valid and the memory plan fits on the cluster the recipe is written for. Nothing here
runs on a GPU; the recipes themselves are untested on GPUs (said in each header)."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from megatron_gtpo.cli import dry_run
from tests.helpers import REPO

RECIPES = sorted((REPO / "configs" / "gpu").glob("*.yaml"))


def _dry_run_line(recipe) -> list[str]:
    lines = [line for line in recipe.read_text().splitlines() if "megatron-gtpo dry-run configs/gpu/" in line]
    assert len(lines) == 1, f"{recipe.name}: its header must give exactly one dry-run command"
    argv = shlex.split(lines[0].lstrip("# ").removeprefix("megatron-gtpo dry-run"))
    assert argv[0] == f"configs/gpu/{recipe.name}", f"{recipe.name}: the dry-run line names another recipe"
    return [str(REPO / argv[0]), *[str(REPO / a) if a.startswith("configs/") else a for a in argv[1:]]]


STARTERS = {
    "gtpo_qwen2.5-math-1.5b_1x1": ("Qwen/Qwen2.5-Math-1.5B", "1.54 B parameters"),
    "gtpo_qwen2.5-math-7b_1x8": ("Qwen/Qwen2.5-Math-7B", "7.62 B parameters"),
    "gtpo_qwen3-1.7b_1x8": ("Qwen/Qwen3-1.7B", "1.72 B parameters"),
    "gtpo_qwen3-8b_1x8": ("Qwen/Qwen3-8B", "8.19 B parameters"),
    "gtpo_llama3.2-3b_1x8": ("meta-llama/Llama-3.2-3B-Instruct", "3.21 B parameters"),
}
"""The models people start RL from (issue 36): recipe -> (hub id, parameter count of the model card)."""


def test_there_are_gpu_recipes():
    assert len(RECIPES) >= 3
    assert any("--gpus-per-node 1 " in r.read_text() and "--nodes 1 " in r.read_text() for r in RECIPES), \
        "a one-GPU recipe"


@pytest.mark.parametrize("stem", STARTERS)
def test_starter_recipe_dry_runs_from_its_hub_id_in_the_cache(stem, tmp_path, monkeypatch, capsys):
    """Each starter recipe names its model by hub id and its dry-run line passes with no --hf-config,
    config.json coming from an offline hub cache under that id (the stand-in of configs/models/), and the
    size the dry-run derives matches the model card: a mistyped stand-in number (layers, widths,
    tie_word_embeddings) changes it. Injected bugs: Qwen3-1.7B's tie_word_embeddings false (2.03 B
    parameters) fails; model.path of the 7B recipe as a local directory (/path/to/Qwen2.5-Math-7B) fails."""
    from tests.hub_cache import add_to_hub_cache, offline_hub

    hub_id, size = STARTERS[stem]
    recipe = REPO / "configs" / "gpu" / f"{stem}.yaml"
    assert f"  path: {hub_id} " in recipe.read_text(), f"{stem}: model.path must be the hub id {hub_id}"
    argv = _dry_run_line(recipe)
    stand_in = argv[argv.index("--hf-config") + 1]
    add_to_hub_cache(offline_hub(tmp_path / "hf", monkeypatch), hub_id, {"config.json": Path(stand_in)})
    monkeypatch.chdir(REPO)
    status = dry_run.main([a for a in argv if a not in ("--hf-config", stand_in)])
    out = capsys.readouterr()
    assert status == 0, out.out + out.err
    assert size in out.out, out.out


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_gpu_recipe_passes_its_dry_run(recipe, capsys):
    status = dry_run.main(_dry_run_line(recipe))
    out = capsys.readouterr()
    assert status == 0, out.out + out.err
    assert "OK       launch:" in out.out and "bfloat16" in recipe.read_text()


def test_pool_recipe_stages_one_copy_of_the_model_per_rollout_node(capsys):
    """The 32B pool recipe's dry-run prints the host memory a rollout node stages a push in: one copy
    of the push per server (node), however many engine workers share it (TP=8 here), not one per worker."""
    import re

    from megatron_gtpo.models.shape import load_model_shape
    from megatron_gtpo.plan.memory import GIB

    recipe = REPO / "configs" / "gpu" / "gtpo_qwen2.5-32b_4x8_pool.yaml"
    assert dry_run.main(_dry_run_line(recipe)) == 0
    out = capsys.readouterr().out
    [host] = [line for line in out.splitlines() if line.startswith("host ")]
    staged = float(re.match(r"host\s+([\d.]+) GiB staged per rollout node per push", host).group(1))
    push = float(re.search(r"push\s+([\d.]+) GiB per step to each of 2 rollout server", out).group(1))
    one_copy = load_model_shape(REPO / "configs" / "models" / "qwen2.5-32b.json").params_total() * 2 / GIB
    assert staged == push == round(one_copy, 1) == 61.0, host
    assert "each of its engine's 8 worker(s) takes only its own shards" in host


def test_host_staging_does_not_grow_with_the_engine_tp():
    from megatron_gtpo.models.shape import load_model_shape
    from megatron_gtpo.plan.layout import LayoutRequest, plan_layout
    from megatron_gtpo.plan.memory import MemorySizes, estimate_memory, push_bytes

    shape, sizes = load_model_shape(REPO / "configs" / "models" / "qwen2.5-32b.json"), MemorySizes()
    staged = {}
    for placement, rollout_tp in (("separate", 8), ("separate", 4), ("colocated", 4)):
        request = LayoutRequest(shape=shape, nodes=6 if placement == "separate" else 4, gpus_per_node=8, tp=8, pp=2,
                                placement=placement,
                                rollout_tp=rollout_tp, engines=2 if placement == "separate" else None,
                                prompts_per_step=32)
        staged[placement, rollout_tp] = estimate_memory(shape, plan_layout(request), sizes).host_staging
    assert staged["separate", 8] == staged["separate", 4] == push_bytes(shape, sizes)
    assert staged["colocated", 4] == 0  # colocated pushes stream into vLLM's reload: nothing staged on the host
