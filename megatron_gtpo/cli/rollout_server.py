"""``megatron-gtpo rollout-server``: one vLLM engine serving a trainer's generate requests and weight pushes.

    megatron-gtpo rollout-server OUTPUT_DIR/config.yaml [--port P] [--host H]     # from a resolved recipe
    megatron-gtpo rollout-server --model-dir DIR [--vllm-json '{...}'] [--seed S] [--port P]

With a recipe the engine is ``rollout.vllm`` (any ``tensor_parallel_size``: the engine takes that
many GPUs of this node) on the recipe's model, listening on ``sync.server_port``; the trainer
(``sync.transport: separate``) connects to it. ``slurm/train.sbatch`` with ``ROLLOUT_NODES=N``
starts one per rollout node; trainer rank 0 starts local ones itself when no address is known.
Runs until the trainer sends ``close`` or the process is signalled. Prints
``rollout-server ready on HOST:PORT`` once the engine is up.
"""

from __future__ import annotations

import argparse
import json
import logging
import os

from megatron_gtpo.config import load_config
from megatron_gtpo.models.hf_config import has_hf_weights
from megatron_gtpo.models.resolve import resolve_model
from megatron_gtpo.rollout.server import RolloutServer, ServerSpec


def build_parser() -> argparse.ArgumentParser:
    intro, rest = __doc__.split("\n\n", 1)
    parser = argparse.ArgumentParser(prog="megatron-gtpo rollout-server", description=intro, epilog=rest,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", nargs="?", help="resolved recipe (written by `megatron-gtpo train`)")
    parser.add_argument("--model-dir", help="HF model directory (instead of a recipe)")
    parser.add_argument("--vllm-json", default="{}", help="vllm.LLM keyword arguments as JSON (with --model-dir)")
    parser.add_argument("--seed", type=int, default=0, help="engine seed (with --model-dir)")
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (default: all interfaces)")
    parser.add_argument("--port", type=int, default=None,
                        help="control port; the transfer-group store uses the next one (default: sync.server_port "
                             "or MGTPO_ROLLOUT_PORT)")
    parser.add_argument("--timeout-s", type=float, default=None, help="longest wait inside one request")
    return parser


def spec_from_args(args: argparse.Namespace) -> ServerSpec:
    """What to serve: the recipe's rollout engine, or an explicit model directory."""
    if bool(args.config) == bool(args.model_dir):
        raise SystemExit("rollout-server: give either a recipe or --model-dir")
    port_env = os.environ.get("MGTPO_ROLLOUT_PORT")
    if args.model_dir:
        return ServerSpec(model_dir=args.model_dir, vllm=json.loads(args.vllm_json), seed=args.seed,
                          host=args.host, port=args.port or int(port_env or 29650), timeout_s=args.timeout_s or 900.0)
    cfg = load_config(args.config)
    model_dir = str(resolve_model(cfg.model.path))
    vllm = dict(cfg.rollout.vllm)
    if not has_hf_weights(model_dir):  # a Megatron checkpoint: the first push fills the engine
        vllm.setdefault("load_format", "dummy")
    return ServerSpec(model_dir=model_dir, vllm=vllm, seed=cfg.rollout.seed,
                      request_seeds=cfg.rollout.seeded_requests(), host=args.host,
                      port=args.port or int(port_env or cfg.sync.server_port), timeout_s=args.timeout_s or cfg.sync.timeout_s)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    RolloutServer(spec_from_args(args)).run()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
