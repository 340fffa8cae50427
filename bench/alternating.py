"""Variants measured in turn within one invocation, so that each sees the same machine load."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable


def alternate(variants: Iterable[str], repeats: int, measure: Callable[[str, int], dict[str, float]]
              ) -> tuple[dict[str, list[dict]], dict[str, dict[str, float]]]:
    """``measure(variant, round)`` for every variant in each of ``repeats`` rounds; returns every
    row per variant and the per-key medians per variant."""
    rows: dict[str, list[dict]] = {variant: [] for variant in variants}
    for i in range(repeats):
        for variant in rows:
            rows[variant].append(measure(variant, i))
    med = {variant: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for variant, runs in rows.items()}
    return rows, med
