"""convert_hf_checkpoint: HF safetensors <-> Megatron-Core dist checkpoint, streamed.

Examples::

    tools/convert_hf_checkpoint --to megatron --input HF_DIR --output MCORE_DIR --tp 2 --pp 2
    tools/convert_hf_checkpoint --to megatron --input QWEN3_MOE_DIR --output MCORE_DIR --tp 2 --ep 8
    tools/convert_hf_checkpoint --to hf --input MCORE_DIR --output HF_DIR
    tools/convert_hf_checkpoint --to hf --input runs/x/checkpoints/step_00000100 \\
        --hf-config MCORE_DIR --output HF_DIR          # a training checkpoint (model weights only)
    tools/convert_hf_checkpoint --to hf --input runs/lora/checkpoints/step_00000100 --output HF_DIR
                                                       # a LoRA run: the base with the adapters merged
    tools/convert_hf_checkpoint --to peft --input runs/lora/checkpoints/step_00000100 --output ADAPTER_DIR
                                                       # a LoRA run: a PEFT adapter (peft, vLLM LoRA)

A LoRA checkpoint holds the adapters only; its base is the one it records (path and sha256 of
its weight files), or --base DIR, whose hash must match.

The output is built in a hidden temp directory next to ``--output`` and renamed at the end, so
a failure never leaves a partial output. Bad input exits with status 2 and names the file/field.
Prints seconds, MB/s and peak RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from megatron_gtpo.convert.lora_export import adapter_to_peft, lora_checkpoint, merged_to_hf
from megatron_gtpo.convert.offline import hf_to_megatron, megatron_to_hf
from megatron_gtpo.utils.configuration import ConfigError
from megatron_gtpo.utils.runtime import host_peak_rss_bytes, reset_host_peak_rss
from megatron_gtpo.models.config import VOCAB_DIVISIBLE_BY

EXIT_BAD_INPUT = 2


def build_parser() -> argparse.ArgumentParser:
    """The CLI's arguments (also used by ``megatron-gtpo convert``)."""
    parser = argparse.ArgumentParser(
        prog="convert_hf_checkpoint", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--to", required=True, choices=("megatron", "hf", "peft"),
                        help="direction of the conversion; peft: the PEFT adapter of a LoRA training checkpoint")
    parser.add_argument("--input", required=True, type=Path,
                        help="HF model dir (--to megatron), Megatron checkpoint dir (--to hf) or LoRA training "
                        "step dir (--to hf: merged model, --to peft: adapter)")
    parser.add_argument("--base", type=Path, default=None,
                        help="LoRA checkpoints: the base model's directory (default: the path it records; its "
                        "weights' sha256 must match the recorded one)")
    parser.add_argument("--output", required=True, type=Path, help="directory to create; must not exist")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size the checkpoint is meant for "
                        "(validated; Megatron reshards at load, so any layout can load it)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (validated, recorded)")
    parser.add_argument("--vpp", type=int, default=None, help="virtual pipeline stages per PP rank (validated)")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel size of a mixture of experts (validated "
                        "against the expert count and recorded; experts are streamed one at a time and the "
                        "checkpoint loads at any EP)")
    parser.add_argument("--etp", type=int, default=1, help="expert tensor-parallel size (validated, recorded)")
    parser.add_argument("--make-vocab-size-divisible-by", type=int, default=VOCAB_DIVISIBLE_BY, metavar="N",
                        help="--to megatron: pad the vocabulary (embedding, output layer) with zero rows to a "
                        "multiple of N x --tp, as Megatron-LM does (default %(default)s); --to hf strips the padding")
    parser.add_argument("--hf-config", type=Path, default=None,
                        help="--to hf: dir with config.json + tokenizer files when --input lacks them")
    parser.add_argument("--max-shard-mb", type=float, default=5000.0,
                        help="--to hf: largest safetensors shard in MB (default 5000)")
    return parser


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _check_args(args: argparse.Namespace) -> None:
    for name in ("tp", "pp", "ep", "etp"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name}={getattr(args, name)} must be >= 1")
    if args.vpp is not None and args.vpp < 1:
        raise ConfigError(f"--vpp={args.vpp} must be >= 1")
    if args.make_vocab_size_divisible_by < 1:
        raise ConfigError(f"--make-vocab-size-divisible-by={args.make_vocab_size_divisible_by} must be >= 1")
    if args.max_shard_mb <= 0:
        raise ConfigError(f"--max-shard-mb={args.max_shard_mb} must be > 0")
    if not args.input.is_dir():
        raise ConfigError(f"--input {args.input} is not a directory")
    if args.output.exists():
        raise ConfigError(f"--output {args.output} already exists; choose a new directory or remove it first")


def _convert(args: argparse.Namespace, tmp: Path) -> int:
    lora = args.to != "megatron" and lora_checkpoint(args.input) is not None
    if args.to == "peft" or lora:
        if args.hf_config is not None:
            raise ConfigError("--hf-config does not apply to a LoRA checkpoint: its config comes from the base (--base)")
        if args.to == "peft":
            return adapter_to_peft(args.input, tmp, base=args.base)
        return merged_to_hf(args.input, tmp, base=args.base, shard_bytes=int(args.max_shard_mb * 2**20))
    if args.base is not None:
        raise ConfigError(f"--base applies to LoRA checkpoints only; {args.input} is not one")
    if args.to == "megatron":
        return hf_to_megatron(args.input, tmp, tp=args.tp, pp=args.pp, vpp=args.vpp,
                              vocab_divisible_by=args.make_vocab_size_divisible_by,
                              experts=(args.ep, args.etp))["bytes"]
    return megatron_to_hf(args.input, tmp, config_dir=args.hf_config or args.input,
                          shard_bytes=int(args.max_shard_mb * 2**20))


def main(argv: list[str] | None = None) -> int:
    """Runs one conversion; returns the exit status (0 ok, 2 bad input, 1 unexpected error)."""
    args = build_parser().parse_args(argv)
    tmp = None
    try:
        _check_args(args)
        args.output.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=args.output.parent, prefix=f".{args.output.name}.tmp-"))
        rss_before, start = reset_host_peak_rss() / 2**20, time.perf_counter()
        total = _convert(args, tmp)
        tmp.chmod(0o777 & ~_umask())  # mkdtemp makes it 0700; the output gets normal permissions
        os.rename(tmp, args.output)  # atomic on one filesystem; fails if --output appeared meanwhile
        tmp = None
    except ConfigError as err:
        print(f"convert_hf_checkpoint: error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    seconds = time.perf_counter() - start
    stats = {"direction": args.to, "seconds": round(seconds, 3), "mb": round(total / 2**20, 2),
             "mb_per_s": round(total / 2**20 / max(seconds, 1e-9), 2),
             "peak_rss_mb": round(host_peak_rss_bytes() / 2**20, 1),
             "rss_before_mb": round(rss_before, 1), "output": str(args.output)}
    print(f"converted {args.input} -> {args.output} ({args.to}): {stats['mb']} MB of tensors in "
          f"{stats['seconds']} s ({stats['mb_per_s']} MB/s); peak RSS {stats['peak_rss_mb']} MB "
          f"(RSS before converting {stats['rss_before_mb']} MB)")
    print("stats: " + json.dumps(stats), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
