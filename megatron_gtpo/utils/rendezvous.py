"""The rendezvous of a transfer group, over authenticated channels instead of an open TCP store.

torch's ``TCPStore`` answers anyone who connects (its keys can even be listed), and gloo and NCCL
exchange their addresses and NCCL's unique id through it. Here the store lives inside the rollout
server and is reached through the server's own port (:mod:`megatron_gtpo.utils.channel`), so only
the job's processes can read or write it, and only while a transfer group is being set up:

* :class:`KeyValueHost` (the server): ``with host.open(join_id):`` around the join; store
  connections for another id, or outside that window, are refused. When the window ends every
  waiting request fails and the connections close.
* :class:`ChannelStore` (every member: the trainer's senders, the server's receiving vLLM worker): a
  ``torch.distributed.Store`` whose calls are frames on one channel. Give it to
  ``ProcessGroupGloo``/``ProcessGroupNCCL`` as any store.

Messages: the first frame is ``{"role": "store", "join": id}``, answered ``{"ok": true}`` or
``{"ok": false, "error": ...}``; then one request per frame (``op`` of :data:`OPS`, values as blobs)
and one answer per request.
"""

from __future__ import annotations

import contextlib
import datetime
import threading
import time

import torch.distributed as dist

from megatron_gtpo.utils.channel import Channel, ChannelError, SchemaError, check, connect

OPS = {
    "set": {"key": str}, "get": {"key": str}, "add": {"key": str, "amount": int}, "check": {"keys": [str]},
    "wait": {"keys": [str], "timeout_s": float}, "compare_set": {"key": str}, "delete_key": {"key": str},
    "num_keys": {},
}
"""Store requests and their fields (``set``: one blob, the value; ``compare_set``: two, expected
and desired)."""
MAX_KEYS = 4096
"""Keys of one join's space (a group of up to 1024 senders needs a few per member)."""
MAX_SPACE_BYTES = 16 << 20
"""Bytes of keys and values of one join's space (addresses and NCCL ids are a few hundred bytes each)."""


class _Space:
    """The keys of one join, with a condition every write notifies."""

    def __init__(self, timeout_s: float):
        self.data: dict[str, bytes] = {}
        self.cond = threading.Condition()
        self.closed = False
        self.timeout_s = timeout_s

    def wait_for(self, keys: list[str], timeout_s: float) -> None:
        deadline = time.monotonic() + min(timeout_s, self.timeout_s)
        with self.cond:
            while not all(k in self.data for k in keys):
                left = deadline - time.monotonic()
                if self.closed:
                    raise RuntimeError("the transfer-group rendezvous closed")
                if left <= 0:
                    raise TimeoutError(f"keys {keys} not set within {timeout_s:.0f} s")
                self.cond.wait(min(left, 1.0))


class KeyValueHost:
    """The server's side (see the module docstring)."""

    def __init__(self):
        self._spaces: dict[str, _Space] = {}
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def open(self, join_id: str, *, timeout_s: float):
        """Accepts store connections for ``join_id`` inside the block only."""
        space = _Space(timeout_s)
        with self._lock:
            self._spaces[join_id] = space
        try:
            yield space
        finally:
            with self._lock:
                self._spaces.pop(join_id, None)
            with space.cond:
                space.closed = True
                space.cond.notify_all()

    def serve(self, channel: Channel, join_id: str) -> None:
        """Answers one member's store calls until it disconnects or the join ends (in the
        connection's own thread). Raises ChannelError for a refused connection (the caller logs it)."""
        with self._lock:
            space = self._spaces.get(join_id)
        if space is None:
            channel.send({"ok": False, "error": "no transfer group is being set up under this id"})
            channel.close()
            return
        channel.send({"ok": True})
        try:
            while not space.closed:
                if not channel.poll(1.0):
                    continue
                message = channel.recv()
                try:
                    reply, blobs = _answer(space, message.header, message.blobs)
                except Exception as err:  # noqa: BLE001 - a bad request gets an error answer, the store goes on
                    reply, blobs = {"ok": False, "error": f"{type(err).__name__}: {str(err)[:500]}"}, []
                channel.send(reply, blobs)
        except ChannelError:
            pass
        finally:
            channel.close()


def _answer(space: _Space, header: dict, blobs: list) -> tuple[dict, list]:
    op = header.get("op")
    if op not in OPS:
        raise SchemaError(f"unknown store op {op!r}")
    args = {k: v for k, v in header.items() if k not in ("op", "blobs")}
    check(args, OPS[op], f"store {op}")
    if len(blobs) != {"set": 1, "compare_set": 2}.get(op, 0):
        raise SchemaError(f"store {op}: wrong number of blobs ({len(blobs)})")
    if op in ("get", "wait"):
        space.wait_for([args["key"]] if op == "get" else args["keys"], args.get("timeout_s", space.timeout_s))
    with space.cond:
        data = space.data
        if op in ("set", "add", "compare_set"):
            _check_room(data, args["key"], blobs)
        if op == "set":
            data[args["key"]] = bytes(blobs[0])
        elif op == "add":
            current = data.get(args["key"], b"0")
            if not current.isdigit() and not (current[:1] == b"-" and current[1:].isdigit()):
                raise SchemaError(f"store add: {args['key']!r} holds a value that is not an integer")
            value = int(current) + args["amount"]
            data[args["key"]] = str(value).encode()
            space.cond.notify_all()
            return {"ok": True, "value": value}, []
        elif op == "compare_set":
            current = data.get(args["key"])
            if (current is None and not blobs[0]) or current == bytes(blobs[0]):
                data[args["key"]] = current = bytes(blobs[1])
            space.cond.notify_all()
            return {"ok": True}, [current if current is not None else bytes(blobs[0])]
        elif op == "get":
            return {"ok": True}, [data[args["key"]]]
        elif op == "check":
            return {"ok": True, "value": all(k in data for k in args["keys"])}, []
        elif op == "delete_key":
            return {"ok": True, "value": data.pop(args["key"], None) is not None}, []
        elif op == "num_keys":
            return {"ok": True, "value": len(data)}, []
        space.cond.notify_all()
    return {"ok": True}, []


def _check_room(data: dict[str, bytes], key: str, blobs: list) -> None:
    """Refuses a write that would take the space past :data:`MAX_KEYS` or :data:`MAX_SPACE_BYTES`."""
    if key not in data and len(data) >= MAX_KEYS:
        raise SchemaError(f"store: more than {MAX_KEYS} keys in one transfer-group rendezvous")
    used = sum(len(k) + len(v) for k, v in data.items())
    if used + len(key) + sum(len(b) for b in blobs) + 32 > MAX_SPACE_BYTES:
        raise SchemaError(f"store: more than {MAX_SPACE_BYTES} bytes in one transfer-group rendezvous")


class ChannelStore(dist.Store):
    """A member's store (see the module docstring): connects to the server at ``host:port`` with
    the job's ``secret`` and retries until the server opened ``join_id`` (within ``timeout_s``)."""

    def __init__(self, host: str, port: int, *, secret: bytes, join_id: str, timeout_s: float):
        super().__init__()
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        deadline, last = time.monotonic() + timeout_s, ""
        while True:
            try:  # refused before the handshake (the server's per-address cap): retried like a closed window
                channel = connect(host, port, secret)
            except ConnectionError as err:
                channel, last = None, str(err)
            if channel is not None:
                channel.send({"role": "store", "join": join_id})
                reply = channel.recv(timeout_s=min(timeout_s, 60.0)).header
                if reply.get("ok") is True:
                    self._channel = channel
                    return
                channel.close()
                last = reply.get("error", "refused")
            if time.monotonic() > deadline:
                raise RuntimeError(f"transfer-group rendezvous at {host}:{port} did not open within "
                                   f"{timeout_s:.0f} s ({last})")
            time.sleep(0.2)

    def _call(self, op: str, blobs=(), **fields) -> tuple[dict, list]:
        with self._lock:
            try:
                self._channel.send({"op": op, **fields}, blobs)
                message = self._channel.recv(timeout_s=self._timeout_s + 5.0)
            except ChannelError as err:
                raise RuntimeError(f"transfer-group rendezvous lost ({err})") from None
        if message.header.get("ok") is not True:
            raise RuntimeError(f"transfer-group rendezvous: {message.header.get('error', 'refused')}")
        return message.header, message.blobs

    def set(self, key, value) -> None:
        self._call("set", [_bytes(value)], key=key)

    def get(self, key) -> bytes:
        return bytes(self._call("get", key=key)[1][0])

    def add(self, key, amount) -> int:
        return int(self._call("add", key=key, amount=int(amount))[0]["value"])

    def check(self, keys) -> bool:
        return bool(self._call("check", keys=list(keys))[0]["value"])

    def wait(self, keys, timeout=None) -> None:
        seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else self._timeout_s
        self._call("wait", keys=list(keys), timeout_s=float(seconds))

    def compare_set(self, key, expected, desired) -> bytes:
        return bytes(self._call("compare_set", [_bytes(expected), _bytes(desired)], key=key)[1][0])

    def delete_key(self, key) -> bool:
        return bool(self._call("delete_key", key=key)[0]["value"])

    def num_keys(self) -> int:
        return int(self._call("num_keys")[0]["value"])

    def set_timeout(self, timeout) -> None:
        self._timeout_s = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)

    def close(self) -> None:
        self._channel.close()


def _bytes(value) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)
