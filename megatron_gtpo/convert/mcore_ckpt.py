"""Streaming reader/writer of Megatron-Core ``torch_dist`` model checkpoints without a model.

The writer emits exactly the keys, global shapes and per-layer chunks that
``GPTModel.sharded_state_dict()`` produces at TP=1/PP=1 (layer tensors stacked under
``decoder.layers.*`` with the layer as leading axis; ``linear_fc1`` as a gate chunk and an up
chunk; an empty ``_extra_state`` object per linear module), so Megatron's
``dist_checkpointing.load`` reads it into a model at *any* TP/PP/VPP layout: it reshards at load
time (megatron_cpu.md section 6). Tensors are produced one at a time by a callback while
torch.distributed.checkpoint writes them (one IO thread), so peak memory is one fused tensor.

The reader pulls single chunks (one layer of one key) out of any torch_dist checkpoint, including
training checkpoints that also hold optimizer state, again without building a model.
No process group is needed for either.
"""

from __future__ import annotations

import io
import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

# Written next to the DCP files: what Megatron's loader checks to pick the torch_dist backend.
MEGATRON_METADATA = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                     "common_backend": "torch", "common_backend_version": 1}


@dataclass(frozen=True)
class Chunk:
    """One stored piece of a checkpoint tensor."""

    key: str
    """Dist-checkpoint key (e.g. ``decoder.layers.mlp.linear_fc2.weight``)."""
    global_shape: tuple[int, ...]
    """Shape of the whole stacked/unsharded tensor."""
    offsets: tuple[int, ...]
    """Where this chunk starts in the global tensor."""
    sizes: tuple[int, ...]
    """Shape of this chunk."""
    dtype: torch.dtype
    """Stored dtype (kept from the source checkpoint)."""


@dataclass(frozen=True)
class ObjectItem:
    """A pickled object stored under ``key`` (Megatron's ShardedObject, e.g. ``_extra_state``)."""

    key: str
    """Full storage key, ``<name>/shard_<offset>_<global shape>`` as Megatron spells it."""
    value: object
    """Object to ``torch.save``."""


class _StreamingSavePlanner(DefaultSavePlanner):
    """Plans the given chunks directly and produces each chunk's data only when it is written."""

    def __init__(self, chunks: list[tuple[Chunk, Callable[[], torch.Tensor]]], objects: list[ObjectItem]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._produce = {(c.key, c.offsets): fn for c, fn in chunks}
        self._chunks = {(c.key, c.offsets): c for c, _ in chunks}
        self._objects = {o.key: o.value for o in objects}
        self.error: BaseException | None = None
        """First exception raised while producing data (DCP would report it only as a wrapper)."""

    def create_local_plan(self) -> SavePlan:
        items = [WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO) for key in self._objects]
        for chunk in self._chunks.values():
            items.append(WriteItem(
                index=MetadataIndex(chunk.key, torch.Size(chunk.offsets)), type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(chunk.offsets), sizes=torch.Size(chunk.sizes)),
                    properties=TensorProperties(dtype=chunk.dtype), size=torch.Size(chunk.global_shape))))
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem):
        try:
            return self._resolve(write_item)
        except BaseException as err:
            self.error = self.error or err
            raise

    def _resolve(self, write_item: WriteItem):
        if write_item.type == WriteItemType.BYTE_IO:
            buffer = io.BytesIO()
            # Megatron stores the list of the ShardedObjects' data under one key (one per chunk here).
            torch.save([self._objects[write_item.index.fqn]], buffer)
            buffer.seek(0)
            return buffer
        key = (write_item.index.fqn, tuple(write_item.index.offset))
        chunk = self._chunks[key]
        tensor = self._produce[key]()
        if tuple(tensor.shape) != chunk.sizes or tensor.dtype != chunk.dtype:
            raise RuntimeError(f"{chunk.key}@{chunk.offsets}: produced {tuple(tensor.shape)}/{tensor.dtype}, "
                               f"planned {chunk.sizes}/{chunk.dtype}")
        return tensor.contiguous()


def write_checkpoint(directory: str | Path, *, chunks: list[tuple[Chunk, Callable[[], torch.Tensor]]],
                     objects: list[ObjectItem], common: dict | None = None) -> None:
    """Writes a Megatron torch_dist checkpoint into the (existing, empty) ``directory``.

    ``chunks`` pairs each planned chunk with a zero-argument callable returning its tensor; DCP
    validates that the chunks of every key tile its global shape without overlap.
    """
    directory = Path(directory)
    writer = dcp.FileSystemWriter(directory, single_file_per_rank=True, thread_count=1, sync_files=True)
    planner = _StreamingSavePlanner(chunks, objects)
    try:
        with warnings.catch_warnings():  # "assuming ... a single process": that is the intent
            warnings.simplefilter("ignore", UserWarning)
            dcp.save({}, storage_writer=writer, planner=planner, no_dist=True)
    except BaseException:
        if planner.error is not None:  # single-process DCP turns it into "all_data is None"
            raise planner.error from None
        raise
    torch.save(common or {}, directory / "common.pt")
    (directory / "metadata.json").write_text(json.dumps(MEGATRON_METADATA))


class _ChunkLoadPlanner(DefaultLoadPlanner):
    """Reads the requested chunks into caller-provided tensors (overlaps resolved by DCP)."""

    def __init__(self, wanted: dict[tuple[str, tuple[int, ...]], torch.Tensor]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._wanted = wanted

    def create_local_plan(self) -> LoadPlan:
        items = []
        for (key, offsets), dest in self._wanted.items():
            stored = self.metadata.state_dict_metadata[key]
            request = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=dest.shape)
            items += create_read_items_for_chunk_list(key, stored, [request])
        return LoadPlan(items)

    def resolve_tensor(self, read_item):
        dest = self._wanted[(read_item.dest_index.fqn, tuple(read_item.dest_index.offset))]
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            dest = dest.narrow(dim, start, length)
        return dest

    def commit_tensor(self, read_item, tensor) -> None:
        pass  # resolve_tensor handed out views of the destination: the data is already in place


class CheckpointReader:
    """Chunk-wise access to a torch_dist checkpoint directory."""

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        self._reader = dcp.FileSystemReader(self.dir)
        self.metadata = self._reader.read_metadata()

    def tensor_meta(self, key: str) -> TensorStorageMetadata | None:
        """Global shape, dtype and stored chunks of tensor ``key`` (None if absent or an object)."""
        meta = self.metadata.state_dict_metadata.get(key)
        return meta if isinstance(meta, TensorStorageMetadata) else None

    def read(self, requests: dict[tuple[str, tuple[int, ...]], tuple[int, ...]]) -> dict:
        """``{(key, offsets): sizes}`` -> ``{(key, offsets): tensor}`` in the stored dtype."""
        wanted = {}
        for (key, offsets), sizes in requests.items():
            meta = self.tensor_meta(key)
            if meta is None:
                raise KeyError(f"{self.dir}: checkpoint has no tensor {key!r}")
            wanted[(key, offsets)] = torch.empty(sizes, dtype=meta.properties.dtype)
        reader = dcp.FileSystemReader(self.dir)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({}, storage_reader=reader, planner=_ChunkLoadPlanner(wanted), no_dist=True)
        return wanted
