#!/usr/bin/env python3
"""Render MLflow runs (run directories or run ids) to a PNG of training curves. See --help."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_gtpo.plotting import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
