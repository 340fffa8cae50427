"""The README's metrics table is the one list in megatron_gtpo/metrics.py, and every name the
code writes as a metric literal is in that list."""

from __future__ import annotations

import ast
import re

from megatron_gtpo.metrics import METRICS, markdown_table, unknown
from tests.helpers import REPO

# Metric-like string literals that are not logged metrics (artifact folders, filter prefixes).
NOT_METRICS = {"runs/default"}


def test_readme_table_is_generated_from_the_list():
    assert markdown_table() in (REPO / "README.md").read_text()


def test_every_metric_literal_in_the_package_is_documented():
    pattern = re.compile(r"^(max:|min:)?([a-z_]+/[a-z0-9_]+)$")
    found = set()
    for path in (REPO / "megatron_gtpo").rglob("*.py"):
        if path.name == "metrics.py" or "eval" in path.parts:
            continue  # eval/ names its own MLflow metrics per benchmark (eval/<bench>/pass@k)
        tree = ast.parse(path.read_text())
        pieces = {id(v) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for v in node.values}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in pieces \
                    and (m := pattern.match(node.value)):
                found.add(m.group(2))
    found -= NOT_METRICS
    assert found and unknown(found) == [], unknown(found)
    assert "entropy/mean" in METRICS and "loss" in METRICS
