"""The separate pool's weight traffic: the push requests on a server's control channel, and the
transfer groups that carry the bytes.

Requests (``sync/separate.py`` sends them through ``rollout.pool``; ``sync/receiver.py`` answers;
data only, schema-checked by the server)::

    join     {join, senders}            worker 0 of the server joins transfer group ``join``
    plan     {version, tensors: [{name, shape, dtype, offset}]}    the whole push, checked first
    receive  {version, buckets: [{owner, nbytes, tensors}]}        buckets of the checked plan, in
                                        order (``tensors``: how many of the plan's tensors each
                                        holds); they arrive over the transfer group into staging
    verify   {version, digests: [hex]}  every staged bucket's BLAKE2b digest (the senders', sent
                                        here over the authenticated channel) against the bytes that
                                        arrived over the unauthenticated transfer group; a mismatch
                                        drops the push (the server keeps its version)
    commit   {version}                  load the staged, verified push (serves ``version``)
    abort    {}                         drop it (keeps the served version)
    status   {}                         -> {version, staging_bytes (host, the whole server),
                                        received_bytes (per vLLM worker, all pushes so far)}

Transfer group of one server: the trainer's senders (group ranks ``0..S-1``, one per pipeline
stage) + the server's vLLM worker 0 (rank ``S``), which stages each bucket once for the whole
server (sync/staging.py). Its rendezvous is the server's authenticated store
(utils/rendezvous.py), open only during ``join``; the join ends with one small send from every
sender to worker 0, so every NCCL communicator exists before the store closes. NCCL on GPU
(device buffers, as NCCL requires), gloo on CPU. Only bucket bytes travel on the group.
"""

from __future__ import annotations

import datetime
import hashlib
from dataclasses import asdict

import torch
import torch.distributed as dist

from megatron_gtpo.sync.shards import BucketPlan, TensorMeta
from megatron_gtpo.utils.rendezvous import ChannelStore

JOIN = {"join": str, "senders": int}
PLAN = {"version": int, "tensors": [{"name": str, "shape": [int], "dtype": str, "offset": int}]}
RECEIVE = {"version": int, "buckets": [{"owner": int, "nbytes": int, "tensors": int}]}
VERIFY = {"version": int, "digests": [str]}
COMMIT = {"version": int}
ABORT: dict = {}
STATUS: dict = {}


def plan_args(version: int, metas: list[TensorMeta]) -> dict:
    """The ``plan`` request of a push."""
    return {"version": version, "tensors": [{**asdict(m), "shape": list(m.shape)} for m in metas]}


def receive_args(version: int, plan: list[BucketPlan]) -> dict:
    """The ``receive`` request: each bucket's sender stage, size and tensor count."""
    return {"version": version, "buckets": [{"owner": b.owner, "nbytes": b.nbytes, "tensors": len(b.tensors)}
                                            for b in plan]}


def bucket_digest(data) -> str:
    """BLAKE2b-256 of a packed bucket's bytes (a uint8 tensor on any device, or any buffer): what
    ``verify`` compares (one home for the sender's and the server's side)."""
    if isinstance(data, torch.Tensor):
        data = data.detach().to("cpu").contiguous().numpy()
    return hashlib.blake2b(memoryview(data).cast("B"), digest_size=32).hexdigest()


def open_group(store: dist.Store, *, prefix: str, rank: int, world: int, timeout_s: float,
               device: torch.device) -> dist.ProcessGroup:
    """A process group of ``world`` members on ``store`` under ``prefix``; blocks until all joined.
    NCCL when ``device`` is a GPU, gloo otherwise."""
    store = dist.PrefixStore(prefix, store)
    timeout = datetime.timedelta(seconds=timeout_s)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world, options)
    return dist.ProcessGroupGloo(store, rank, world, timeout)


def join_group(address: tuple[str, int], *, secret: bytes, join_id: str, senders: int, rank: int,
               timeout_s: float, device: torch.device) -> dist.ProcessGroup:
    """Joins one server's transfer group (a sender: ``rank`` < ``senders``; the server's worker 0:
    ``rank == senders``) through its authenticated rendezvous, then makes the closing send of the
    join (module docstring). The store connection is closed before returning."""
    store = ChannelStore(*address, secret=secret, join_id=join_id, timeout_s=timeout_s)
    try:
        group = open_group(store, prefix=join_id, rank=rank, world=senders + 1, timeout_s=timeout_s, device=device)
        probe = torch.zeros(1, dtype=torch.uint8, device=device)
        if rank < senders:
            group.send([probe], senders, 0).wait()
        else:
            for sender in range(senders):
                group.recv([probe], sender, 0).wait()
    finally:
        store.close()
    return group
