"""One training rank: ``python -m megatron_gtpo.cli.worker CONFIG.yaml [--resume | --resume=auto]``.

Started on every rank by ``megatron-gtpo train`` (parallel/launch.py), ``slurm/train.sbatch`` and
``launch/torchrun_node.sh`` with the resolved config that ``megatron-gtpo train`` wrote.

This module imports nothing heavy at the top: the processes a rank spawns (reward workers; a
checkpoint-writer Manager where Megatron starts one) re-import the main module, and would otherwise
each import torch, Megatron and vLLM before doing anything.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from megatron_gtpo.checkpoint.files import CheckpointError, add_resume_options


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m megatron_gtpo.cli.worker", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="resolved config YAML (written by `megatron-gtpo train`)")
    add_resume_options(parser)
    return parser


def main(argv: list[str] | None = None, *, exit_when_done: bool = False) -> int:
    """Trains; 0 on success, 1 on a clear stop. ``exit_when_done``: end the process as soon as the
    run has finished (every checkpoint committed, MLflow closed), skipping the interpreter's
    teardown of engines, process groups and helper processes (seconds on 2 cores)."""
    from megatron_gtpo.config import load_config
    from megatron_gtpo.reward import RewardFunctionCrashed, RewardFunctionFailing
    from megatron_gtpo.trainer import run

    stops = (CheckpointError, RewardFunctionCrashed, RewardFunctionFailing)  # the cause is named: no traceback
    args = build_parser().parse_args(argv)
    cfg = load_config(args.config)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if problem := cfg.parallel.world_size_problem(world, launcher="torchrun (WORLD_SIZE)"):
        print(f"megatron-gtpo: error: {problem}", file=sys.stderr, flush=True)  # before anything loads
        return 2
    try:
        run(cfg, resume=args.resume)
    except stops as err:  # a clear stop, named by its own message, instead of a traceback
        print(f"megatron-gtpo: error: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
        return 1
    log_strict_checks()
    if exit_when_done:
        exit_now(0)
    return 0


def log_strict_checks() -> None:
    """With strict device groups on (parallel/strict.py), says how many collectives of the run were
    checked, per op and group kind (``unclassified``: a group the checker could not place)."""
    import megatron_gtpo.parallel.strict as strict

    if not strict.active():
        return
    counts = sorted(strict.CHECKED.items(), key=lambda item: (item[0][0], str(item[0][1])))
    parts = " ".join(f"{op}/{kind or 'unclassified'}={n}" for (op, kind), n in counts)
    logging.getLogger("megatron_gtpo").info("strict device groups: %d collective(s) checked: %s",
                                            sum(strict.CHECKED.values()), parts)


def exit_now(code: int) -> None:
    """Ends the process now, skipping the interpreter's teardown (seconds of garbage collection of
    torch, vLLM and process groups on 2 cores), once its output is out and a checkpoint-writer
    Manager, the one helper process that would outlive it, is stopped: Megatron starts one for
    asynchronous saves; the synchronous saves here keep their results in the rank
    (checkpoint/store.py), so there is usually none."""
    filesystem_async = sys.modules.get("megatron.core.dist_checkpointing.strategies.filesystem_async")
    queue = getattr(filesystem_async, "_results_queue", None)
    manager = getattr(getattr(queue, "_manager", None), "shutdown", None)
    if manager is not None:
        manager()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    raise SystemExit(main(exit_when_done=True))
