"""``megatron-gtpo train RECIPE [key.path=value ...]``: validate, then launch the training ranks.

Everything cheap is checked before any rank starts (config types and ranges, the model directory,
the parallel layout against the model's heads/layers/vocabulary, Megatron pass-through fields,
data files, the reward function), so a bad recipe fails in seconds with the key path named.
With tp * pp * dp == 1 the driver runs in this process; otherwise it starts the ranks
(parallel/launch.py) and forwards SIGTERM / SIGUSR1 to them as SIGUSR1 (checkpoint, then exit 0).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from megatron_gtpo.checkpoint.files import CheckpointError, add_resume_options, check_resume
from megatron_gtpo.parallel.launch import launch
from megatron_gtpo.utils.configuration import ConfigError
from megatron_gtpo.utils.runtime import START_TIME_ENV

EPILOG = """examples:
  megatron-gtpo train configs/gtpo.yaml --output-dir runs/gtpo algo.entropy_threshold=0.7
  megatron-gtpo train configs/tiny.yaml --output-dir /tmp/tiny --steps 2
  megatron-gtpo train configs/gtpo.yaml --dry-run parallel.pp=2
  megatron-gtpo train configs/gtpo.yaml --output-dir runs/gtpo --resume
  megatron-gtpo train configs/gtpo.yaml --output-dir runs/gtpo --resume=auto   # fresh start if no checkpoint
"""


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="megatron-gtpo train", description=__doc__, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe", help="YAML recipe (configs/gtpo.yaml, grpo.yaml, drgrpo.yaml, dapo.yaml, tiny.yaml)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides key.path=value (parsed as YAML)")
    parser.add_argument("--output-dir", help="run directory (same as output_dir=...)")
    parser.add_argument("--steps", type=int, help="rollout steps (same as train.steps=...)")
    add_resume_options(parser)
    parser.add_argument("--dry-run", action="store_true",
                        help="validate the config, model, data and parallel layout, print them, and exit")
    parser.add_argument("--world-size", type=int, default=None, metavar="N",
                        help="ranks the launcher will start (slurm/train.sbatch passes trainer nodes x ranks per "
                             "node): refused in seconds, before anything loads, unless it equals parallel.tp x pp x dp")
    parser.add_argument("--prepare-only", action="store_true",
                        help="validate, write the resolved <output-dir>/config.yaml and exit: the ranks are "
                             "started elsewhere (slurm/train.sbatch runs `python -m megatron_gtpo.cli.worker` on every node)")
    return parser.parse_intermixed_args(argv)  # overrides may come before or after the options


def prepare(args):
    """Loads and validates the recipe and the resume request; returns (RunConfig, summary)."""
    checked = bool(args.output_dir) and not args.dry_run
    if checked:  # the run dir is known: refuse a bad resume before importing torch (well under a second)
        check_resume(args.output_dir, args.resume)
    # Imported here, not at the top: the two checks above and --help answer before torch loads.
    from megatron_gtpo.config import load_config
    from megatron_gtpo.plan.preflight import preflight

    overrides = list(args.overrides)
    if args.output_dir:
        overrides.append(f"output_dir={args.output_dir}")
    if args.steps is not None:
        overrides.append(f"train.steps={args.steps}")
    cfg = load_config(args.recipe, overrides)
    if args.world_size is not None and (problem := cfg.parallel.world_size_problem(
            args.world_size, launcher=f"the launcher (--world-size {args.world_size})")):
        raise ConfigError(problem)
    if not checked and not args.dry_run:  # before the model/data checks and before config.yaml is written
        check_resume(cfg.output_dir, args.resume)
    return cfg, preflight(cfg)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cfg, summary = prepare(args)
    except (ConfigError, CheckpointError, FileNotFoundError, ValueError, ImportError) as err:
        print(f"megatron-gtpo train: error: {err}", file=sys.stderr)
        return 2
    print(summary)
    if args.dry_run:
        print("dry run: configuration, model, data and layout are valid; nothing was started")
        return 0
    from megatron_gtpo.config import dump_resolved

    resolved = dump_resolved(cfg)
    if args.prepare_only:
        print(f"resolved config: {resolved}")
        return 0
    world = cfg.parallel.world_size
    if world == 1:  # in this process, as one rank would
        import megatron_gtpo.cli.worker as worker

        return worker.main([str(resolved)] + (["--resume"] if args.resume == "require" else
                                              ["--resume=auto"] if args.resume == "auto" else []))
    return launch_torchrun(resolved, world, resume=args.resume)


def launch_torchrun(resolved_config: Path, world: int, *, resume: str, module: str = "megatron_gtpo.cli.worker",
                    extra: tuple[str, ...] = ()) -> int:
    """Starts ``world`` local ranks of ``python -m module CONFIG [extra]`` (parallel/launch.py: forked
    from this process, which has already imported torch for the checks, on a CPU host; torchrun's
    launcher on a CUDA host) and waits for them; the exit code is 0, or 1 when a rank failed.
    SIGTERM and SIGUSR1 reach the ranks as SIGUSR1 (checkpoint, then exit 0). Multi-node jobs are
    launched by slurm/train.sbatch, which runs torchrun on every node itself."""
    import psutil

    args = [str(resolved_config), *extra]
    if resume == "require":
        args.append("--resume")
    elif resume == "auto":
        args.append("--resume=auto")
    os.environ[START_TIME_ENV] = repr(psutil.Process().create_time())  # the ranks' start-up report counts from here
    return launch(module, args, world)


if __name__ == "__main__":
    raise SystemExit(main())
