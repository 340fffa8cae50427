"""Stored reference values: configs/tiny.yaml for 4 steps must reproduce tests/assets/tiny_reference.json
bit for bit (fp32 on CPU is deterministic here: same seeds, same vLLM samples, same Megatron sums).

The values were recorded before the driver was restructured (issue 11); any change to them has to be
explained by a deliberate numerical change, never by a refactor.
"""

from __future__ import annotations

import json
import sys

import pytest

from tests.helpers import REPO, child_env, run_group

pytestmark = pytest.mark.slow

REFERENCE = json.loads((REPO / "tests" / "assets" / "tiny_reference.json").read_text())


def _history(out, key: str) -> list[float]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    run_id = (out / "run_id").read_text().strip()
    return [v for _, v in sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))]


@pytest.mark.parametrize("case", sorted(REFERENCE["cases"]))
def test_tiny_recipe_reproduces_reference_values(tmp_path, case):
    spec = REFERENCE["cases"][case]
    out = tmp_path / case
    cmd = [sys.executable, "-m", "megatron_gtpo.cli", "train", str(REPO / "configs" / "tiny.yaml"),
           "--output-dir", str(out), "--steps", "4", *spec["overrides"]]
    proc = run_group(cmd, timeout=1200, cwd=REPO, env=child_env())
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    for key, expected in spec["metrics"].items():
        assert _history(out, key) == expected, f"{case}: {key} differs from the stored reference"
