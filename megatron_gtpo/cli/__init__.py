"""The ``megatron-gtpo`` command: train, demo, probe, eval, convert, dry-run, config, rollout-server.

Each subcommand parses its own arguments (``megatron-gtpo SUBCOMMAND --help``); heavy imports
(torch, Megatron, vLLM) happen only inside the subcommand that needs them.
"""

from __future__ import annotations

import argparse
import sys

from megatron_gtpo.cli.worker import exit_now

SUBCOMMANDS = {
    "train": ("megatron_gtpo.cli.train", "train a policy from a YAML recipe (launches the ranks)"),
    "demo": ("megatron_gtpo.cli.demo", "short GTPO run on CPU with SmolLM2-135M-Instruct, then plots"),
    "probe": ("megatron_gtpo.cli.probe", "reward-scale probe: short runs at reward x phi from one start (spec 6 D3)"),
    "eval": ("megatron_gtpo.cli.eval", "pass@k / maj@k / mean@k on GSM8K, MATH-500, AIME, AMC, MMLU-STEM"),
    "convert": ("megatron_gtpo.cli.convert", "convert checkpoints between Hugging Face and Megatron-Core"),
    "dry-run": ("megatron_gtpo.cli.dry_run", "validate a recipe and print the parallel layout and memory"),
    "config": ("megatron_gtpo.cli.config", "print every config field with its default and doc"),
    "rollout-server": ("megatron_gtpo.cli.rollout_server", "one vLLM engine serving a trainer's rollouts and "
                       "weight pushes (separate transport)"),
}


def quiet_warnings() -> None:
    """Megatron warns at import time that TE/apex are missing: expected on CPU, said once in the README."""
    import warnings

    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
    warnings.filterwarnings("ignore", message=".*full scope is deprecated.*")


def main(argv: list[str] | None = None) -> int:
    quiet_warnings()
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="megatron-gtpo",
        description="GTPO / GRPO / Dr. GRPO / DAPO post-training on Megatron-Core with vLLM rollouts.",
        epilog="\n".join(f"  {name:<14} {help_}" for name, (_, help_) in SUBCOMMANDS.items())
        + "\n\nRun `megatron-gtpo SUBCOMMAND --help` for the options of each.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("subcommand", choices=sorted(SUBCOMMANDS), metavar="SUBCOMMAND",
                        help="one of: " + ", ".join(SUBCOMMANDS))
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    args = parser.parse_args(argv[:1])
    import importlib

    module = importlib.import_module(SUBCOMMANDS[args.subcommand][0])
    code = int(module.main(argv[1:]) or 0)
    if args.subcommand == "train":  # the run is over (or never started) and nothing is left to write
        exit_now(code)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
