"""The control plane's data encoding over a real gloo world (tests/dist/test_security_control_plane.py).

Usage: control_data.py MARKER_DIR
Every rank sends every payload kind of tests/unit/test_security_control_objects.py through
``control.broadcast_data`` and ``control.all_gather_data`` and compares what arrives. Then rank 0
plays a process in a peer's place: it sends, on the control group and in the control plane's own
framing (an int64 length, then the bytes), a pickle whose unpickling creates MARKER_DIR/ran.
Last, the object collectives that Megatron's and torch's distributed checkpointing still call
(torch's pickling ``broadcast_object_list``): a checkpoint plan arrives equal, and the same pickle
from rank 0 is refused by the guarded unpickler (parallel/unpickle.py) and creates MARKER_DIR/ran2.
Prints ``RESULT {"check": ..., "rank": ..., ...}`` lines.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_gtpo.parallel import control, objects
from megatron_gtpo.parallel.dims import init_distributed
from tests.unit.test_security_control_objects import RECORDS, _Marker, payloads, same


def report(**record) -> None:
    sys.stdout.flush()
    os.write(1, ("\nRESULT " + json.dumps({"rank": dist.get_rank(), **record}) + "\n").encode())


def round_trips(world: int) -> None:
    rank, last = dist.get_rank(), world - 1
    for i, value in enumerate(payloads()):
        got = control.broadcast_data(value if rank == last else None, src=last, records=RECORDS)
        everyone = control.all_gather_data(value, records=RECORDS)
        report(check="round_trip", case=i, broadcast=same(value, got), gathered=len(everyone) == world
               and all(same(value, v) for v in everyone))


def pickle_in_a_peers_place(marker: Path) -> None:
    group = control._group(None)
    if dist.get_rank() == 0:
        bomb = torch.frombuffer(bytearray(pickle.dumps(_Marker(marker))), dtype=torch.uint8)
        dist.broadcast(torch.tensor([bomb.numel()], dtype=torch.int64), src=0, group=group)
        dist.broadcast(bomb, src=0, group=group)
        outcome = "sent"
    else:
        try:
            control.broadcast_data(None, src=0)
            outcome = "accepted"
        except objects.DecodeError as err:
            outcome = f"refused: {err}"
    control.barrier()
    report(check="pickle", outcome=outcome, ran=marker.exists())


def checkpoint_object_collectives(marker: Path) -> None:
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

    plan = SavePlan([WriteItem(MetadataIndex("w", torch.Size([0, 0])), WriteItemType.SHARD)], storage_data={"x": 1})
    sent = [plan, torch.arange(4, dtype=torch.bfloat16)] if dist.get_rank() == 0 else [None, None]
    dist.broadcast_object_list(sent, src=0, group=control._group(None))  # gloo, as checkpointing uses
    report(check="plan", equal=sent[0] == plan and torch.equal(sent[1], torch.arange(4, dtype=torch.bfloat16)))
    bombs = [_Marker(marker)] if dist.get_rank() == 0 else [None]
    try:
        dist.broadcast_object_list(bombs, src=0, group=control._group(None))
        outcome = "sent" if dist.get_rank() == 0 else "accepted"
    except pickle.UnpicklingError as err:
        outcome = f"refused: {err}"
    control.barrier()
    report(check="object_collective", outcome=outcome, ran=marker.exists())


if __name__ == "__main__":
    world_size = int(os.environ["WORLD_SIZE"])
    init_distributed(tp=world_size, seed=1)
    round_trips(world_size)
    pickle_in_a_peers_place(Path(sys.argv[1]) / "ran")
    checkpoint_object_collectives(Path(sys.argv[1]) / "ran2")
