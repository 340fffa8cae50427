"""Weight sync: one interface, one class per transport.

    WeightSync.sync(chunks, version=step):
        Megatron chunks --export_hf_weights (TP gather, PP collect)--> buckets of (HF name, full tensor)
            --push(buckets, version)--> every engine serves `version`, or none changes

The driver calls ``sync`` on every rank after the optimizer step and never asks which transport runs;
each transport says which ranks need full tensors (``dst_ranks``, handed to the exporter).

Contract of every transport:
* All-or-nothing. The whole push is checked against the engine's parameters (names, shapes,
  floating dtype) before vLLM is touched; a rejected push raises WeightPushError on *every* rank and
  the engines keep serving the previous version.
* Collective-safe. The exporter's buckets come from TP/PP collectives, so a rank that fails early
  still drains the remaining buckets: its peers would otherwise wait in a gather forever.
* Stage, then swap. The pushed tensors are held until the push is complete and checked (one extra
  copy of the weights in the engine dtype: by reference for colocated, in the engine process for
  separate), then loaded in one vLLM in-place reload.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from megatron_gtpo.parallel import control
from megatron_gtpo.parallel.dims import ParallelDims
from megatron_gtpo.sync.checks import Bucket, WeightPushError
from megatron_gtpo.sync.export import export_hf_weights


@dataclass(kw_only=True)
class SyncStats:
    """What one push moved and how long it took (rank 0's figures, identical on every rank)."""

    version: int
    """Weight version the engines serve after the push."""
    num_tensors: int
    """HF tensors delivered."""
    num_bytes: int
    """Bytes delivered, in the engine dtype."""
    seconds: float
    """Wall time of ``push``: draining the bucket iterator (so the export, when the buckets are
    produced lazily), checking, transfer and vLLM's reload."""

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
    """Bucket size: bounds the extra memory of a gather and of one transfer."""


class WeightSync(ABC):
    """Moves one version of the policy weights into the rollout engines."""

    dst_ranks: str = "all"
    """Which ranks must receive full tensors from the exporter: ``all`` or ``first``."""

    def __init__(self, export: ExportPlan):
        self._export = export

    def sync(self, model_chunks, *, version: int) -> dict[str, float]:
        """Exports the chunks (lazily, bucket by bucket) and pushes them as ``version``; called on
        every rank. Returns the ``sync/*`` metrics."""
        plan = self._export
        buckets = export_hf_weights(model_chunks, hf_config=plan.hf_config, dims=plan.dims,
                                    bucket_bytes=plan.bucket_bytes, dst_ranks=self.dst_ranks)
        return self.push(buckets, version=version).as_metrics()

    @abstractmethod
    def push(self, buckets: Iterable[Bucket], *, version: int) -> SyncStats:
        """Delivers a whole push (every engine parameter once) and makes the engines serve
        ``version``. Called on every rank of the job with that rank's exporter output."""

    def close(self) -> None:
        """Releases transport resources (engines are closed by their owner)."""


def drain(buckets: Iterator[Bucket]) -> None:
    """Consumes the remaining buckets so that the exporter's collectives complete on every rank."""
    for _ in buckets:
        pass


def agree(error: BaseException | None, stats: SyncStats | None = None) -> SyncStats | None:
    """Makes every rank of the job reach the same outcome: raises WeightPushError everywhere if
    any rank failed, else returns the first stats any rank passed (ranks without an engine pass
    none). A no-op outside a multi-rank world."""
    outcomes = control.all_gather_object((None if error is None else f"{type(error).__name__}: {error}", stats))
    failures = [(rank, msg) for rank, (msg, _) in enumerate(outcomes) if msg]
    if failures:
        if isinstance(error, WeightPushError):
            raise error
        rank, msg = failures[0]
        raise WeightPushError(f"weight push failed on rank {rank}: {msg}") from error
    return next((s for _, s in outcomes if s is not None), None)


class PushTimer:
    """Wall-clock of one push, started at construction."""

    def __init__(self) -> None:
        self.start = time.perf_counter()

    def stats(self, *, version: int, num_tensors: int, num_bytes: int) -> SyncStats:
        return SyncStats(version=version, num_tensors=num_tensors, num_bytes=num_bytes,
                         seconds=time.perf_counter() - self.start)
