"""Checks, on a real GPU, the rules that strict device groups (megatron_gtpo/parallel/strict.py)
emulate on CPU: which collectives NCCL and gloo accept with host and device tensors.

    python bench/gpu_nccl_rules.py            # needs CUDA; a world of one rank (NCCL + a gloo group)
    python bench/gpu_nccl_rules.py --help

For each op x group (nccl, gloo) x tensor placement (host, device) it runs the op and records
whether the backend accepted it, next to what strict mode predicts (``strict.predicted_error``).
Prints one JSON line: every case, ``unsafe`` (the backend refuses what strict mode lets through:
a bug that CPU tests would miss) and ``conservative`` (strict mode refuses what the backend
accepts: CPU tests are stricter than needed). A world of one rank is all one GPU allows (NCCL
refuses two ranks on one device), so point-to-point ops are not covered, and gloo's behaviour with
CUDA tensors across several ranks is not either. Exit status 1 when a case is unsafe.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

OPS = ("all_reduce", "broadcast", "all_gather_into_tensor", "all_gather", "reduce_scatter_tensor", "reduce",
       "gather")


def run_op(name: str, group, device) -> str | None:
    """Runs ``name`` on ``group`` with tensors on ``device``; None when accepted, else the error."""
    import torch
    import torch.distributed as dist

    t = torch.ones(4, device=device)
    calls = {
        "all_reduce": lambda: dist.all_reduce(t, group=group),
        "broadcast": lambda: dist.broadcast(t, src=0, group=group),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(torch.empty(4, device=device), t, group=group),
        "all_gather": lambda: dist.all_gather([torch.empty(4, device=device)], t, group=group),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(torch.empty(4, device=device), t, group=group),
        "reduce": lambda: dist.reduce(t, dst=0, group=group),
        "gather": lambda: dist.gather(t, [torch.empty(4, device=device)], dst=0, group=group),
    }
    try:
        calls[name]()
        if device != "cpu":
            torch.cuda.synchronize()
        return None
    except Exception as err:  # what the backend says is the result being recorded
        return f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the same check (it takes seconds on a GPU already)")
    parser.parse_args(argv)
    import torch
    import torch.distributed as dist

    from megatron_gtpo.parallel.strict import predicted_error

    if not torch.cuda.is_available():
        print("gpu_nccl_rules: needs CUDA", file=sys.stderr)
        return 2
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    groups = {"nccl": None, "gloo": dist.new_group(backend="gloo")}
    cases, unsafe, conservative = [], [], []
    for name in OPS:
        for kind, group in groups.items():
            for place, device in (("host", "cpu"), ("device", "cuda")):
                error = run_op(name, group, device)
                predicted = predicted_error(name, group_kind="device" if kind == "nccl" else "host", host=place == "host")
                case = {"op": name, "group": kind, "tensor": place, "accepted": error is None, "error": error,
                        "strict_raises": predicted}
                cases.append(case)
                if error is not None and not predicted:
                    unsafe.append(case)
                elif error is None and predicted:
                    conservative.append(case)
    objects = None
    try:
        dist.broadcast_object_list([{"a": 1}], src=0)
    except Exception as err:
        objects = f"{type(err).__name__}: {err}"
    print(json.dumps({"torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version())),
                      "gpu": torch.cuda.get_device_name(0), "cases": cases, "unsafe": unsafe,
                      "conservative": conservative,
                      "object_collective_on_nccl": objects or "accepted"}))
    dist.destroy_process_group()
    return 1 if unsafe else 0


if __name__ == "__main__":
    sys.exit(main())
