"""One training rank: ``python -m megatron_gtpo.cli.worker CONFIG.yaml [--resume | --resume=auto]``.

Started on every rank by ``megatron-gtpo train`` (through torchrun), ``slurm/train.sbatch`` and
``launch/torchrun_node.sh`` with the resolved config that ``megatron-gtpo train`` wrote.
"""

from __future__ import annotations

import argparse
import os
import sys

from megatron_gtpo.checkpoint.files import CheckpointError, add_resume_options
from megatron_gtpo.config import load_config
from megatron_gtpo.reward import RewardFunctionCrashed, RewardFunctionFailing
from megatron_gtpo.trainer import run

STOPS = (CheckpointError, RewardFunctionCrashed, RewardFunctionFailing)
"""Errors that end a run with their message alone: the cause is named, a traceback adds nothing."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m megatron_gtpo.cli.worker", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="resolved config YAML (written by `megatron-gtpo train`)")
    add_resume_options(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cfg = load_config(args.config)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if problem := cfg.parallel.world_size_problem(world, launcher="torchrun (WORLD_SIZE)"):
        print(f"megatron-gtpo: error: {problem}", file=sys.stderr, flush=True)  # before anything loads
        return 2
    try:
        run(cfg, resume=args.resume)
    except STOPS as err:  # a clear stop, named by its own message, instead of a traceback
        print(f"megatron-gtpo: error: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
