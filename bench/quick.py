"""``--quick`` for every benchmark script: the same code path at toy sizes, in seconds on the tiny model.

The suite runs each script's quick mode (``tests/e2e/test_bench_quick.py``), so a benchmark whose
code rots (a moved import, a changed signature) fails CI instead of waiting for the next full run.
A quick run's figures mean nothing; only that the path ran and printed its JSON line.
"""

from __future__ import annotations

import argparse


def parse_quick(parser: argparse.ArgumentParser, argv: list[str] | None, quick: dict) -> argparse.Namespace:
    """Adds ``--quick`` to ``parser`` and parses ``argv``; with ``--quick`` the values of ``quick``
    (argument dest -> value) replace the defaults, so an explicit flag still wins."""
    shown = ", ".join(f"{k}={v}" for k, v in quick.items())
    parser.add_argument("--quick", action="store_true", help=f"toy sizes for the suite's smoke run ({shown})")
    known, _ = parser.parse_known_args(argv)
    if known.quick:
        parser.set_defaults(**quick)
    return parser.parse_args(argv)
