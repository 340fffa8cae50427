"""Strict device groups and the control plane in a gloo world of 1 or 2 ranks.

Usage: strict_groups.py checks   (TP = world size; strict or not as the environment says)
       strict_groups.py timeout  (2 ranks; parallel.timeout_s = 3: rank 1 alone enters one
                                  collective on each kind of group and must fail, not hang)
Each check prints ``RESULT {"check": name, "ok": bool, "error": str | None, ...}``; the pytest
side decides which checks must raise.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist

from megatron_gtpo.parallel import collectives, control, strict
from megatron_gtpo.parallel.dims import init_distributed


def report(**record) -> None:
    sys.stdout.flush()
    os.write(1, ("\nRESULT " + json.dumps({"rank": dist.get_rank(), **record}) + "\n").encode())


def attempt(name: str, fn) -> None:
    """Runs one check; records its value or the error it raised (and keeps going)."""
    try:
        value = fn()
        report(check=name, ok=True, error=None, value=value)
    except RuntimeError as err:
        report(check=name, ok=False, error=str(err), value=None)


def _device_tensor_checks(world: int, tp_group) -> None:
    dev = torch.ones(3, device=collectives.comm_device())
    attempt("device_allreduce_tp", lambda: dist.all_reduce(dev, group=tp_group) or dev.tolist())
    attempt("cuda_allreduce_default", lambda: _reduced(torch.ones(2, device="cuda"), None))
    attempt("moved_to_cuda_allreduce", lambda: _reduced(torch.tensor([1.0]).cuda(), tp_group))
    derived = (dev * 2).sum(0, keepdim=True)
    attempt("derived_allreduce", lambda: _reduced(derived, tp_group))
    attempt("like_device_allreduce", lambda: _reduced(torch.zeros(2, device=dev.device) + 1, tp_group))
    gathered = torch.empty(world * 3, device=collectives.comm_device())
    attempt("device_all_gather_into_tensor", lambda: dist.all_gather_into_tensor(gathered, dev, group=tp_group)
            or gathered.numel())
    host = torch.tensor([1.0])
    host.cuda()  # the original stays a host tensor, as on a GPU
    attempt("host_after_cuda_copy", lambda: _reduced(host, tp_group))
    attempt("cpu_of_device", lambda: _reduced(dev.cpu(), tp_group))
    attempt("host_derived", lambda: _reduced(torch.zeros(2) + 1, tp_group))


def _reduced(tensor, group):
    dist.all_reduce(tensor, group=group)
    return tensor.tolist()


def checks() -> None:
    world = int(os.environ["WORLD_SIZE"])
    dims = init_distributed(tp=world, seed=1)
    from megatron.core import parallel_state as ps

    tp_group = ps.get_tensor_model_parallel_group()
    report(check="strict_active", ok=strict.active(), error=None, value=strict.active())
    # the historic bug patterns: a host flag on the default group, objects on a device group
    attempt("host_allreduce_default", lambda: _reduced(torch.tensor([1.0]), None))
    attempt("broadcast_object_list_tp", lambda: _broadcast_object_list([{"a": dims.rank}], tp_group))
    attempt("all_gather_object_default", lambda: _all_gather_object_default(world))
    attempt("host_allreduce_tp", lambda: _reduced(torch.tensor([1.0]), tp_group))
    # the same data through the control plane
    attempt("control_any_rank", lambda: control.any_rank(dims.rank == world - 1))
    attempt("control_broadcast_data", lambda: control.broadcast_data({"rank": dims.rank}, src=world - 1))
    attempt("control_all_gather_data", lambda: control.all_gather_data(dims.rank))
    attempt("control_reduce_floats", lambda: [control.reduce_floats([dims.rank, -dims.rank], op) for op in
                                              ("min", "max", "sum")])
    attempt("control_twin_dp", lambda: control.reduce_floats([1.0], "sum", over=ps.get_data_parallel_group()))
    attempt("control_barrier", control.barrier)
    gloo = dist.new_group(backend="gloo")  # like Megatron's *_GLOO groups: a host group
    attempt("host_allreduce_gloo", lambda: _reduced(torch.tensor([2.0]), gloo))
    attempt("object_on_gloo", lambda: _broadcast_object_list([dims.rank], gloo))
    _device_tensor_checks(world, tp_group)
    dev = torch.ones(2, device=collectives.comm_device())
    attempt("device_all_gather_on_control", lambda: dist.all_gather([torch.empty_like(dev) for _ in range(world)],
                                                                    dev, group=gloo))


def _broadcast_object_list(box: list, group):
    dist.broadcast_object_list(box, src=0, group=group)
    return box


def _all_gather_object_default(world: int):
    out = [None] * world
    dist.all_gather_object(out, dist.get_rank())
    return out


def timeouts() -> None:
    """Rank 1 enters, alone, one collective on each kind of group; each must fail after ~3 s."""
    dims = init_distributed(tp=2, seed=1, timeout_s=3)
    from megatron.core import parallel_state as ps

    store = dist.distributed_c10d._get_default_store()
    if dims.rank == 0:  # never joins; waits (on the rendezvous store) until rank 1 is done
        deadline = time.monotonic() + 120
        while not store.check(["strict_groups_done"]) and time.monotonic() < deadline:
            time.sleep(0.2)
        report(check="idle", ok=True, error=None, value=None)
        os._exit(0)
    tp_group = ps.get_tensor_model_parallel_group()
    cases = [("default", lambda: dist.all_reduce(torch.ones(1, device="cuda"))),
             ("control", control.barrier),
             ("megatron_tp", lambda: dist.all_reduce(torch.ones(1, device="cuda"), group=tp_group))]
    for name, fn in cases:
        start = time.perf_counter()
        try:
            fn()
            error = None
        except RuntimeError as err:
            error = str(err)[:300]
        report(check=f"timeout_{name}", ok=error is None, error=error, value=time.perf_counter() - start)
    store.set("strict_groups_done", "1")
    os._exit(0)


if __name__ == "__main__":
    {"checks": checks, "timeout": timeouts}[sys.argv[1]]()
