"""Transfer groups of the separate rollout pool: one process group per server, outside the trainer's world.

    members: the trainer's senders (ranks 0..S-1, one per pipeline stage) + the server's vLLM
             workers (ranks S..S+k-1 for an engine of TP=k)
    rendezvous: a TCP store the server hosts at ``server_port + 1``, under a per-session prefix
    bytes: one packed bucket per point-to-point send (``megatron_gtpo.sync.shards.BucketPlan``)

NCCL on GPU (device buffers, as NCCL requires), gloo on CPU. Only bucket bytes travel here; the
push plan, the versions and the outcomes go over the server's control connection.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

AUTHKEY = b"megatron-gtpo-rollout"
"""Shared key of a server's control connection (guards against stray connections, not attackers:
run the servers on the cluster's private network)."""


def tcp_store(host: str, port: int, *, is_master: bool, timeout_s: float) -> dist.TCPStore:
    """Rendezvous store; the master binds ``port`` (0 = any free port, read back from ``.port``)."""
    return dist.TCPStore(host, port, is_master=is_master, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s), use_libuv=True)


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

