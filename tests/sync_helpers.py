"""Weight-sync pieces only tests use: pushes given as ready tensors, the whole model as HF buckets,
and the engines plus their weight sync built in one call, as the driver builds them."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Literal

import torch

from megatron_gtpo.parallel import control
from megatron_gtpo.parallel.dims import ParallelDims
from megatron_gtpo.rollout.config import RolloutConfig
from megatron_gtpo.rollout.group import RolloutGroup
from megatron_gtpo.rollout.placement import build_engines
from megatron_gtpo.sync.base import ExportPlan, PushSource, WeightSync
from megatron_gtpo.sync.build import build_weight_sync
from megatron_gtpo.sync.config import SyncConfig
from megatron_gtpo.sync.export import Exporter
from megatron_gtpo.sync.shards import BucketPlan, Mode, TensorMeta, aligned


def build_rollout(rollout: RolloutConfig, sync: SyncConfig, *, model_dir: str,
                  export: ExportPlan) -> tuple[RolloutGroup, WeightSync]:
    """The engines and the weight sync that feeds them, as ``trainer.build`` makes them."""
    engines = build_engines(rollout, sync.placement(), model_dir=model_dir)
    return engines, build_weight_sync(sync, export, engines.engine)


class ListSource(PushSource):
    """A push given as ready HF tensors: every rank holds all of them."""

    def __init__(self, buckets: Iterable[list[tuple[str, torch.Tensor]]]):
        self.items = [item for bucket in buckets for item in bucket]

    def metas(self, mode: Mode) -> list[TensorMeta]:
        return [TensorMeta(name=n, shape=tuple(t.shape), dtype=str(t.dtype)) for n, t in self.items]

    def tensors(self, mode: Mode) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.items

    def buckets(self, bucket_bytes: int) -> list[BucketPlan]:
        out, current, size = [], [], 0
        for index, (name, tensor) in enumerate(self.items):
            if current and size + tensor.nbytes > bucket_bytes:
                out.append(BucketPlan(index=len(out), owner=0, entries=tuple(i for i, _ in current),
                                      tensors=tuple(m for _, m in current), nbytes=size))
                current, size = [], 0
            current.append((index, TensorMeta(name=name, shape=tuple(tensor.shape), dtype=str(tensor.dtype),
                                              offset=size)))
            size += aligned(tensor.nbytes)
        if current:
            out.append(BucketPlan(index=len(out), owner=0, entries=tuple(i for i, _ in current),
                                  tensors=tuple(m for _, m in current), nbytes=size))
        return out

    def pack(self, bucket: BucketPlan, buffer: torch.Tensor | None) -> bool:
        if control.world()[0] != 0:
            return False
        for index, meta in zip(bucket.entries, bucket.tensors):
            tensor = self.items[index][1].detach().contiguous().view(-1).view(torch.uint8)
            buffer[meta.offset:meta.offset + tensor.numel()].copy_(tensor)
        return True


def export_hf_weights(model_chunks: list[torch.nn.Module], *, hf_config: dict, dims: ParallelDims,
                      bucket_bytes: int = 256 << 20,
                      dst_ranks: Literal["all", "first"] = "all") -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The whole model as buckets of ``(hf_name, full_tensor)`` (about ``bucket_bytes`` each, a
    larger tensor alone), in HF order: on every rank (``all``) or on global rank 0 (``first``);
    other ranks take part in the collectives and yield nothing. No ``lm_head`` when tied."""
    if dst_ranks not in ("all", "first"):
        raise ValueError(f"dst_ranks={dst_ranks!r}: expected 'all' or 'first'")
    bucket, size = [], 0
    for name, tensor in Exporter(model_chunks, hf_config=hf_config, dims=dims).tensors(
            "full" if dst_ranks == "all" else "first"):
        bucket.append((name, tensor))
        size += tensor.nbytes
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket
