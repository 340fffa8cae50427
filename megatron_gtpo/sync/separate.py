"""Separate transport: weights go from the trainer ranks that own them straight to every rollout server.

    every rank    the push plan: buckets of whole parameters of one pipeline stage (shards.plan_buckets)
    rank 0        waits for a generate call in flight (``rollout.staleness: 1`` without partial
                  rollouts): it finishes on the weights it started with, then the push begins; jobs
                  (``staleness`` >= 2 or ``rollout.partial``) are not waited for: each server pauses
                  its generation for the commit and applies the job's partial mode (rollout/inflight.py)
    rank 0        ``plan`` to every server: the whole push checked before any byte moves
    senders       TP rank 0 of the first weight copy (DP x CP rank 0) of each stage gathers its stage's buckets one at a time
                  into one reused buffer and sends each bucket **once per server**, to the server's
                  vLLM worker 0 (one transfer group per server: NCCL on GPU, gloo on CPU), all
                  servers at once
    servers       stage what arrives once per server in shared host memory (sync/staging.py); every
                  vLLM worker of the server loads its part from there at the commit
    rank 0        every rank reports its failures and its buckets' digests (gloo control group);
                  ``verify`` on every server (the staged bytes against the digests, which travel
                  over the authenticated channel); commit everywhere, or abort everywhere: a push
                  that fails anywhere before the commit (a corrupted bucket included) leaves every
                  server on its previous version, and the step fails naming the failed server's host

Traffic per push: one copy of the model per server from the senders (the sum of the buckets'
packed sizes), whatever the engine TP. The pool is reached only through its declared protocol
(:class:`~megatron_gtpo.rollout.protocol.ServerPool`: ``servers``, ``secret_path``, ``drain``,
``post``, ``collect``); the requests are those of ``sync/wire.py``.

A sender whose export fails keeps sending (its buffer's stale bytes) so that no server waits for a
bucket that never comes; the push is aborted anyway. A server that dies is skipped by the senders
(the others still get the whole push, then drop it). The one window that is not all-or-nothing is
the commit itself (each server's local reload from its own staging): a server that dies there is
reported, while the others may already serve the new version.
"""

from __future__ import annotations

import uuid

import torch

from megatron_gtpo.errors import ServerError, WeightPushError
from megatron_gtpo.parallel import control
from megatron_gtpo.parallel.collectives import comm_device
from megatron_gtpo.rollout.protocol import ServerPool
import megatron_gtpo.sync.wire as wire
from megatron_gtpo.sync.base import ExportPlan, PushSource, PushTimer, SyncStats, WeightSync
from megatron_gtpo.sync.shards import BucketPlan, push_bytes
from megatron_gtpo.utils.secret import load_secret


class PoolSync(WeightSync):
    """Pushes into every server of a pool (``pool`` is None except on rank 0)."""

    mode = "senders"

    def __init__(self, pool: ServerPool | None, export: ExportPlan, *, timeout_s: float):
        super().__init__(export)
        self._pool, self._timeout = pool, timeout_s
        dims = export.dims
        self.servers = control.broadcast_data(pool.servers() if pool else None)
        """(address, hello info) of every server, on every rank."""
        self._stage = dims.pp_rank if dims.tp_rank == 0 and dims.first_copy else None
        self.sent_bytes = 0
        """Bytes this rank sent to the servers so far (all pushes; 0 on non-senders)."""
        secret_file = control.broadcast_data(str(pool.secret_path) if pool else None)
        self._groups = self._join(join_id=control.broadcast_data(f"mgtpo-{uuid.uuid4().hex}"), stages=dims.pp,
                                  secret_file=secret_file)

    def _join(self, *, join_id: str, stages: int, secret_file: str) -> list:
        """One transfer group per server: the senders (group ranks 0..stages-1) and the server's
        worker 0 (rank ``stages``). Every server joins in parallel; any failure fails every rank."""
        failures = self._pool.post("join", {"join": join_id, "senders": stages}) if self._pool else {}
        groups, error = [], None
        if self._stage is not None:
            try:
                secret = load_secret(secret_file)
                for address, _ in self.servers:
                    host, _, port = address.rpartition(":")
                    groups.append(wire.join_group((host, int(port)), secret=secret, join_id=join_id, senders=stages,
                                                  rank=self._stage, timeout_s=self._timeout, device=comm_device()))
            except Exception as err:  # noqa: BLE001 - every rank raises it below
                error = f"{type(err).__name__}: {err}"
        if self._pool is not None:
            failures.update(self._pool.collect())
        failures = {k: v for part in control.all_gather_data(failures) for k, v in part.items()}
        errors = [e for e in control.all_gather_data(error) if e]
        if failures or errors:
            listed = "; ".join([f"{where}: {msg}" for where, msg in failures.items()] + errors)
            raise ServerError(f"the rollout servers' transfer groups could not be set up: {listed}")
        return groups

    def push(self, source: PushSource, *, version: int) -> SyncStats:
        waited = self._finish_generation()
        timer = PushTimer()
        plan = source.buckets(self.bucket_bytes)
        metas = [m for bucket in plan for m in bucket.tensors]
        self._decide(waited or self._on_servers("plan", wire.plan_args(version, metas)), version)
        timer.phase("plan")
        failures = self._pool.post("receive", wire.receive_args(version, plan)) if self._pool else {}
        digests: dict[int, str] = {}
        failures.update(self._stream(source, plan, skip=failures, digests=digests))
        if self._pool is not None:  # every answer, so none is left pending (a dead server's fails at once)
            failures.update(self._pool.collect())
        failures = {k: v for part in control.all_gather_data(failures) for k, v in part.items()}
        digests = {k: v for part in control.all_gather_data(digests) for k, v in part.items()}
        timer.phase("transfer")  # export, packing, the sends and every server's staging
        if not failures:  # what arrived over the unauthenticated transfer groups is what was sent
            failures = self._on_servers("verify", {"version": version, "digests": [digests[b.index] for b in plan]})
        if failures:
            self._on_servers("abort", {}, skip=failures, timeout_s=60)
            self._decide(failures, version, what="aborted on every server; they keep serving the previous version")
        self._decide(self._on_servers("commit", {"version": version}), version, what="commit failed")
        timer.phase("load")  # every server's vLLM reload from its staging
        return timer.stats(version=version, num_tensors=len(metas), num_bytes=push_bytes(metas))

    def _finish_generation(self) -> dict[str, str]:
        """Rank 0: waits for a generate call in flight (one-step-off rollouts without partial
        rollouts), which thus ends on the weights it started with; its failure, by address (the push
        is then refused everywhere). A pool of jobs has none: they go on across the push."""
        try:
            if self._pool is not None:
                self._pool.drain()
        except (ServerError, WeightPushError) as err:
            return {"generate call in flight": str(err)}
        return {}

    def _stream(self, source: PushSource, plan: list[BucketPlan], *, skip: dict, digests: dict[int, str]
                ) -> dict[str, str]:
        """Packs and sends every bucket (senders), or takes part in the packing gathers; a sender
        records each bucket's digest (of the bytes it sends) in ``digests``."""
        failures: dict[str, str] = dict(skip)
        mine = [b.nbytes for b in plan if b.owner == self._stage]
        buffer = torch.empty(max(mine), dtype=torch.uint8, device=comm_device()) if mine else None
        for bucket in plan:
            try:
                sender = source.pack(bucket, buffer)
            except Exception as err:  # noqa: BLE001 - still send: the servers wait for this bucket
                sender = bucket.owner == self._stage
                failures[f"export on rank {control.world()[0]}"] = f"{type(err).__name__}: {err}"
            if sender:
                digests[bucket.index] = wire.bucket_digest(buffer[:bucket.nbytes])
                self._send(buffer[:bucket.nbytes], failures)
        return failures

    def _send(self, data: torch.Tensor, failures: dict[str, str]) -> None:
        """One bucket to every live server at once: one send per server, to its worker 0."""
        works, receiver = [], self._export.dims.pp
        for (address, _), group in zip(self.servers, self._groups):
            if address in failures:
                continue
            try:
                works.append((address, group.send([data], receiver, 0)))
            except RuntimeError as err:
                failures[address] = f"send failed: {err}"
        for address, work in works:
            try:
                work.wait()
                self.sent_bytes += data.numel()
            except RuntimeError as err:
                failures.setdefault(address, f"send failed: {err}")

    def _on_servers(self, op: str, args: dict, *, skip: dict | None = None, timeout_s: float | None = None
                    ) -> dict[str, str]:
        """Rank 0 sends ``op`` to every server (not in ``skip``) at once, then collects every answer,
        so the servers work in parallel; the failures by address (empty on other ranks)."""
        if self._pool is None:
            return {}
        skip = dict(skip or {})
        failures = self._pool.post(op, args, skip=skip)
        failures.update(self._pool.collect(skip={**skip, **failures}, timeout_s=timeout_s))
        return failures

    def _decide(self, failures: dict[str, str], version: int, what: str = "rejected before any byte moved") -> None:
        """Rank 0's verdict on every rank: raises WeightPushError naming each failed server."""
        failures = control.broadcast_data(failures)
        if failures:
            listed = "; ".join(f"{where}: {msg}" for where, msg in failures.items())
            raise WeightPushError(f"weight push v{version} {what}. Failed: {listed}")

    def close(self) -> None:
        self._groups = []
