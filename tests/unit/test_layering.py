"""The package's layering, read from its source with ``ast`` (nothing is imported).

* ``algo/`` is pure: no torch.distributed, no Megatron, no config objects of other packages;
* only parallel/, train/, sync/ and convert/ touch Megatron's parallel state;
* no import circles between the package's modules (function-level imports included);
* own-module imports sit at the top of files, except the few listed below with the reason;
* no function takes more than 8 parameters; files stay under 500 lines, functions under 60.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.helpers import REPO

PACKAGE = REPO / "megatron_gtpo"
FILES = sorted(PACKAGE.rglob("*.py"))

# Imports kept inside functions on purpose, with why.
LAZY_OWN_IMPORTS = {
    # Scoring workers import megatron_gtpo.reward in fresh processes: score.py needs torch
    # (through types.py), which a worker must not pay for.
    ("megatron_gtpo/reward/__init__.py", "megatron_gtpo.reward"),
    ("megatron_gtpo/reward/__init__.py", "megatron_gtpo.reward.score"),
    # `megatron-gtpo train` answers --help and refuses a bad --resume before torch loads (a second).
    ("megatron_gtpo/cli/train.py", "megatron_gtpo.config"),
    ("megatron_gtpo/cli/train.py", "megatron_gtpo.plan.preflight"),
    ("megatron_gtpo/cli/train.py", "megatron_gtpo.cli.worker"),
    # Every process a rank spawns (reward workers, Megatron's checkpoint-writer manager) re-imports
    # the rank's main module, megatron_gtpo.cli.worker: at its top it must not import torch.
    ("megatron_gtpo/cli/worker.py", "megatron_gtpo.config"),
    ("megatron_gtpo/cli/worker.py", "megatron_gtpo.reward"),
    ("megatron_gtpo/cli/worker.py", "megatron_gtpo.trainer"),
    ("megatron_gtpo/cli/worker.py", "megatron_gtpo.parallel.strict"),
}


def module_name(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(f): f for f in FILES}


def imports_of(path: Path) -> list[tuple[str, bool, int]]:
    """``(imported module, inside a function?, line)`` for every import in ``path``."""
    tree = ast.parse(path.read_text())
    inner = {id(n) for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
             for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom))}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, id(node) in inner, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.module, id(node) in inner, node.lineno))
            # ``from pkg import sub`` imports the submodule too
            out += [(f"{node.module}.{a.name}", id(node) in inner, node.lineno) for a in node.names
                    if f"{node.module}.{a.name}" in MODULES]
    return out


def rel(path: Path) -> str:
    return str(path.relative_to(REPO))


def test_algo_is_pure_tensor_code():
    bad = [(rel(f), mod) for f in FILES if f.is_relative_to(PACKAGE / "algo") for mod, _, _ in imports_of(f)
           if mod.startswith(("torch.distributed", "megatron.", "megatron_gtpo.parallel", "megatron_gtpo.train",
                              "megatron_gtpo.sync", "megatron_gtpo.rollout", "megatron_gtpo.config"))
           or mod == "megatron"]
    assert bad == []


def test_only_parallel_train_sync_convert_touch_megatron_parallel_state():
    allowed = ("parallel", "train", "sync", "convert")
    users = []
    for f in FILES:
        tree = ast.parse(f.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            if any(n.startswith("megatron.core.parallel_state") for n in names):
                users.append(rel(f))
    outside = sorted({u for u in users if u.split("/")[1] not in allowed})
    assert users and outside == []


def test_no_import_circles():
    graph = {name: sorted({m for m, _, _ in imports_of(path) if m in MODULES and m != name})
             for name, path in MODULES.items()}
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in graph[node]:
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert cycles == [], "\n".join(" -> ".join(c) for c in cycles)


def test_own_module_imports_are_at_the_top():
    lazy = sorted({(rel(f), mod) for f in FILES for mod, inner, _ in imports_of(f)
                   if inner and mod.startswith("megatron_gtpo")} - LAZY_OWN_IMPORTS)
    assert lazy == []


def _functions():
    for f in FILES:
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield f, node


def test_no_function_takes_more_than_eight_parameters():
    wide = []
    for f, node in _functions():
        a = node.args
        params = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs if p.arg not in ("self", "cls", "ctx")]
        params += ["*args"] * bool(a.vararg) + ["**kwargs"] * bool(a.kwarg)
        if len(params) > 8:
            wide.append((rel(f), node.name, len(params)))
    assert wide == []


@pytest.mark.parametrize("limit", [500])
def test_files_and_functions_stay_small(limit):
    long_files = [(rel(f), n) for f in FILES if (n := f.read_text().count("\n")) > limit]
    long_functions = [(rel(f), node.name, node.end_lineno - node.lineno + 1) for f, node in _functions()
                      if node.end_lineno - node.lineno + 1 > 60]
    assert long_files == [] and long_functions == []
