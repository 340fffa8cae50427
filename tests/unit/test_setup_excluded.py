"""requirements/excluded.txt: packages of the resolved locks that set-up deliberately leaves out.

scikit-learn (with skops, joblib, threadpoolctl) comes only from mlflow's scikit-learn model flavour,
which the project never uses; installed, transformers imports it at every start (0.7 s of the
driver's serial start-up, docs/performance.md). These tests fail when set-up installs it again.
"""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LOCKS = ("requirements/cpu.lock", "requirements/gpu.lock")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _excluded() -> list[str]:
    lines = (line.split("#", 1)[0].strip() for line in (REPO / "requirements/excluded.txt").read_text().splitlines())
    return [line for line in lines if line]


def _lock_names(text: str) -> list[str]:
    return [_norm(m.group(1)) for m in re.finditer(r"(?m)^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*==", text)]


def test_the_list_names_scikit_learn_and_what_needs_it():
    assert {_norm(n) for n in _excluded()} == {"scikit-learn", "skops", "joblib", "threadpoolctl"}


@pytest.mark.parametrize("lock", LOCKS)
def test_the_setup_filter_drops_exactly_the_excluded_lines(lock):
    """Bug caught: scripts/excluded.sh's filter keeping an excluded line (set-up would install it) or
    dropping another package; or a name in the list that the lock no longer has (a stale entry)."""
    out = subprocess.run(["bash", "-c", f"source scripts/excluded.sh && lock_without_excluded {lock}"], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout
    full = _lock_names((REPO / lock).read_text())
    kept = _lock_names(out)
    excluded = {_norm(n) for n in _excluded()}
    assert excluded <= set(full), f"{lock} lacks {sorted(excluded - set(full))}: remove them from excluded.txt"
    assert kept == [n for n in full if n not in excluded]


def test_no_excluded_package_is_installed():
    """Bug caught: set-up installing the whole lock again (the base would import scikit-learn at
    every start). Fails in an environment that has any of them."""
    installed = []
    for name in _excluded():
        try:
            installed.append(f"{name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    assert not installed, f"installed although requirements/excluded.txt leaves them out: {installed}"


def test_transformers_sees_no_scikit_learn():
    """What the exclusion is for: transformers' generation module imports sklearn.metrics when this
    is True, on every start (the driver's preflight and vLLM both import it)."""
    from transformers.utils import is_sklearn_available

    assert not is_sklearn_available()
