"""Stand-in for the ``megatron-gtpo`` command in the launcher tests of ``slurm/*.sbatch``.

SLURM, srun, torchrun and the batch scripts are all real in those tests; only the program the
ranks run is this small stdlib script, so the tests check the *launcher's* contract quickly:
what each rank sees (argv, RANK/WORLD_SIZE/MASTER_ADDR, MLFLOW_TRACKING_URI, SLURM node), that
SIGUSR1 reaches every rank, and that a requeued run gets ``--resume``. The real training command
is covered by ``test_slurm_train.py``.

It plays both programs of ``slurm/train.sbatch`` and the commands of the other scripts; each
invocation appends one JSON record to ``$STANDIN_DIR/records.jsonl``:

``CLI train RECIPE ... --output-dir D [--steps N] --prepare-only`` writes ``D/config.yaml`` (JSON,
which is YAML) holding the output dir and steps, as ``megatron-gtpo train --prepare-only`` does.
``RANK: python -m tests.e2e.slurm_standin D/config.yaml [--resume | --resume=auto]`` counts steps
(STANDIN_STEP_S seconds each); on SIGUSR1 rank 0 writes ``D/ckpt.json`` with the last finished step
and every rank exits 0; with ``--resume`` it starts after that step and fails without it (as the
worker does), with ``--resume=auto`` it starts after it or at 0 when there is none. The prepare
step touches ``$STANDIN_DIR/preparing`` first and then sleeps STANDIN_PREPARE_S seconds. STANDIN_ALLREDUCE=1 first joins a gloo group
through torchrun's rendezvous variables and all-reduces the ranks (a real cross-"node" connection).
Each rank's ``start`` record carries the SHA-256 of the job secret it found at ``$MGTPO_SECRET_FILE``
(None when there was no file), never the secret itself.
With ``MGTPO_ROLLOUT_HOSTS`` set, a rank first waits for every rollout node's server record (as the
trainer waits for its servers). ``CLI rollout-server``: records, then sleeps until terminated. ``CLI eval``/``CLI convert``: record
and exit 0 (``eval`` writes ``{}`` to its last ``--output``).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time
from pathlib import Path

_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "MLFLOW_TRACKING_URI", "SLURMD_NODENAME",
        "SLURM_NODEID", "SLURM_RESTART_COUNT", "MGTPO_ROLLOUT_HOSTS", "MGTPO_ROLLOUT_PORT", "CUDA_VISIBLE_DEVICES",
        "CUDA_DEVICE_MAX_CONNECTIONS", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "VLLM_CACHE_ROOT", "TRITON_CACHE_DIR")


def _record(**fields) -> None:
    fields.update(argv=sys.argv[1:], env={k: os.environ.get(k) for k in _ENV}, pid=os.getpid(), time=time.time())
    path = Path(os.environ["STANDIN_DIR"]) / "records.jsonl"
    with open(path, "a") as handle:  # one short write per line: appends from several ranks stay whole
        handle.write(json.dumps(fields) + "\n")


def _option(args: list[str], name: str, default: str | None = None) -> str | None:
    values = [args[i + 1] for i, a in enumerate(args[:-1]) if a == name]
    return values[-1] if values else default


def _secret_digest() -> str | None:
    path = Path(os.environ.get("MGTPO_SECRET_FILE") or "/nonexistent")
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


def _allreduce() -> int:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    total = torch.tensor([int(os.environ["RANK"])])
    dist.all_reduce(total)
    dist.destroy_process_group()
    return int(total.item())


def prepare(args: list[str]) -> int:
    out = Path(_option(args, "--output-dir"))
    (Path(os.environ["STANDIN_DIR"]) / "preparing").touch()
    time.sleep(float(os.environ.get("STANDIN_PREPARE_S", "0")))
    steps = int(_option(args, "--steps", "1000"))
    (out / "config.yaml").write_text(json.dumps({"output_dir": str(out), "steps": steps}))
    _record(event="prepare")
    return 0


def _wait_for_servers(timeout_s: float = 120.0) -> None:
    """As the real trainer waits for its rollout servers before its first step: until every rollout
    node's stand-in server has recorded its start (else a loaded machine ends the job, and kills the
    server's step, before that step ever ran)."""
    path = Path(os.environ["STANDIN_DIR"]) / "records.jsonl"
    hosts = len(os.environ["MGTPO_ROLLOUT_HOSTS"].split(","))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        lines = path.read_text().splitlines() if path.exists() else []
        if sum(json.loads(line).get("event") == "rollout-server" for line in lines) >= hosts:
            return
        time.sleep(0.2)


def rank(args: list[str]) -> int:
    stop: list[int] = []
    signal.signal(signal.SIGUSR1, lambda *_: stop.append(signal.SIGUSR1))
    cfg = json.loads(Path(args[0]).read_text())
    ckpt, rank_id = Path(cfg["output_dir"]) / "ckpt.json", int(os.environ["RANK"])
    if "--resume" in args and not ckpt.exists():  # as the worker: --resume requires a checkpoint
        _record(event="refused")
        print(f"no usable checkpoint in {cfg['output_dir']}", file=sys.stderr)
        return 1
    resume = "--resume" in args or "--resume=auto" in args
    start = json.loads(ckpt.read_text())["step"] if resume and ckpt.exists() else 0
    total = _allreduce() if os.environ.get("STANDIN_ALLREDUCE") == "1" else None
    if os.environ.get("MGTPO_ROLLOUT_HOSTS"):
        _wait_for_servers()
    _record(event="start", step=start, allreduce=total, secret=_secret_digest())
    for step in range(start + 1, cfg["steps"] + 1):
        time.sleep(float(os.environ.get("STANDIN_STEP_S", "0.2")))
        if stop:
            if rank_id == 0:
                ckpt.write_text(json.dumps({"step": step - 1}))
            _record(event="checkpoint", step=step - 1)
            return 0
        print(f"rank {rank_id} step {step}", flush=True)
    _record(event="done", step=cfg["steps"])
    return 0


def main() -> int:
    sub, args = sys.argv[1], sys.argv[2:]
    if sub not in ("train", "rollout-server", "eval", "convert"):
        return rank(sys.argv[1:])
    if sub == "train":
        return prepare(args)
    _record(event=sub)
    if sub == "rollout-server":
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        while True:
            time.sleep(1)
    if sub == "eval":
        Path(_option(args, "--output")).write_text("{}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
