"""Weight sync: one interface, one class per transport.

    WeightSync.sync(chunks, version=step):
        Exporter (shard plan, then one parameter at a time) --push(source, version)-->
        every engine serves ``version``

The driver calls ``sync`` on every rank after the optimizer step and never asks which transport
runs; each transport declares its delivery ``mode`` (:mod:`megatron_gtpo.sync.shards`).

Contract of every transport:

* Planned, then streamed. The whole push (names, shapes, dtypes) is checked against the engines
  before any byte moves; a rejected plan raises WeightPushError on *every* rank and every engine
  keeps serving its previous version. Then the bytes stream one bucket at a time: the extra memory
  of a push on any rank is one bucket plus the largest single tensor, whatever the model size.
* All-or-nothing per transport, honestly stated. vLLM's in-place reload is not transactional.
  ``colocated`` streams straight into it: a failure after the first byte (an exporter that
  diverges from its plan, a crash inside vLLM) marks that engine broken, the step fails loudly on
  every rank, and the engine refuses to generate until a later push completes (every weight is
  rewritten, which repairs it). ``separate`` stages the push in each rollout server's host memory
  and loads it only once every server has received all of it, so a failure anywhere before that
  commit leaves every server on the previous version.
* Collective-safe. The exporter runs TP/PP collectives, so a rank whose consumer fails early still
  drains its stream: its peers would otherwise wait in a gather forever. Outcomes are agreed over
  the gloo control group, never over the (NCCL) device groups.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from megatron_gtpo.parallel import control
from megatron_gtpo.parallel.dims import ParallelDims
from megatron_gtpo.sync.checks import WeightPushError
from megatron_gtpo.sync.export import Exporter
from megatron_gtpo.sync.shards import BucketPlan, Mode, TensorMeta


@dataclass(kw_only=True)
class SyncStats:
    """What one push moved and how long it took (the first engine-holding rank's figures)."""

    version: int
    """Weight version the engines serve after the push."""
    num_tensors: int
    """HF tensors delivered to one engine rank."""
    num_bytes: int
    """Bytes delivered to one engine rank (model dtype)."""
    seconds: float
    """Wall time of ``push``: plan check, export (TP/PP collectives), transfer and vLLM's reload."""
    phases: dict[str, float] = field(default_factory=dict)
    """Wall seconds of the push's phases on this rank (``plan``, ``transfer``, ``load`` ...)."""

    @property
    def gb_per_s(self) -> float:
        return self.num_bytes / max(self.seconds, 1e-9) / 1e9

    def as_metrics(self) -> dict[str, float]:
        return {"sync/seconds": self.seconds, "sync/gb_per_s": self.gb_per_s,
                "sync/gigabytes": self.num_bytes / 1e9, "sync/version": float(self.version)}


@dataclass(frozen=True, kw_only=True)
class ExportPlan:
    """What the exporter needs to turn this rank's Megatron chunks into HF tensors."""

    hf_config: dict
    """The policy's config.json (architecture, tied embeddings, head layout)."""
    dims: ParallelDims
    """The trainer's layout and this rank's coordinates."""
    bucket_bytes: int
    """Bucket size (``sync.bucket_mb`` in bytes): bounds a push's extra memory and one transfer."""


class PushSource(ABC):
    """What a push is made of, as a transport consumes it (the :class:`Exporter`; the tests' lists)."""

    @abstractmethod
    def metas(self, mode: Mode) -> list[TensorMeta]:
        """The tensors this rank will receive in ``mode``, in order (the push plan)."""

    @abstractmethod
    def tensors(self, mode: Mode) -> Iterator[tuple[str, torch.Tensor]]:
        """Streams them (collectives on every rank, tensors on the receiving ones)."""

    @abstractmethod
    def buckets(self, bucket_bytes: int) -> list[BucketPlan]:
        """The ``senders`` push cut into buckets (identical on every rank)."""

    @abstractmethod
    def pack(self, bucket: BucketPlan, buffer: torch.Tensor | None) -> bool:
        """Writes one bucket into ``buffer`` on its sender; True there."""


PushSource.register(Exporter)


class WeightSync(ABC):
    """Moves one version of the policy weights into the rollout engines."""

    mode: Mode = "full"
    """What each rank receives from the exporter (see megatron_gtpo.sync.shards)."""

    def __init__(self, export: ExportPlan | None):
        self._export = export
        self._exporters: dict[int, Exporter] = {}

    def sync(self, model_chunks, *, version: int) -> dict[str, float]:
        """Exports the chunks (planned, then streamed) and pushes them as ``version``; called on
        every rank. Returns the ``sync/*`` metrics."""
        key = id(model_chunks[0])
        if key not in self._exporters:  # one per model: the plan is gathered once and cached
            plan = self._export
            self._exporters = {key: Exporter(model_chunks, hf_config=plan.hf_config, dims=plan.dims)}
        exporter = self._exporters[key]
        exporter.release()  # LoRA: nothing merged from the adapters of an earlier step survives
        try:
            return self.push(exporter, version=version).as_metrics()
        finally:
            exporter.release()  # nor stays allocated between pushes

    @abstractmethod
    def push(self, source: PushSource, *, version: int) -> SyncStats:
        """Delivers a whole push (every engine parameter once) and makes the engines serve
        ``version``. Called on every rank of the job at the same point."""

    @property
    def bucket_bytes(self) -> int:
        return self._export.bucket_bytes if self._export else 256 << 20

    def close(self) -> None:
        """Releases transport resources (engines are closed by their owner)."""


def drain(stream: Iterator) -> None:
    """Consumes the rest of a stream so that the exporter's collectives complete on every rank."""
    try:
        for _ in stream:
            pass
    except Exception:  # noqa: BLE001 - the first error is already being reported
        pass


def agree(error: BaseException | None, stats: SyncStats | None = None) -> SyncStats | None:
    """Makes every rank of the job reach the same outcome: raises WeightPushError everywhere if
    any rank failed, else returns the first stats any rank passed (ranks without an engine pass
    none). A no-op outside a multi-rank world."""
    outcomes = control.all_gather_data((None if error is None else f"{type(error).__name__}: {error}", stats),
                                       records=(SyncStats,))
    failures = [(rank, msg) for rank, (msg, _) in enumerate(outcomes) if msg]
    if failures:
        if isinstance(error, WeightPushError):
            raise error
        rank, msg = failures[0]
        raise WeightPushError(f"weight push failed on rank {rank}: {msg}") from error
    return next((s for _, s in outcomes if s is not None), None)


class PushTimer:
    """Wall-clock of one push and of its phases, started at construction."""

    def __init__(self) -> None:
        self.start = self._last = time.perf_counter()
        self.phases: dict[str, float] = {}

    def phase(self, name: str) -> None:
        """Closes phase ``name`` (the time since the previous phase ended)."""
        now = time.perf_counter()
        self.phases[name] = now - self._last
        self._last = now

    def stats(self, *, version: int, num_tensors: int, num_bytes: int) -> SyncStats:
        return SyncStats(version=version, num_tensors=num_tensors, num_bytes=num_bytes,
                         seconds=time.perf_counter() - self.start, phases=dict(self.phases))
