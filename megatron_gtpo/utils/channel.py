"""An authenticated, data-only message channel over TCP: what a rollout server's port speaks.

Nothing that arrives is ever unpickled or executed: a message is a JSON object plus raw byte blobs
(token ids, log-probs, store values), checked against a schema by its receiver. Every connection
starts with a mutual challenge-response on the job's secret (:mod:`megatron_gtpo.utils.secret`),
and every later frame carries an HMAC, so only the job's own processes can talk to each other.

Handshake (``cN``/``sN``: 32 fresh random bytes of the client/server; ``MAC(label)`` =
HMAC-SHA256(secret, label | cN | sN))::

    client -> server   HELLO | cN                 HELLO = b"MGTPO-H1" (8 bytes)
    server -> client   HELLO | sN
    client -> server   MAC(b"mgtpo client")       the server checks it: a wrong, guessed or absent
                                                  secret ends the connection here, before any frame
    server -> client   MAC(b"mgtpo server")       the client checks it: a server that does not
                                                  know the secret is refused too
    both               key(dir) = HMAC-SHA256(secret, b"mgtpo key " + dir | cN | sN), dir = c2s / s2c

Frame (either direction; ``seq`` counts that direction's frames from 0)::

    b"MF" | flags u16 = 0 | header_len u32 | payload_len u64        16 bytes, big-endian
    header    header_len bytes: a UTF-8 JSON object; ``"blobs": [n, ...]`` splits the payload
    payload   payload_len bytes of raw blobs
    mac       HMAC-SHA256(key(dir), seq u64 | the 16 bytes | header | payload), 32 bytes

Limits (:data:`MAX_HEADER_BYTES`, :data:`MAX_PAYLOAD_BYTES`) are checked on the 16 bytes, before
anything else is read; buffers then grow as bytes arrive (a declared size allocates nothing by
itself); the MAC is checked before the JSON is parsed; a frame out of order or replayed fails its
MAC; any failure of the parser (deep nesting, duplicate keys, huge numbers) is a :class:`FrameError`.
Any violation raises :class:`FrameError` and the connection must be closed (the stream cannot be
trusted after it). The payload is not encrypted: see docs/security.md.

Listening (:class:`Listener`): a connection has :data:`HANDSHAKE_TIMEOUT_S` in all to authenticate
(one deadline, however it trickles its bytes), at most :data:`MAX_PENDING` authenticate at once and
at most :data:`MAX_PENDING_PER_PEER` from one address; an authenticated connection has TCP
keep-alive (:data:`KEEPALIVE`), so a peer whose host died is noticed and its slot freed.

Schemas (:func:`check`): a type (``int``, ``float``, ``str``, ``bool``), ``None`` (JSON null), a
list ``[S]`` (every item matches S), a dict ``{"key": S, "opt?": S}`` (exactly these keys) or a
tuple ``(S1, S2)`` (any of them).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

HELLO = b"MGTPO-H1"
NONCE_BYTES = 32
MAC_BYTES = 32
HANDSHAKE_TIMEOUT_S = 10.0
"""Longest a connection may take to authenticate, all of it (a peer that stalls or trickles is dropped)."""
MAX_HEADER_BYTES = 16 << 20
"""Largest JSON header of one frame (16 MiB)."""
MAX_PAYLOAD_BYTES = 1 << 30
"""Largest blob payload of one frame (1 GiB: a generate call of ~250M prompt tokens)."""
READ_TIMEOUT_S = 120.0
"""Longest silence inside one frame once it started arriving."""
MAX_PENDING = 32
"""Connections authenticating at once; more are closed at once (a flood cannot starve the server)."""
MAX_PENDING_PER_PEER = 4
"""Connections of one address authenticating at once (one host cannot take every slot); a job's own
clients retry a refused connection."""
KEEPALIVE = (60, 10, 6)
"""TCP keep-alive of an authenticated connection: first probe after 60 s idle, then every 10 s, given
up after 6 unanswered: a half-open connection (the peer's host died) ends within ~2 min."""
_CHUNK = 1 << 20

_FRAME = struct.Struct(">2sHIQ")
_SEQ = struct.Struct(">Q")


class ChannelError(Exception):
    """A channel failed; the connection is unusable."""


class ChannelClosed(ChannelError):
    """The peer closed the connection."""


class ChannelTimeout(ChannelError):
    """No frame within the wait."""


class AuthenticationError(ChannelError):
    """The peer does not know the job's secret (or does not speak this protocol)."""


class FrameError(ChannelError):
    """A malformed, oversized or forged frame; the connection must be closed."""


class SchemaError(ValueError):
    """A message that does not have the declared shape (the frame itself was fine)."""


@dataclass
class Message:
    """One received frame: its JSON header and its blobs (views into one buffer)."""

    header: dict
    blobs: list[memoryview] = field(default_factory=list)


def _mac(secret: bytes, label: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    return hmac.new(secret, label + client_nonce + server_nonce, hashlib.sha256).digest()


def _read_exact(sock: socket.socket, nbytes: int, *, stall_s: float | None = None,
                deadline: float | None = None) -> bytearray:
    """``nbytes`` from ``sock``, in a buffer grown as they arrive (a declared size costs no memory
    until its bytes come). ``stall_s`` bounds each wait for more, ``deadline`` (``time.monotonic``)
    the whole read; else the socket's own timeout bounds each wait."""
    buffer = bytearray()
    while len(buffer) < nbytes:
        wait = stall_s if deadline is None else deadline - time.monotonic()
        if wait is not None and (wait <= 0 or not select.select([sock], [], [], wait)[0]):
            raise ChannelTimeout(f"peer stalled after {len(buffer)} of {nbytes} bytes")
        try:
            chunk = sock.recv(min(nbytes - len(buffer), _CHUNK))
        except TimeoutError:
            raise ChannelTimeout(f"peer stalled after {len(buffer)} of {nbytes} bytes") from None
        except OSError as err:
            raise ChannelClosed(f"connection lost ({err})") from None
        if not chunk:
            raise ChannelClosed(f"connection closed after {len(buffer)} of {nbytes} bytes")
        buffer += chunk
    return buffer


def _keepalive(sock: socket.socket) -> None:
    """TCP keep-alive with :data:`KEEPALIVE`'s timings (Linux options; elsewhere the system's)."""
    if sock.family not in (socket.AF_INET, socket.AF_INET6):  # a socketpair (tests) has no TCP
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in zip(("TCP_KEEPIDLE", "TCP_KEEPINTVL", "TCP_KEEPCNT"), KEEPALIVE):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


class Channel:
    """Authenticated frames over one connected socket (see the module docstring). One thread sends
    and one thread receives at a time."""

    def __init__(self, sock: socket.socket, *, send_key: bytes, recv_key: bytes, peer: str):
        self.sock, self.peer = sock, peer
        # Blocking: a send waits as long as the peer takes to read (a trainer reads a generate answer only
        # after its train step); reads bound each stall inside a frame (READ_TIMEOUT_S) with select.
        sock.settimeout(None)
        _keepalive(sock)
        self._send_key, self._recv_key = send_key, recv_key
        self._sent = self._received = 0
        self._lock = threading.Lock()

    def send(self, header: dict, blobs: Sequence[bytes | bytearray | memoryview] = ()) -> None:
        blobs = [memoryview(b).cast("B") for b in blobs]
        text = json.dumps({**header, "blobs": [b.nbytes for b in blobs]}, separators=(",", ":"),
                          allow_nan=False).encode()
        payload = sum(b.nbytes for b in blobs)
        if len(text) > MAX_HEADER_BYTES or payload > MAX_PAYLOAD_BYTES:
            raise FrameError(f"message too large to send ({len(text)} header / {payload} payload bytes; limits "
                             f"{MAX_HEADER_BYTES} / {MAX_PAYLOAD_BYTES})")
        with self._lock:
            fixed = _FRAME.pack(b"MF", 0, len(text), payload)
            mac = hmac.new(self._send_key, _SEQ.pack(self._sent) + fixed + text, hashlib.sha256)
            for blob in blobs:
                mac.update(blob)
            try:
                self.sock.sendall(fixed + text)
                for blob in blobs:
                    self.sock.sendall(blob)
                self.sock.sendall(mac.digest())
            except OSError as err:
                raise ChannelClosed(f"cannot send to {self.peer} ({err})") from None
            self._sent += 1

    def poll(self, timeout_s: float | None) -> bool:
        """True when a frame (or the end of the connection) is waiting."""
        ready, _, _ = select.select([self.sock], [], [], timeout_s)
        return bool(ready)

    def recv(self, timeout_s: float | None = None) -> Message:
        """The next frame, checked; ``timeout_s`` bounds the wait for its first byte."""
        if not self.poll(timeout_s):
            raise ChannelTimeout(f"no message from {self.peer} within {timeout_s:.0f} s")
        fixed = _read_exact(self.sock, _FRAME.size, stall_s=READ_TIMEOUT_S)
        magic, flags, header_len, payload_len = _FRAME.unpack(fixed)
        if magic != b"MF" or flags != 0:
            raise FrameError(f"not a frame (magic {magic!r}, flags {flags})")
        if header_len > MAX_HEADER_BYTES or payload_len > MAX_PAYLOAD_BYTES:
            raise FrameError(f"oversized frame refused: header {header_len} bytes (limit {MAX_HEADER_BYTES}), "
                             f"payload {payload_len} bytes (limit {MAX_PAYLOAD_BYTES})")
        text = _read_exact(self.sock, header_len, stall_s=READ_TIMEOUT_S)
        payload = memoryview(_read_exact(self.sock, payload_len, stall_s=READ_TIMEOUT_S))
        mac = _read_exact(self.sock, MAC_BYTES, stall_s=READ_TIMEOUT_S)
        want = hmac.new(self._recv_key, _SEQ.pack(self._received) + fixed + text, hashlib.sha256)
        want.update(payload)
        if not hmac.compare_digest(mac, want.digest()):
            raise FrameError("frame authentication failed (forged, corrupted, replayed or out of order)")
        self._received += 1
        header = _parse_header(text, payload_len)
        return Message(header=header, blobs=_split(payload, header["blobs"]))

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def _parse_header(text: bytes, payload_len: int) -> dict:
    try:
        header = json.loads(text, parse_constant=_no_constant, object_pairs_hook=_unique_keys)
    except Exception as err:  # noqa: BLE001 - RecursionError (deep nesting), MemoryError, ...: a bad frame, never more
        raise FrameError(f"header is not JSON ({type(err).__name__}: {str(err)[:200]})") from None
    if not isinstance(header, dict):
        raise FrameError("header is not a JSON object")
    blobs = header.get("blobs")
    if not (isinstance(blobs, list) and all(type(n) is int and n >= 0 for n in blobs) and sum(blobs) == payload_len):
        raise FrameError("header's blob lengths do not add up to the payload")
    return header


def _split(payload: memoryview, lengths: list[int]) -> list[memoryview]:
    out, start = [], 0
    for n in lengths:
        out.append(payload[start:start + n])
        start += n
    return out


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    """A JSON object whose keys are all different (``{"op": "generate", "op": "close"}`` is refused,
    not read as its last key)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError("duplicate keys in an object")
    return out


# ----------------------------------------------------------------------------- handshake

def _keys(secret: bytes, cn: bytes, sn: bytes) -> tuple[bytes, bytes]:
    return _mac(secret, b"mgtpo key c2s", cn, sn), _mac(secret, b"mgtpo key s2c", cn, sn)


def client_handshake(sock: socket.socket, secret: bytes, *, peer: str) -> Channel:
    """Authenticates a connected socket as a client. Raises ConnectionError when nothing greets
    (a server still starting, busy with other handshakes, or gone), AuthenticationError when the
    peer refuses this job's secret, does not know it, or does not speak this protocol."""
    deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
    sock.settimeout(HANDSHAKE_TIMEOUT_S)
    cn = os.urandom(NONCE_BYTES)
    try:  # nothing of ours answers (yet): a connection error, which a caller may retry
        sock.sendall(HELLO + cn)
        reply = _read_exact(sock, len(HELLO) + NONCE_BYTES, deadline=deadline)
    except (ChannelError, OSError) as err:
        raise ConnectionError(f"{peer} did not greet ({err})") from None
    if reply[:len(HELLO)] != HELLO:
        raise AuthenticationError(f"{peer} does not speak this protocol")
    sn = bytes(reply[len(HELLO):])
    try:
        sock.sendall(_mac(secret, b"mgtpo client", cn, sn))
        proof = _read_exact(sock, MAC_BYTES, deadline=deadline)
    except ChannelTimeout as err:  # a slow server, not a refusal (that closes): a caller may retry
        raise ConnectionError(f"{peer} did not answer the handshake in time ({err})") from None
    except ChannelError as err:
        raise AuthenticationError(f"{peer} refused this job's secret ({err})") from None
    except OSError as err:
        raise AuthenticationError(f"handshake with {peer} failed ({err})") from None
    if not hmac.compare_digest(proof, _mac(secret, b"mgtpo server", cn, sn)):
        raise AuthenticationError(f"{peer} does not know this job's secret")
    c2s, s2c = _keys(secret, cn, sn)
    return Channel(sock, send_key=c2s, recv_key=s2c, peer=peer)


def server_handshake(sock: socket.socket, secret: bytes, *, peer: str) -> Channel:
    """Authenticates an accepted socket as the server, within :data:`HANDSHAKE_TIMEOUT_S` in all;
    raises AuthenticationError before the peer learns anything but a random nonce."""
    deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
    sock.settimeout(HANDSHAKE_TIMEOUT_S)
    try:
        hello = _read_exact(sock, len(HELLO) + NONCE_BYTES, deadline=deadline)
        if hello[:len(HELLO)] != HELLO:
            raise AuthenticationError(f"bad greeting {bytes(hello[:len(HELLO)])!r}")
        cn, sn = bytes(hello[len(HELLO):]), os.urandom(NONCE_BYTES)
        sock.sendall(HELLO + sn)
        proof = _read_exact(sock, MAC_BYTES, deadline=deadline)
        if not hmac.compare_digest(proof, _mac(secret, b"mgtpo client", cn, sn)):
            raise AuthenticationError("wrong secret")
        sock.sendall(_mac(secret, b"mgtpo server", cn, sn))
    except AuthenticationError:
        raise
    except ChannelError as err:
        raise AuthenticationError(str(err)) from None
    except OSError as err:
        raise AuthenticationError(f"connection lost ({err})") from None
    c2s, s2c = _keys(secret, cn, sn)
    return Channel(sock, send_key=s2c, recv_key=c2s, peer=peer)


def connect(host: str, port: int, secret: bytes, *, timeout_s: float = HANDSHAKE_TIMEOUT_S) -> Channel:
    """A client channel to ``host:port``; OSError when nothing listens, AuthenticationError when the
    peer refuses (or does not know) the secret."""
    sock = socket.create_connection((host, port), timeout=timeout_s)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        return client_handshake(sock, secret, peer=f"{host}:{port}")
    except BaseException:
        sock.close()
        raise


# ----------------------------------------------------------------------------- listening

class Listener:
    """Accepts connections on ``(host, port)`` in a background thread and authenticates each in a
    short-lived thread of its own; an authenticated channel goes to ``route(channel, peer)`` in that
    thread. Refusals are logged (rate-limited) and never reach ``route``."""

    def __init__(self, host: str, port: int, secret: bytes, *, route: Callable[[Channel], None],
                 log: logging.Logger):
        self._secret, self._route, self._log = secret, route, log
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.create_server((host, port), family=family, backlog=64)
        self.address = self._sock.getsockname()[:2]
        self._pending: dict[str, int] = {}  # address -> connections authenticating
        self._pending_lock = threading.Lock()
        self._refusals = _RateLimitedLog(log)
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, name="channel-accept", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                sock, addr = self._sock.accept()
            except OSError:
                if self._closed:
                    return
                continue
            peer = f"{addr[0]}:{addr[1]}"
            refused = self._take_slot(addr[0])
            if refused:
                self._refusals.warn(peer, refused)
                sock.close()
                continue
            threading.Thread(target=self._authenticate, args=(sock, peer, addr[0]), name="channel-auth",
                             daemon=True).start()

    def _take_slot(self, host: str) -> str:
        """Counts a connection as authenticating; or the reason it may not (then nothing is counted)."""
        with self._pending_lock:
            if sum(self._pending.values()) >= MAX_PENDING:
                return f"more than {MAX_PENDING} connections authenticating at once"
            if self._pending.get(host, 0) >= MAX_PENDING_PER_PEER:
                return f"more than {MAX_PENDING_PER_PEER} connections of {host} authenticating at once"
            self._pending[host] = self._pending.get(host, 0) + 1
            return ""

    def _free_slot(self, host: str) -> None:
        with self._pending_lock:
            self._pending[host] -= 1
            if not self._pending[host]:
                del self._pending[host]

    def _authenticate(self, sock: socket.socket, peer: str, host: str) -> None:
        try:
            channel = server_handshake(sock, self._secret, peer=peer)
        except Exception as err:  # noqa: BLE001 - AuthenticationError, or anything else: this connection only
            self._refusals.warn(peer, f"unauthenticated connection refused: {err}")
            sock.close()
            return
        finally:
            self._free_slot(host)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            self._route(channel)
        except Exception as err:  # noqa: BLE001 - whatever one peer's input raises ends its connection only
            self._log.warning("connection from %s dropped: %s: %s", peer, type(err).__name__, str(err)[:500])
            channel.close()

    def refuse(self, peer: str, reason: str) -> None:
        """Logs a refusal that the route decided (rate-limited with the listener's own)."""
        self._refusals.warn(peer, reason)

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.close()
        except OSError:
            pass


class _RateLimitedLog:
    """At most ``burst`` refusal lines a minute (a flood must not fill the disk); the rest are counted."""

    def __init__(self, log: logging.Logger, burst: int = 20):
        self._log, self._burst = log, burst
        self._window, self._count, self._lock = time.monotonic(), 0, threading.Lock()

    def warn(self, peer: str, reason: str) -> None:
        with self._lock:
            now = time.monotonic()
            if now - self._window > 60:
                if self._count > self._burst:
                    self._log.warning("%d more refusals in the last minute were not logged", self._count - self._burst)
                self._window, self._count = now, 0
            self._count += 1
            if self._count <= self._burst:
                self._log.warning("refused %s: %s", peer, reason)


# ----------------------------------------------------------------------------- schemas

def check(value, schema, where: str = "message") -> None:
    """Raises SchemaError (naming the path) unless ``value`` matches ``schema`` (module docstring)."""
    if isinstance(schema, tuple):
        errors = []
        for option in schema:
            try:
                return check(value, option, where)
            except SchemaError as err:
                errors.append(str(err))
        raise SchemaError(" or ".join(errors))
    if schema is None:
        ok = value is None
    elif schema is float:
        ok = type(value) in (int, float)
    elif isinstance(schema, type):
        ok = type(value) is schema
    elif isinstance(schema, list):
        if type(value) is not list:
            raise SchemaError(f"{where} must be a list, got {type(value).__name__}")
        for i, item in enumerate(value):
            check(item, schema[0], f"{where}[{i}]")
        return
    else:
        _check_dict(value, schema, where)
        return
    if not ok:
        name = "null" if schema is None else schema.__name__
        raise SchemaError(f"{where} must be {name}, got {type(value).__name__}")


def _check_dict(value, schema: dict, where: str) -> None:
    if type(value) is not dict:
        raise SchemaError(f"{where} must be an object, got {type(value).__name__}")
    required = {k for k in schema if not k.endswith("?")}
    allowed = {k.rstrip("?"): s for k, s in schema.items()}
    unknown, missing = sorted(set(value) - set(allowed)), sorted(required - set(value))
    if unknown or missing:
        raise SchemaError(f"{where}: unknown keys {unknown}, missing keys {missing}")
    for key, item in value.items():
        check(item, allowed[key], f"{where}.{key}")
