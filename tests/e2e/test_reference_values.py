"""Stored reference values: configs/tiny.yaml for 4 steps must reproduce tests/assets/tiny_reference.json
bit for bit (fp32 on CPU is deterministic here: same seeds, same vLLM samples, same Megatron sums).
The runs are the session's run_ref_gtpo and run_ref_grpo_kl (tests/e2e/conftest.py).

The values were recorded before the driver was restructured (issue 11); any change to them has to be
explained by a deliberate numerical change, never by a refactor.
"""

from __future__ import annotations

import pytest

from tests.e2e.conftest import REFERENCE
from tests.e2e.runs import per_step


@pytest.mark.parametrize("case", sorted(REFERENCE["cases"]))
def test_tiny_recipe_reproduces_reference_values(request, case):
    run = request.getfixturevalue(f"run_ref_{case}")
    for key, expected in REFERENCE["cases"][case]["metrics"].items():
        assert per_step(run.out, key, 4) == expected, f"{case}: {key} differs from the stored reference"
