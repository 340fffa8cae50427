"""Cost of strict device groups (megatron_gtpo/parallel/strict.py) on a train step.

Runs the same tiny GTPO train step (tests/dist/scripts/_trainstep_common.py model and batch: one
forward/backward (GTPO in one pass), DDP grad reduction, Adam) on a gloo world with
MEGATRON_GTPO_STRICT_DEVICE_GROUPS=0 and =1, alternating launches, and prints the median and
fastest step time of each plus the collectives strict mode checked per step. On a shared 2-core
machine the fastest step is the stable statistic.

    python bench/strict_overhead.py [--layout 2,1] [--steps 20] [--rounds 2]
    python bench/strict_overhead.py --quick          # one launch each, 1 timed step (the suite's smoke run)

Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout
from bench.quick import parse_quick  # noqa: E402

QUICK = {"steps": 1, "rounds": 1}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def worker(tp: int, pp: int, steps: int) -> None:
    import torch
    import torch.distributed as dist

    from megatron_gtpo.algo import AlgoConfig
    from megatron_gtpo.parallel import strict
    from megatron_gtpo.parallel.dims import init_distributed
    from megatron_gtpo.train import model as M
    from megatron_gtpo.train.optim import OptimConfig, build_optimizer, wrap_ddp
    from types import SimpleNamespace

    from megatron_gtpo.train.step import StepSettings, train_step
    from tests.dist.scripts import _trainstep_common as C

    dims = init_distributed(tp=tp, pp=pp, seed=7)
    torch.manual_seed(0)
    ddp = wrap_ddp(M.build_model(C.tiny_config(tied=False), dims=dims), OptimConfig())
    optimizer, scheduler = build_optimizer(ddp, OptimConfig(), total_steps=steps + 3)
    batch = C.make_batch(0)
    settings = StepSettings(spec=AlgoConfig(name="gtpo").resolve(max_completion_tokens=16), micro_batch_size=2,
                            temperature=1.0)
    policy = SimpleNamespace(chunks=ddp, optimizer=optimizer, scheduler=scheduler)
    times = []
    for i in range(steps + 3):  # 3 warm-up steps
        before = sum(strict.CHECKED.values())
        start = time.perf_counter()
        train_step(policy, batch, settings, dims)
        times.append(time.perf_counter() - start)
        checked = sum(strict.CHECKED.values()) - before
    if dims.rank == 0:
        print("RESULT " + json.dumps({"strict": strict.active(), "times": times[3:], "checked_per_step": checked,
                                      "by_op": {f"{k[0]}@{k[1]}": v for k, v in strict.CHECKED.items()}}))
    dist.barrier()


def launch(layout: str, steps: int, strict: str) -> dict:
    tp, pp = (int(x) for x in layout.split(","))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "MEGATRON_GTPO_STRICT_DEVICE_GROUPS": strict}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={tp * pp}", f"--master_port={free_port()}",
           __file__, "--worker", layout, "--steps", str(steps)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise SystemExit(f"launch failed (rc={proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    return json.loads(lines[0][7:])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layout", default="2,1", help="tp,pp (world = tp*pp ranks)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per launch (after 3 warm-up steps)")
    parser.add_argument("--rounds", type=int, default=2, help="launches per setting, alternating off/on")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parse_quick(parser, argv, QUICK)
    if args.worker:
        tp, pp = (int(x) for x in args.worker.split(","))
        return worker(tp, pp, args.steps)
    times: dict[str, list[float]] = {"0": [], "1": []}
    checked = None
    for _ in range(args.rounds):
        for strict in ("0", "1"):
            result = launch(args.layout, args.steps, strict)
            print(f"strict={strict}: step ms {[round(1e3 * t) for t in result['times']]}", flush=True)
            times[strict] += result["times"]
            checked = result if strict == "1" else checked
    summary = {f"strict={k}": {"median_ms": 1e3 * statistics.median(v), "min_ms": 1e3 * min(v), "steps": len(v)}
               for k, v in times.items()}
    summary["median_overhead"] = summary["strict=1"]["median_ms"] / summary["strict=0"]["median_ms"] - 1
    summary["min_overhead"] = summary["strict=1"]["min_ms"] / summary["strict=0"]["min_ms"] - 1
    summary["checked_per_step"] = checked["checked_per_step"]
    summary["checked_by_op_total"] = checked["by_op"]
    print(json.dumps({"layout": args.layout, **summary}))


if __name__ == "__main__":
    main()
