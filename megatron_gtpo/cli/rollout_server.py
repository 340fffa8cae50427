"""``megatron-gtpo rollout-server``: one vLLM engine serving a trainer's generate requests and weight pushes.

    megatron-gtpo rollout-server OUTPUT_DIR/config.yaml [--port P] [--host H]     # from a resolved recipe
    megatron-gtpo rollout-server --model-dir DIR [--vllm-json '{...}'] [--seed S] [--port P]

With a recipe the engine is ``rollout.vllm`` (any ``tensor_parallel_size``: the engine takes that
many GPUs of this node) on the recipe's model, with the trainer's fp32 LM head when
``model.lm_head_fp32`` is on, listening on ``sync.server_port``; the trainer
(``sync.transport: separate``) connects to it. ``slurm/train.sbatch`` with ``ROLLOUT_NODES=N``
starts one per rollout node; trainer rank 0 starts local ones itself when no address is known.

Security (docs/security.md): every connection must prove the job's secret, read from the file
``MGTPO_SECRET_FILE`` names (mode 0600; slurm/train.sbatch makes it); the server refuses to start
without it. It listens on one address only: ``--host``, else the address of this node among
``MGTPO_ROLLOUT_HOSTS`` (the one the trainer connects to), else the IPv4 address of ``NET_IFNAME``,
else loopback. ``--host 0.0.0.0`` (all interfaces) must be asked for.

Runs until the trainer sends ``close`` or the process is signalled. Prints
``rollout-server listening on HOST:PORT`` once the port is held (before the engine loads) and
``rollout-server ready on HOST:PORT`` once the engine is up.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys

import psutil

from megatron_gtpo.config import load_config
from megatron_gtpo.models.hf_config import has_hf_weights
from megatron_gtpo.models.resolve import resolve_model
from megatron_gtpo.parallel import unpickle
from megatron_gtpo.rollout.server import RolloutServer, ServerSpec
from megatron_gtpo.sync.receiver import PushReceiver
from megatron_gtpo.utils.secret import SecretError, load_secret

log = logging.getLogger("megatron_gtpo.rollout_server")


def build_parser() -> argparse.ArgumentParser:
    intro, rest = __doc__.split("\n\n", 1)
    parser = argparse.ArgumentParser(prog="megatron-gtpo rollout-server", description=intro, epilog=rest,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", nargs="?", help="resolved recipe (written by `megatron-gtpo train`)")
    parser.add_argument("--model-dir", help="HF model directory (instead of a recipe)")
    parser.add_argument("--vllm-json", default="{}", help="vllm.LLM keyword arguments as JSON (with --model-dir)")
    parser.add_argument("--seed", type=int, default=0, help="engine seed (with --model-dir)")
    parser.add_argument("--host", default=None,
                        help="address to listen on (default: this node's address in MGTPO_ROLLOUT_HOSTS, else "
                             "NET_IFNAME's, else 127.0.0.1)")
    parser.add_argument("--port", type=int, default=None,
                        help="the server's one port; 0 = any free one, printed once bound (default: "
                             "MGTPO_ROLLOUT_PORT, else sync.server_port)")
    parser.add_argument("--timeout-s", type=float, default=None, help="longest wait inside one request")
    return parser


def bind_host(explicit: str | None) -> str:
    """The one address to listen on (module docstring)."""
    if explicit:
        return explicit
    for host in filter(None, os.environ.get("MGTPO_ROLLOUT_HOSTS", "").split(",")):
        try:
            address = socket.gethostbyname(host)
        except OSError:
            continue
        if _is_local(address):
            return address
    ifname = os.environ.get("NET_IFNAME")
    if ifname:
        for addr in psutil.net_if_addrs().get(ifname, []):
            if addr.family == socket.AF_INET:
                return addr.address
        raise SystemExit(f"rollout-server: NET_IFNAME={ifname} has no IPv4 address on {socket.gethostname()}")
    return "127.0.0.1"


def _is_local(address: str) -> bool:
    """True when ``address`` is one of this node's own (a socket can bind it)."""
    with socket.socket() as sock:
        try:
            sock.bind((address, 0))
        except OSError:
            return False
    return True


def _port(explicit: int | None, env: str | None, default: int) -> int:
    """``--port`` (0 = any free port), else MGTPO_ROLLOUT_PORT, else the default."""
    return explicit if explicit is not None else int(env or default)


def spec_from_args(args: argparse.Namespace) -> ServerSpec:
    """What to serve: the recipe's rollout engine, or an explicit model directory."""
    if bool(args.config) == bool(args.model_dir):
        raise SystemExit("rollout-server: give either a recipe or --model-dir")
    port_env, host = os.environ.get("MGTPO_ROLLOUT_PORT"), bind_host(args.host)
    if args.model_dir:
        return ServerSpec(model_dir=args.model_dir, vllm=json.loads(args.vllm_json), seed=args.seed,
                          host=host, port=_port(args.port, port_env, 29650), timeout_s=args.timeout_s or 900.0)
    cfg = load_config(args.config)
    model_dir = str(resolve_model(cfg.model.path))
    rollout = cfg.rollout.for_engines(lm_head_fp32=cfg.model.lm_head_fp32, hf_weights=has_hf_weights(model_dir))
    return ServerSpec(model_dir=model_dir, vllm=dict(rollout.vllm), seed=cfg.rollout.seed,
                      request_seeds=cfg.rollout.seeded_requests(), host=host,
                      port=_port(args.port, port_env, cfg.sync.server_port), timeout_s=args.timeout_s or cfg.sync.timeout_s)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        secret = load_secret()  # before the engine: no secret, no server
    except SecretError as err:
        print(f"megatron-gtpo rollout-server: error: {err}", file=sys.stderr)
        return 2
    spec = spec_from_args(args)
    if spec.host in ("0.0.0.0", "::", ""):
        log.warning("listening on all interfaces (--host %s): every network of this node can reach the port", spec.host)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    unpickle.install()  # vLLM's world in this process: its object collectives build data types only
    RolloutServer(spec, secret=secret, receiver=PushReceiver()).run()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
