"""What a full run of the suite must contain (tests/conftest.py enforces it when scripts/test.sh runs).

A green CI must mean every layer ran: a lost ``norecursedirs`` line, a missing SLURM install or a
module that stops collecting would otherwise pass quietly. With ``MGTPO_TEST_GUARDS=1`` (set by
scripts/test.sh, which ``make test`` and CI run):

* each layer must collect at least ``FLOORS[layer]`` tests (raise a floor when you add tests; lower
  it only with the reason in the commit);
* a skipped test fails the run unless its reason matches one of ``ALLOWED_SKIPS``, each with why it
  cannot run on CI's machine.
"""

from __future__ import annotations

import re

ENV = "MGTPO_TEST_GUARDS"

FLOORS = {"unit": 1012, "dist": 49, "e2e": 131, "slurm": 17}
"""Tests collected per layer at the last count, minus nothing (pytest counts parametrised cases)."""

ALLOWED_SKIPS = [
    # TRL is an optional benchmark extra (pyproject.toml `bench`), not part of the locked CPU environment.
    (r"TRL is not installed", "bench/vs_trl.py's TRL side: optional, never needed to train or test"),
    # Only on a machine with CUDA: CI's has none, so this never skips there.
    (r"checks the CPU-only answer", "the CPU-only branch of bench/gpu_smoke.py's dry run"),
]


def layer(nodeid: str) -> str | None:
    """The layer of a test id (``tests/e2e/test_slurm_*`` is the SLURM layer)."""
    if nodeid.startswith("tests/e2e/test_slurm_"):
        return "slurm"
    for name in ("unit", "dist", "e2e"):
        if nodeid.startswith(f"tests/{name}/"):
            return name
    return None


def below_floor(nodeids: list[str]) -> list[str]:
    """One line per layer that collected fewer tests than its floor."""
    counts = {name: 0 for name in FLOORS}
    for nodeid in nodeids:
        name = layer(nodeid)
        if name is not None:
            counts[name] += 1
    return [f"{name}: {counts[name]} tests collected, floor {floor}" for name, floor in FLOORS.items()
            if counts[name] < floor]


def unexpected_skip(reason: str) -> bool:
    """True when ``reason`` is not one of the documented skips."""
    return not any(re.search(pattern, reason) for pattern, _ in ALLOWED_SKIPS)
