"""``--quick`` for every benchmark script: the same code path at toy sizes, in seconds on the tiny model.

The suite runs each script's quick mode (``tests/e2e/test_bench_quick.py``), so a benchmark whose
code rots (a moved import, a changed signature) fails CI instead of waiting for the next full run.
A quick run's figures mean nothing; only that the path ran and printed its JSON line.
"""

from __future__ import annotations

import argparse
import sys


def parse_quick(parser: argparse.ArgumentParser, argv: list[str] | None, quick: dict | list[str]) -> argparse.Namespace:
    """Adds ``--quick`` to ``parser`` and parses ``argv`` (default ``sys.argv[1:]``). With ``--quick``,
    a dict ``quick`` (argument dest -> value) replaces the defaults; a list is put before ``argv``
    (for parsers with required flags, e.g. the eval CLI's ``--model``). Explicit flags still win."""
    argv = sys.argv[1:] if argv is None else list(argv)
    shown = " ".join(quick) if isinstance(quick, list) else ", ".join(f"{k}={v}" for k, v in quick.items())
    parser.add_argument("--quick", action="store_true", help=f"toy sizes for the suite's smoke run ({shown})")
    if "--quick" in argv:
        if isinstance(quick, list):
            argv = quick + argv
        else:
            parser.set_defaults(**quick)
    return parser.parse_args(argv)
