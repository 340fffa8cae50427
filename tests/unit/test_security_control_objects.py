"""parallel/objects.py: the data-only encoding of the trainer ranks' control plane (issue #34, S5).
The same values over a real 2-rank gloo world, and a pickle sent in a peer's place, are in
tests/dist/test_security_control_plane.py."""

from __future__ import annotations

import math
import pickle
from pathlib import Path

import numpy as np
import pytest

from megatron_gtpo.checkpoint.files import FileRecord
from megatron_gtpo.parallel import objects
from megatron_gtpo.reward.pool import RewardFunctionCrashed
from megatron_gtpo.sync.base import SyncStats
from megatron_gtpo.types import Completion


def payloads() -> list:
    """One of each kind the package's control-plane calls send (see their call sites)."""
    experts = np.arange(24, dtype=np.int16).reshape(4, 3, 2)
    completion = Completion(prompt_index=3, prompt_token_ids=[1, 2, 3], token_ids=list(range(100)),
                            logprobs=[-0.1 * i for i in range(100)], text="x = 2", finish_reason="length",
                            truncated=True, weight_version=7, routed_experts=experts)
    return [
        None, True, 0, -(2 ** 70), 1.5, "ü", [], (), {},
        {"loss": 0.25, "optim/grad_norm": math.nan, "max": math.inf, "min": -math.inf},  # step metrics
        ([[0.0, 1.0]], [[False, True]], {"reward/failed": 0.0}),  # the collector's scores
        (0, [completion]),  # a shard of completions
        {3: "digest", 1: "other"},  # bucket digests by index
        [(2, Path("/runs/x/checkpoints/step_00000002"))],  # step dirs
        ({"a.distcp": FileRecord(10, "ab")}, 0.5),  # hashed files
        (None, SyncStats(version=1, num_tensors=2, num_bytes=3, seconds=0.5, phases={"plan": 0.1})),
        [((0, 1), (2, 3))],  # process group ranks
        [1.0] * 100 + [2],  # a long list that is not all floats: element by element
        [2 ** 64] * 70,  # ints beyond int64
    ]


RECORDS = (Completion, FileRecord, SyncStats)


def same(a, b) -> bool:
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if hasattr(a, "__dataclass_fields__"):
        return same(vars(a), vars(b))
    return a == b


@pytest.mark.parametrize("value", payloads(), ids=lambda v: type(v).__name__)
def test_security_every_control_plane_payload_round_trips_exactly(value):
    back = objects.decode(objects.encode(value, records=RECORDS), records=RECORDS)
    assert same(value, back), (value, back)


def test_security_floats_ints_and_arrays_keep_their_exact_values_and_types():
    floats = [0.1 * i for i in range(200)] + [math.nan, 1e-310]
    back = objects.decode(objects.encode(floats))
    assert [repr(x) for x in back] == [repr(x) for x in floats]  # bit-exact, NaN and subnormal included
    assert objects.decode(objects.encode([True] * 100)) == [True] * 100  # bools stay bools, not ints
    big = np.array([[1.5, -2.0]], dtype=">f8")  # a big-endian array arrives with the same values
    assert np.array_equal(objects.decode(objects.encode(big)), big)


def test_security_exceptions_arrive_as_the_listed_class_or_as_peer_error():
    err = objects.decode(objects.encode(RewardFunctionCrashed("the reward died")), records=(RewardFunctionCrashed,))
    assert type(err) is RewardFunctionCrashed and str(err) == "the reward died"
    other = objects.decode(objects.encode(KeyError("k")))
    assert type(other) is objects.PeerError and str(other) == "KeyError: 'k'"


def test_security_only_data_and_listed_records_encode_or_decode():
    """A class the receiver did not list is never built (a sender cannot choose what the receiver
    constructs), and what is not data is refused before it is sent."""
    data = objects.encode(FileRecord(1, "x"), records=(FileRecord,))
    with pytest.raises(objects.DecodeError, match="record 'FileRecord' was not listed"):
        objects.decode(data)
    for value in (FileRecord(1, "x"), object(), len, {1, 2}, np.array([object()]), b"raw"):
        with pytest.raises(TypeError, match="not encodable"):
            objects.encode(value)


class _Marker:
    """Unpickling it creates a file: the proof that pickled bytes would have run code."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


def test_security_pickled_or_malformed_bytes_are_refused_and_run_nothing(tmp_path):
    """A peer that sends a pickle, in place of the encoding, gets a DecodeError and runs nothing
    (injected: decode() falling back to pickle.loads -> the marker file appears, the test fails)."""
    marker = tmp_path / "ran"
    bomb = pickle.dumps(_Marker(marker))
    framed = len(bomb).to_bytes(8, "big") + bomb  # even behind a well-formed length prefix
    good = objects.encode({"a": [1.0] * 100})
    def frame(header: bytes, blobs: bytes = b"") -> bytes:
        return len(header).to_bytes(8, "big") + header + blobs

    cases = [bomb, framed, b"", b"\0" * 7, good[:-1], good + b"x", frame(b"{" * 100_000),
             frame(b'{"v":{"zz":1},"b":[]}'), frame(b'{"v":{"t":1,"d":2},"b":[]}'), frame(b'{"v":1,"b":[-1]}'),
             frame(b'{"v":NaN,"b":[]}'), frame(b'{"v":{"i":5},"b":[]}'), frame(b'{"v":1,"b":[8]}', b"\0" * 7),
             frame(b'{"v":{"i":0},"b":[3]}', b"abc"), frame(b'{"v":{"a":["object",[1],0]},"b":[8]}', b"\0" * 8),
             frame(b'{"v":{"d":[[[1],2]]},"b":[]}'), frame(b'[1]'), frame(b'{"v":1}')]
    for data in cases:
        with pytest.raises(objects.DecodeError):
            objects.decode(data)
    assert not marker.exists()
    pickle.loads(bomb)  # the control: the same bytes do run code when unpickled
    assert marker.exists()
