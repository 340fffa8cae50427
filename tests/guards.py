"""What a full run of the suite must contain (tests/conftest.py enforces it when scripts/test.sh runs).

A green CI must mean every layer ran: a lost ``norecursedirs`` line, a missing SLURM install or a
module that stops collecting would otherwise pass quietly. With ``MGTPO_TEST_GUARDS=1`` (set by
scripts/test.sh, which ``make test`` and CI run):

* each layer must collect at least ``FLOORS[layer]`` tests (raise a floor when you add tests; lower
  it only with the reason in the commit);
* a skipped or xfailed test fails the run unless its reason matches one of ``ALLOWED_SKIPS``, each
  with why it cannot run on CI's machine (an ``xfail`` is a check that did not pass: it counts as a
  skip, so an undocumented one fails the run like any failure);
* the shards together ran exactly the collected tests (tests/shards.py ``check``).

Without ``MGTPO_TEST_GUARDS=1`` (a selection) none of this applies, and the run's summary says
so (``OFF_LINE``).
"""

from __future__ import annotations

import re

ENV = "MGTPO_TEST_GUARDS"
OFF_LINE = (f"tests/guards.py: guards OFF ({ENV} is not 1): layer floors and skip/xfail reasons are not checked; "
            "this is a selection, not a full run (scripts/test.sh turns them on)")

FLOORS = {"unit": 1107, "dist": 51, "e2e": 162, "slurm": 22}
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


def skip_reason(report) -> str | None:
    """The reason of a test report that did not pass as a check: skipped, xfailed or xpassed
    (``wasxfail``: the reason given to ``xfail``); None for a passed or failed report."""
    if hasattr(report, "wasxfail"):
        return f"xfail: {report.wasxfail}" if report.skipped or report.passed else None
    if report.skipped:
        return report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    return None


def unexpected_skip(reason: str) -> bool:
    """True when ``reason`` is not one of the documented skips."""
    return not any(re.search(pattern, reason) for pattern, _ in ALLOWED_SKIPS)
