"""Separate transport: weights go from the trainer ranks that own them straight to every rollout server.

    every rank    the push plan: buckets of whole parameters of one pipeline stage (shards.plan_buckets)
    rank 0        waits for a generate call in flight (``rollout.staleness: 1``): it finishes on the
                  weights it started with, then the push begins (a server serves one version at a time)
    rank 0        ("plan", ...) to every server: the whole push checked before any byte moves
    senders       TP rank 0 of DP replica 0 of each stage gathers its stage's buckets one at a time
                  into one reused buffer and sends each to every server (one transfer group per
                  server: NCCL on GPU, gloo on CPU), all servers at once
    servers       stage what arrives in host memory (sync/receiver.py), answer "received"
    rank 0        every rank reports its failures (gloo control group); commit everywhere, or abort
                  everywhere: a push that fails anywhere before the commit leaves every server on
                  its previous version, and the step fails naming the failed server's host

A sender whose export fails keeps sending (its buffer's stale bytes) so that no server waits for a
bucket that never comes; the push is aborted anyway. A server that dies is skipped by the senders
(the others still get the whole push, then drop it). The one window that is not all-or-nothing is
the commit itself (each server's local reload from its own staging): a server that dies there is
reported, while the others may already serve the new version.
"""

from __future__ import annotations

import uuid
from dataclasses import asdict

import torch

from megatron_gtpo.parallel.collectives import comm_device
from megatron_gtpo.parallel import control
from megatron_gtpo.sync.base import ExportPlan, PushSource, PushTimer, SyncStats, WeightSync
from megatron_gtpo.sync.checks import WeightPushError
from megatron_gtpo.rollout.pool import RolloutPool, ServerError
from megatron_gtpo.sync.shards import BucketPlan, push_bytes
from megatron_gtpo.sync.wire import open_group, tcp_store


class PoolSync(WeightSync):
    """Pushes into every server of a :class:`RolloutPool` (``pool`` is None except on rank 0)."""

    mode = "senders"

    def __init__(self, pool: RolloutPool | None, export: ExportPlan, *, timeout_s: float):
        super().__init__(export)
        self._pool, self._timeout = pool, timeout_s
        dims = export.dims
        self.servers = control.broadcast_object([(link.address, link.info) for link in pool.links] if pool else None)
        """(address, hello info) of every server, on every rank."""
        self._stage = dims.pp_rank if dims.tp_rank == 0 and dims.first_copy else None
        self._groups = self._join(prefix=control.broadcast_object(f"mgtpo-{uuid.uuid4().hex}"), stages=dims.pp)

    def _join(self, *, prefix: str, stages: int) -> list:
        """One transfer group per server: the senders (group ranks 0..stages-1) and the server's
        vLLM workers (the next ``tp`` ranks). Every server joins in parallel."""
        if self._pool is not None:
            for index, link in enumerate(self._pool.links):
                link.send(("join", f"{prefix}/{index}", stages + link.info["tp"], stages))
        groups = []
        if self._stage is not None:
            for index, (address, info) in enumerate(self.servers):
                host, _, port = address.rpartition(":")
                store = tcp_store(host, int(port) + 1, is_master=False, timeout_s=self._timeout)
                groups.append(open_group(store, prefix=f"{prefix}/{index}", rank=self._stage, world=stages + info["tp"],
                                         timeout_s=self._timeout, device=comm_device()))
        if self._pool is not None:
            for link in self._pool.links:
                link.recv()
        return groups

    def push(self, source: PushSource, *, version: int) -> SyncStats:
        waited = self._finish_generation()
        timer = PushTimer()
        plan = source.buckets(self.bucket_bytes)
        metas = [m for bucket in plan for m in bucket.tensors]
        self._decide(waited or self._on_servers(("plan", version, metas)), version)
        timer.phase("plan")
        if self._pool is not None:
            wire = [(b.owner, b.nbytes, [asdict(m) for m in b.tensors]) for b in plan]
            for link in self._pool.links:
                link.send(("receive", version, wire, {stage: stage for stage in range(self._export.dims.pp)}))
        failures = self._stream(source, plan)
        if self._pool is not None:
            failures.update(self._on_servers(None))
        failures = {k: v for part in control.all_gather_object(failures) for k, v in part.items()}
        timer.phase("transfer")  # export, packing, the sends and every server's staging
        if failures:
            self._on_servers(("abort",), skip=failures, timeout_s=60)
            self._decide(failures, version, what="aborted on every server; they keep serving the previous version")
        self._decide(self._on_servers(("commit", version)), version, what="commit failed")
        timer.phase("load")  # every server's vLLM reload from its staging
        return timer.stats(version=version, num_tensors=len(metas), num_bytes=push_bytes(metas))

    def _finish_generation(self) -> dict[str, str]:
        """Rank 0: waits for a generate call in flight (one-step-off rollouts), which thus ends on the
        weights it started with; its failure, by address (the push is then refused everywhere)."""
        try:
            if self._pool is not None:
                self._pool.drain()
        except (ServerError, WeightPushError) as err:
            return {"generate call in flight": str(err)}
        return {}

    def _stream(self, source: PushSource, plan: list[BucketPlan]) -> dict[str, str]:
        """Packs and sends every bucket (senders), or takes part in the packing gathers."""
        failures: dict[str, str] = {}
        mine = [b.nbytes for b in plan if b.owner == self._stage]
        buffer = torch.empty(max(mine), dtype=torch.uint8, device=comm_device()) if mine else None
        for bucket in plan:
            try:
                sender = source.pack(bucket, buffer)
            except Exception as err:  # noqa: BLE001 - still send: the servers wait for this bucket
                sender = bucket.owner == self._stage
                failures[f"export on rank {control.world()[0]}"] = f"{type(err).__name__}: {err}"
            if sender:
                self._send(buffer[:bucket.nbytes], failures)
        return failures

    def _send(self, data: torch.Tensor, failures: dict[str, str]) -> None:
        """One bucket to every live server at once."""
        works, stages = [], self._export.dims.pp
        for (address, info), group in zip(self.servers, self._groups):
            if address in failures:
                continue
            try:
                works += [(address, group.send([data], stages + worker, 0)) for worker in range(info["tp"])]
            except RuntimeError as err:
                failures[address] = f"send failed: {err}"
        for address, work in works:
            try:
                work.wait()
            except RuntimeError as err:
                failures.setdefault(address, f"send failed: {err}")

    def _on_servers(self, request: tuple | None, *, skip: dict | None = None, timeout_s: float | None = None
                    ) -> dict[str, str]:
        """Rank 0 sends ``request`` to every server (not in ``skip``) at once, then collects every
        answer (``request`` None: only collects), so the servers work in parallel; returns the
        failures by address."""
        links = [k for k in (self._pool.links if self._pool is not None else []) if not (skip and k.address in skip)]
        failures: dict[str, str] = {}
        for link in links if request is not None else []:
            try:
                link.send(request)
            except ServerError as err:
                failures[link.address] = str(err)
        for link in links:
            if link.address not in failures:
                try:
                    link.recv(timeout_s)
                except (ServerError, WeightPushError) as err:
                    failures[link.address] = str(err)
        return failures

    def _decide(self, failures: dict[str, str], version: int, what: str = "rejected before any byte moved") -> None:
        """Rank 0's verdict on every rank: raises WeightPushError naming each failed server."""
        failures = control.broadcast_object(failures)
        if failures:
            listed = "; ".join(f"{where}: {msg}" for where, msg in failures.items())
            raise WeightPushError(f"weight push v{version} {what}. Failed: {listed}")

    def close(self) -> None:
        self._groups = []
