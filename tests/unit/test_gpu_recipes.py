"""Every GPU recipe (configs/gpu/*.yaml) passes the dry-run line written in its header: the
layout is valid and the memory plan fits on the cluster the recipe is written for. Nothing here
runs on a GPU; the recipes themselves are untested on GPUs (said in each header)."""

from __future__ import annotations

import shlex

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


def test_there_are_gpu_recipes():
    assert len(RECIPES) >= 3


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_gpu_recipe_passes_its_dry_run(recipe, capsys):
    status = dry_run.main(_dry_run_line(recipe))
    out = capsys.readouterr()
    assert status == 0, out.out + out.err
    assert "OK       launch:" in out.out and "bfloat16" in recipe.read_text()
