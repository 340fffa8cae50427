"""The guarded unpickler of torch's object collectives (megatron_gtpo/parallel/unpickle.py, issue #34):
what distributed checkpointing sends arrives equal; what would call code is refused before it runs.
Over real gloo ranks: tests/dist/test_security_control_plane.py."""

from __future__ import annotations

import builtins
import io
import os
import pickle
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.distributed import distributed_c10d

from megatron_gtpo.parallel import unpickle


def _load(data: bytes):
    return unpickle.GuardedUnpickler(io.BytesIO(data)).load()


def _checkpoint_values():
    """What Megatron-Core's and torch's distributed checkpointing exchange (the globals recorded
    from this suite's checkpoint tests, plus the neighbours of each kind)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import (LoadItemType, LoadPlan, ReadItem, SavePlan, TensorWriteData,
                                                      WriteItem, WriteItemType)
    from torch.distributed.checkpoint.storage import WriteResult

    index = MetadataIndex("decoder.w", torch.Size([0, 4]), 1)
    chunk = ChunkStorageMetadata(torch.Size([0, 4]), torch.Size([2, 4]))
    write = WriteItem(index, WriteItemType.SHARD, TensorWriteData(chunk, TensorProperties(torch.bfloat16),
                                                                  torch.Size([4, 4])))
    read = ReadItem(LoadItemType.TENSOR, index, torch.Size([0]), index, torch.Size([0]), torch.Size([2]))
    sharded = ShardedTensor.from_rank_offsets("decoder.w", torch.ones(2, 4), (0, 0, 2)).without_data()
    return [SavePlan([write], storage_data={"x": 1}), LoadPlan([read]), WriteResult(index, 8, _StorageInfo("f", 0, 8)),
            sharded, ShardedObject("rng", None, (2,), (0,), replica_id=0), torch.arange(5, dtype=torch.bfloat16),
            torch.nn.Parameter(torch.ones(3)), torch.strided, torch.float8_e4m3fn, torch.device("cpu"),
            np.random.RandomState(0).get_state(), np.float32(1.5), {1, 2}, frozenset({3}), slice(1, 9, 2),
            1 + 2j, bytearray(b"ab"), b"\x00\xff", __import__("collections").OrderedDict(a=1)]


@pytest.mark.parametrize("protocol", [2, pickle.DEFAULT_PROTOCOL, pickle.HIGHEST_PROTOCOL])
def test_security_checkpoint_exchange_values_arrive_equal(protocol):
    for value in _checkpoint_values():
        got = _load(pickle.dumps(value, protocol=protocol))
        if isinstance(value, torch.Tensor):
            assert type(got) is type(value) and got.dtype == value.dtype and torch.equal(got, value)
        elif isinstance(value, tuple) and value and isinstance(value[0], str):  # numpy's RNG state
            assert got[0] == value[0] and np.array_equal(got[1], value[1]) and got[2:] == value[2:]
        else:
            assert got == value or repr(got) == repr(value), (value, got)


class _Call:
    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return (self.fn, self.args)


def _bombs(marker: Path):
    """Pickles that run code when a plain unpickler reads them, each through another door."""
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    yield "Path.touch", _Call(Path.touch, marker)
    yield "os.system", _Call(os.system, f"touch {marker}")
    yield "eval", _Call(builtins.eval, f"open({str(marker)!r}, 'w')")
    yield "getattr", _Call(builtins.getattr, marker, "touch")  # the gadget that reaches a method (no effect alone)
    yield "subprocess", _Call(subprocess.Popen, ["touch", str(marker)])
    yield "a function of a record module", _Call(save_config, CheckpointingConfig("x"), str(marker.parent))
    yield "a non-record class of a record module", _Call(FileSystemWriter, marker)  # no effect alone
    # nested: a legitimate record whose field is a bomb
    from torch.distributed.checkpoint.planner import SavePlan
    yield "inside a SavePlan", SavePlan([], storage_data=_Call(Path.touch, marker))


def test_security_code_in_a_pickle_is_refused_before_it_runs(tmp_path):
    marker = tmp_path / "ran"
    for name, bomb in _bombs(marker):
        data = pickle.dumps(bomb)
        with pytest.raises(pickle.UnpicklingError, match="refused to unpickle"):
            _load(data)
        assert not marker.exists() and not (tmp_path / "metadata.json").exists(), name


def test_security_tensor_bytes_are_loaded_weights_only(tmp_path):
    """A tensor's storage arrives as torch.save bytes, which torch's own ``_load_from_bytes`` reads
    with a full unpickler; here torch's weights-only loader reads them: a torch.save'd bomb is
    refused. Injected: ``_tensor_bytes`` calling ``torch.load(weights_only=False)`` -> the marker
    appears, the test fails."""
    marker = tmp_path / "ran"
    saved = io.BytesIO()
    torch.save(_Call(Path.touch, marker), saved)
    data = pickle.dumps(_Call(torch.storage._load_from_bytes, saved.getvalue()))
    with pytest.raises(pickle.UnpicklingError):
        _load(data)
    assert not marker.exists()


def test_security_install_guards_the_collectives_decoder(tmp_path, monkeypatch):
    """``install`` is what torch's object collectives decode with (their ``_tensor_to_object``);
    without it the same bytes run (the negative control: the marker appears)."""
    marker = tmp_path / "ran"
    data = pickle.dumps(_Call(Path.touch, marker))
    tensor = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    monkeypatch.setattr(distributed_c10d, "_unpickler", pickle.Unpickler)
    assert not unpickle.installed()
    distributed_c10d._tensor_to_object(tensor, len(data), None)
    assert marker.exists()
    marker.unlink()
    unpickle.install()
    assert unpickle.installed()
    with pytest.raises(pickle.UnpicklingError, match="pathlib"):
        distributed_c10d._tensor_to_object(tensor, len(data), None)
    assert not marker.exists()
