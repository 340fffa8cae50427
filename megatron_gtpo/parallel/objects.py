"""Data-only encoding of the control plane's values: what trainer ranks send each other over gloo.

torch's object collectives (``broadcast_object_list``, ``all_gather_object``, ...) pickle on one
rank and unpickle on the others, so a process that reached a rank's gloo sockets in a peer's place
could run code in it (issue #34, S5). Here a value becomes bytes that decode to data only: a JSON
tree plus raw numeric blobs, and the only classes ever built on decode are the ones the caller
names in ``records`` (dataclasses built from their fields, exceptions from their message).

Layout of an encoded value::

    header_len u64 (big-endian) | header: UTF-8 JSON {"v": tree, "b": [blob bytes, ...]} | blobs

What the tree holds: ``None``, ``bool``, ``int``, ``str`` and finite ``float`` as JSON literals, a
``list`` as a JSON array, and everything else as a JSON object with exactly one key, the tag:

    {"f": "nan" | "inf" | "-inf"}             a non-finite float
    {"t": [...]}                              a tuple
    {"d": [[key, value], ...]}                a dict (any hashable key the tree can hold)
    {"p": "..."}                              a pathlib.Path
    {"a": [dtype, shape, blob]}               a numpy array of a numeric dtype
    {"i": blob} / {"g": blob}                 a long list of only ints / only floats (int64 / float64)
    {"r": [name, {field: value, ...}]}        a dataclass listed in ``records``
    {"e": [name, message]}                    an exception: the listed class of that name, else PeerError

Anything else (another class, a tensor, a function) is refused when encoding, with a TypeError.
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
from collections.abc import Sequence
from pathlib import Path

import numpy as np

_LEN = struct.Struct(">Q")
_DTYPES = frozenset({"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                     "float16", "float32", "float64"})
_BULK = 64  # lists at least this long of only ints or only floats travel as one blob (speed, exact floats)
_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


class PeerError(RuntimeError):
    """An exception another rank sent whose class the receiver did not list: its name and message."""


class DecodeError(ValueError):
    """Bytes that are not an encoded value (a framing, JSON or tag error)."""


def encode(value, *, records: Sequence[type] = ()) -> bytes:
    """``value`` as bytes (see the module docstring); dataclasses must be among ``records``."""
    blobs: list[bytes] = []
    tree = _Encoder({cls.__name__: cls for cls in records}, blobs).tree(value)
    header = json.dumps({"v": tree, "b": [len(b) for b in blobs]}, allow_nan=False,
                        separators=(",", ":")).encode()
    return b"".join([_LEN.pack(len(header)), header, *blobs])


def decode(data: bytes | memoryview, *, records: Sequence[type] = ()):
    """The value ``data`` encodes; builds no class but those in ``records`` (and PeerError)."""
    data = memoryview(data)
    if len(data) < _LEN.size:
        raise DecodeError(f"{len(data)} bytes: shorter than the length prefix")
    (size,) = _LEN.unpack(data[:_LEN.size])
    end = _LEN.size + size
    if end > len(data):
        raise DecodeError(f"header of {size} bytes declared, {len(data) - _LEN.size} present")
    try:
        header = json.loads(bytes(data[_LEN.size:end]), parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as err:
        raise DecodeError(f"bad header: {type(err).__name__}: {err}") from None
    sizes = header.get("b") if isinstance(header, dict) and set(header) == {"v", "b"} else None
    if not isinstance(sizes, list) or not all(type(n) is int and n >= 0 for n in sizes) or \
            end + sum(sizes) != len(data):
        raise DecodeError("header and blob sizes do not match the data")
    blobs, at = [], end
    for n in sizes:
        blobs.append(data[at:at + n])
        at += n
    try:
        return _Decoder({cls.__name__: cls for cls in records}, blobs).value(header["v"])
    except (ValueError, KeyError, TypeError, IndexError, RecursionError) as err:
        raise DecodeError(f"bad value: {type(err).__name__}: {err}") from None


def _refuse_constant(name: str):
    raise ValueError(f"JSON constant {name} (non-finite floats travel tagged)")


class _Encoder:
    def __init__(self, records: dict[str, type], blobs: list[bytes]):
        self.records, self.blobs = records, blobs

    def blob(self, data: bytes) -> int:
        self.blobs.append(data)
        return len(self.blobs) - 1

    def tree(self, v):
        if v is None or isinstance(v, (bool, str)) or type(v) is int:
            return v
        if type(v) is float:
            return v if math.isfinite(v) else {"f": repr(v)}
        if type(v) is list:
            return self.sequence(v)
        if type(v) is tuple:
            return {"t": [self.tree(x) for x in v]}
        if type(v) is dict:
            return {"d": [[self.tree(k), self.tree(x)] for k, x in v.items()]}
        if isinstance(v, Path):
            return {"p": str(v)}
        if isinstance(v, np.ndarray):
            return self.array(v)
        if isinstance(v, (np.integer, np.floating, np.bool_)):
            return self.tree(v.item())
        if isinstance(v, BaseException):
            return {"e": [type(v).__name__, str(v)]}
        if dataclasses.is_dataclass(v) and self.records.get(type(v).__name__) is type(v):
            return {"r": [type(v).__name__, {f.name: self.tree(getattr(v, f.name))
                                             for f in dataclasses.fields(v) if f.init}]}
        raise TypeError(f"the control plane carries data only: {type(v).__qualname__} is not encodable "
                        "(dataclasses must be passed in records=)")

    def sequence(self, v: list):
        if len(v) >= _BULK:  # one C-level conversion instead of a JSON number per element
            if all(type(x) is int for x in v):
                try:
                    return {"i": self.blob(np.asarray(v, dtype=np.int64).tobytes())}
                except OverflowError:  # an int beyond 64 bits: JSON holds it
                    pass
            elif all(type(x) is float for x in v):
                return {"g": self.blob(np.asarray(v, dtype=np.float64).tobytes())}
        return [self.tree(x) for x in v]

    def array(self, v: np.ndarray):
        if v.dtype.name not in _DTYPES:
            raise TypeError(f"numpy dtype {v.dtype} is not encodable (numeric dtypes only)")
        little = v.astype(v.dtype.newbyteorder("<"), copy=False)
        return {"a": [v.dtype.name, list(v.shape), self.blob(np.ascontiguousarray(little).tobytes())]}


class _Decoder:
    def __init__(self, records: dict[str, type], blobs: list[memoryview]):
        self.records, self.blobs = records, blobs

    def value(self, t):
        if t is None or isinstance(t, (bool, int, float, str)):
            return t
        if isinstance(t, list):
            return [self.value(x) for x in t]
        if not isinstance(t, dict) or len(t) != 1:
            raise ValueError(f"not a value: {str(t)[:80]}")
        ((tag, body),) = t.items()
        if tag == "f":
            return _NONFINITE[body]
        if tag == "t":
            return tuple(self.value(x) for x in _list(body))
        if tag == "d":
            return {self.value(k): self.value(x) for k, x in _list(body)}
        if tag == "p":
            return Path(_str(body))
        if tag in ("i", "g"):
            return np.frombuffer(self.blob(body), dtype="<i8" if tag == "i" else "<f8").tolist()
        if tag == "a":
            return self.array(*_list(body))
        if tag == "r":
            return self.record(*_list(body))
        if tag == "e":
            return self.error(*_list(body))
        raise ValueError(f"unknown tag {tag!r}")

    def blob(self, index) -> memoryview:
        if type(index) is not int or not 0 <= index < len(self.blobs):
            raise ValueError(f"no blob {index!r}")
        return self.blobs[index]

    def array(self, dtype: str, shape: list, blob: int) -> np.ndarray:
        if dtype not in _DTYPES:
            raise ValueError(f"dtype {dtype!r} is not allowed")
        # a private, writable copy: the receive buffer is reused and frombuffer is read-only
        out = np.frombuffer(self.blob(blob), dtype=np.dtype(dtype).newbyteorder("<")).astype(dtype)
        return out.reshape([int(n) for n in _list(shape)])

    def record(self, name: str, fields: dict):
        cls = self.records.get(_str(name))
        if cls is None:
            raise ValueError(f"record {name!r} was not listed by the receiver")
        if not isinstance(fields, dict) or set(fields) != {f.name for f in dataclasses.fields(cls) if f.init}:
            raise ValueError(f"record {name!r}: fields do not match {cls.__qualname__}")
        return cls(**{k: self.value(v) for k, v in fields.items()})

    def error(self, name: str, message: str) -> BaseException:
        cls = self.records.get(_str(name))
        if isinstance(cls, type) and issubclass(cls, BaseException):
            return cls(_str(message))
        return PeerError(f"{_str(name)}: {_str(message)}")


def _list(body) -> list:
    if not isinstance(body, list):
        raise ValueError(f"expected a JSON array, got {type(body).__name__}")
    return body


def _str(body) -> str:
    if not isinstance(body, str):
        raise ValueError(f"expected a JSON string, got {type(body).__name__}")
    return body
