"""Inputs of the rollout server's fuzz test (test_security_rollout_server.py), and how each is sent.

Every case is one connection from a source address of its own in 127/8 (so the per-address cap on
pending handshakes does not refuse the trainer's own reconnects), and each returns an
:class:`Outcome`: what came back before the server ended the connection, and how long that took, as
the client measured it with a timeout well above the server's limits. A case whose connection the
server did not end within that timeout reports ``ended=False``: a client timeout never passes for a
refusal.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import pickle
import random
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass

from megatron_gtpo.utils import channel as ch

CLIENT_TIMEOUT_S = 20.0
"""Longest a case waits for the server to end its connection (4x the handshake limit)."""


@dataclass
class Outcome:
    kind: str
    """Which generator made the case."""
    reply: bytes
    """Every byte the server sent."""
    ended: bool
    """The server closed (or reset) the connection before the client's timeout."""
    seconds: float
    """From the last byte sent to the end of the connection."""


def _source(index: int) -> str:
    return f"127.0.{10 + index // 200}.{1 + index % 200}"


def _open(host: str, port: int, index: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((_source(index), 0))
    sock.settimeout(CLIENT_TIMEOUT_S)
    sock.connect((host, port))
    return sock


def _drain(sock: socket.socket, kind: str, start: float, got: bytes = b"") -> Outcome:
    chunks, ended = [got], True
    try:
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    except TimeoutError:
        ended = False
    except OSError:  # reset by the server
        pass
    sock.close()
    return Outcome(kind, b"".join(chunks), ended, time.monotonic() - start)


def frame(send_key: bytes, seq: int, header: bytes, payload: bytes = b"", *, mac: bytes | None = None) -> bytes:
    """One frame as :class:`~megatron_gtpo.utils.channel.Channel` sends it, ``header`` taken as is."""
    fixed = struct.pack(">2sHIQ", b"MF", 0, len(header), len(payload))
    if mac is None:
        mac = hmac.new(send_key, struct.pack(">Q", seq) + fixed + header + payload, hashlib.sha256).digest()
    return fixed + header + payload + mac


# ----------------------------------------------------------------------------- before authentication

def unauthenticated(rng: random.Random, recorded: bytes) -> list[tuple[str, bytes, bool]]:
    """(kind, bytes, close the write side after sending) for one outsider each; ``recorded`` is a
    real client's handshake and first frame, replayed."""
    oversized = struct.pack(">2sHIQ", b"MF", 0, 1 << 31, 1 << 40)
    pickled = pickle.dumps({"op": "generate", "args": list(range(50))})
    makers: list[tuple[str, Callable[[], bytes]]] = [
        ("random", lambda: rng.randbytes(rng.randint(1, 4096))),
        ("empty", lambda: b""),
        ("truncated hello", lambda: ch.HELLO[:rng.randint(1, 7)]),
        ("hello, nonce cut", lambda: ch.HELLO + rng.randbytes(rng.randint(0, 31))),
        ("hello, no proof", lambda: ch.HELLO + rng.randbytes(32)),
        ("hello, wrong proof", lambda: ch.HELLO + rng.randbytes(32) + rng.randbytes(32)),
        ("hello, proof cut", lambda: ch.HELLO + rng.randbytes(32) + rng.randbytes(rng.randint(1, 31))),
        ("hello, frame without proof", lambda: ch.HELLO + rng.randbytes(32) + oversized),
        ("oversized frame", lambda: oversized),
        ("frame before hello", lambda: frame(rng.randbytes(32), 0, b'{"role":"control","blobs":[]}')),
        ("pickle", lambda: pickled),
        ("framed pickle", lambda: struct.pack("!i", len(pickled)) + pickled),
        ("http", lambda: b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"),
        ("wrong magic", lambda: b"MGTPO-H0" + rng.randbytes(64)),
        ("replayed handshake", lambda: recorded),
        ("replayed handshake, cut", lambda: recorded[:rng.randint(1, len(recorded) - 1)]),
        ("flipped replay", lambda: _flip(rng, recorded)),
    ]
    out = []
    for _ in range(700):
        kind, make = rng.choice(makers)
        out.append((kind, make(), rng.random() < 0.9))
    return out


def _flip(rng: random.Random, data: bytes) -> bytes:
    data = bytearray(data)
    data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    return bytes(data)


def send_raw(host: str, port: int, index: int, kind: str, data: bytes, close_write: bool) -> Outcome:
    """Sends ``data`` (then half-closes, or goes silent) and waits for the server to end it."""
    sock = _open(host, port, index)
    try:
        sock.sendall(data)
        if close_write:
            sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    return _drain(sock, kind, time.monotonic())


def trickle(host: str, port: int, index: int) -> Outcome:
    """A greeting one byte a second: each byte well within any per-read limit."""
    sock = _open(host, port, index)
    start = time.monotonic()
    for byte in ch.HELLO + bytes(64):
        try:
            sock.send(bytes([byte]))
        except OSError:
            break
        sock.settimeout(1.0)
        try:
            if sock.recv(4096) == b"":
                sock.settimeout(CLIENT_TIMEOUT_S)
                return Outcome("trickle", b"", True, time.monotonic() - start)
        except TimeoutError:
            pass
        except OSError:
            return Outcome("trickle", b"", True, time.monotonic() - start)
        if time.monotonic() - start > CLIENT_TIMEOUT_S:
            break
    sock.close()
    return Outcome("trickle", b"", False, time.monotonic() - start)


# ----------------------------------------------------------------------------- after authentication

def authenticated(host: str, port: int, secret: bytes, index: int) -> ch.Channel:
    """An authenticated channel from source ``index`` (its socket keeps the client's timeout)."""
    sock = _open(host, port, index)
    channel = ch.client_handshake(sock, secret, peer="fuzz")
    sock.settimeout(CLIENT_TIMEOUT_S)
    return channel


def send_frame(channel: ch.Channel, kind: str, data: bytes) -> Outcome:
    """Sends ``data`` on an authenticated connection, half-closes it and waits for the server to end it."""
    try:
        channel.sock.sendall(data)
        channel.sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    return _drain(channel.sock, kind, time.monotonic())


def bad_frames(rng: random.Random, key: bytes, seq: int) -> list[tuple[str, bytes]]:
    """(kind, bytes) of frames a peer that knows the secret may send as its frame ``seq``; each must
    end its connection (as the first frame of a connection, or on the trainer's control connection)."""
    deep = b"[" * rng.randint(50_000, 200_000)
    header = json.dumps({"op": "hello", "args": {}, "blobs": []}).encode()
    good = frame(key, seq, header)
    makers: list[tuple[str, Callable[[], bytes]]] = [
        ("deep json", lambda: frame(key, seq, deep + b"]" * len(deep))),
        ("deep json object", lambda: frame(key, seq, b'{"a":' * 60_000 + b"1" + b"}" * 60_000)),
        ("duplicate keys", lambda: frame(key, seq, b'{"op":"hello","op":"close","args":{},"blobs":[]}')),
        ("huge number", lambda: frame(key, seq, b'{"op":' + b"7" * 100_000 + b',"blobs":[]}')),
        ("not an object", lambda: frame(key, seq, b'[1,2,3]')),
        ("not utf-8", lambda: frame(key, seq, b'{"op":"\xff\xfe","blobs":[]}')),
        ("NaN", lambda: frame(key, seq, b'{"op":NaN,"blobs":[]}')),
        ("blobs do not add up", lambda: frame(key, seq, b'{"op":"hello","args":{},"blobs":[5]}', b"abc")),
        ("negative blob", lambda: frame(key, seq, b'{"op":"hello","args":{},"blobs":[-3,6]}', b"abc")),
        ("forged mac", lambda: frame(key, seq, header, mac=rng.randbytes(32))),
        ("reordered", lambda: frame(key, seq + 1, header)),
        ("replayed", lambda: good + good),
        ("wrong key", lambda: frame(rng.randbytes(32), 0, header)),
        ("oversized", lambda: struct.pack(">2sHIQ", b"MF", 0, ch.MAX_HEADER_BYTES + 1, 0)),
        ("oversized payload", lambda: struct.pack(">2sHIQ", b"MF", 0, 2, ch.MAX_PAYLOAD_BYTES + 1)),
        ("declared 1 GiB, sent 100 bytes", lambda: struct.pack(">2sHIQ", b"MF", 0, 22, 1 << 30)
         + b'{"blobs":[1073741824]}' + bytes(100)),
        ("truncated", lambda: good[:rng.randint(1, len(good) - 1)]),
        ("bad flags", lambda: b"MF\x00\x01" + good[4:]),
    ]
    return [(kind, make()) for kind, make in makers]


def bad_requests(vocab: int) -> list[tuple[str, dict, list[bytes]]]:
    """(kind, header, blobs) of well-framed requests of the wrong shape or beyond the engine's limits:
    each must get an error answer, and the connection goes on."""
    sampling = {"n": 1, "temperature": 0.0, "top_p": 1.0, "max_tokens": 4, "stop": []}
    gen = {"lengths": [2], "seeds": [1], "sampling": sampling}
    two = [struct.pack("<2i", 1, 2)]
    out = [
        ("unknown op", {"op": "run", "args": {"code": "1"}}, []),
        ("args not an object", {"op": "hello", "args": [1]}, []),
        ("no args", {"op": "hello"}, []),
        ("extra key", {"op": "hello", "args": {}, "x": 1}, []),
        ("lengths not a list", {"op": "generate", "args": {**gen, "lengths": "x"}}, two),
        ("token blob short", {"op": "generate", "args": gen}, [b"\0\0\0"]),
        ("no token blob", {"op": "generate", "args": gen}, []),
        ("zero-length prompt", {"op": "generate", "args": {**gen, "lengths": [0, 2], "seeds": [1, 2]}}, two),
        ("seeds missing", {"op": "generate", "args": {**gen, "seeds": []}}, two),
        ("n huge", {"op": "generate", "args": {**gen, "sampling": {**sampling, "n": 10**6}}}, two),
        ("n zero", {"op": "generate", "args": {**gen, "sampling": {**sampling, "n": 0}}}, two),
        ("max_tokens huge", {"op": "generate", "args": {**gen, "sampling": {**sampling, "max_tokens": 10**9}}}, two),
        ("many stops", {"op": "generate", "args": {**gen, "sampling": {**sampling, "stop": ["a"] * 10_000}}}, two),
        ("token past vocab", {"op": "generate", "args": gen}, [struct.pack("<2i", 1, vocab)]),
        ("negative token", {"op": "generate", "args": gen}, [struct.pack("<2i", -1, 2)]),
        ("top_p nan-like", {"op": "generate", "args": {**gen, "sampling": {**sampling, "top_p": 1e308}}}, two),
        ("plan of other weights", {"op": "plan", "args": {"version": 1, "tensors": [
            {"name": "x", "shape": [1 << 40], "dtype": "float32", "offset": 0}]}}, []),
        ("plan with a code dtype", {"op": "plan", "args": {"version": 1, "tensors": [
            {"name": "x", "shape": [1], "dtype": "os.system", "offset": 0}]}}, []),
        ("receive without plan", {"op": "receive", "args": {"version": 1, "buckets": [
            {"owner": 0, "nbytes": 1 << 40, "tensors": 1}]}}, []),
        ("commit without transfer", {"op": "commit", "args": {"version": 7}}, []),
        ("join with no senders", {"op": "join", "args": {"join": "j", "senders": 0}}, []),
    ]
    return out
