"""The authenticated channel, the job secret and the transfer-group rendezvous (utils/channel.py,
utils/secret.py, utils/rendezvous.py), on real sockets in this process. The same channel against a real
rollout server: tests/e2e/test_security_rollout_server.py."""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading

import pytest
import torch

from megatron_gtpo.sync.wire import join_group
from megatron_gtpo.utils import channel as ch
from megatron_gtpo.utils import rendezvous
from megatron_gtpo.utils.rendezvous import ChannelStore, KeyValueHost
from megatron_gtpo.utils.secret import SecretError, load_secret, make_secret_file

SECRET = bytes(range(32))


def pair(client_secret: bytes = SECRET, server_secret: bytes = SECRET):
    """A connected (client, server) pair of channels over a socketpair, or the errors of each side."""
    a, b = socket.socketpair()
    out: dict = {}

    def serve():
        try:
            out["server"] = ch.server_handshake(b, server_secret, peer="client")
        except ch.AuthenticationError as err:
            out["server_error"] = err
            b.close()  # what the listener does

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        out["client"] = ch.client_handshake(a, client_secret, peer="server")
    except ch.AuthenticationError as err:
        out["client_error"] = err
    thread.join(10)
    return out


def test_security_channel_round_trip_with_blobs_and_both_sides_authenticated():
    out = pair()
    client, server = out["client"], out["server"]
    client.send({"op": "x", "args": {"n": 1}}, [b"abc", memoryview(bytearray(5))])
    message = server.recv(timeout_s=5)
    assert message.header == {"op": "x", "args": {"n": 1}, "blobs": [3, 5]}
    assert [bytes(b) for b in message.blobs] == [b"abc", bytes(5)]
    server.send({"ok": True})
    assert client.recv(timeout_s=5).header == {"ok": True, "blobs": []}


@pytest.mark.parametrize("guess", [b"megatron-gtpo-rollout", b"", bytes(range(7, 39))])
def test_security_a_wrong_old_or_empty_key_is_refused_before_any_frame(guess):
    out = pair(client_secret=guess)
    assert "server" not in out and "wrong secret" in str(out["server_error"])
    assert "client" not in out  # the client learns nothing but a refusal


def test_security_a_server_without_the_secret_is_refused_by_the_client():
    a, b = socket.socketpair()

    def fake_server():  # takes any proof and answers with a made-up one
        hello = b.recv(len(ch.HELLO) + ch.NONCE_BYTES)
        b.sendall(hello[:len(ch.HELLO)] + os.urandom(ch.NONCE_BYTES))
        b.recv(ch.MAC_BYTES)
        b.sendall(os.urandom(ch.MAC_BYTES))

    thread = threading.Thread(target=fake_server)
    thread.start()
    with pytest.raises(ch.AuthenticationError, match="does not know this job's secret"):
        ch.client_handshake(a, SECRET, peer="fake")
    thread.join(10)


def test_security_frames_are_checked_before_they_are_parsed():
    out = pair()
    client, server = out["client"], out["server"]
    # oversized: refused from the 16 fixed bytes, nothing else read or allocated
    client.sock.sendall(struct.pack(">2sHIQ", b"MF", 0, ch.MAX_HEADER_BYTES + 1, 0))
    with pytest.raises(ch.FrameError, match="oversized"):
        server.recv(timeout_s=5)

    out = pair()
    client, server = out["client"], out["server"]
    client.sock.sendall(struct.pack(">2sHIQ", b"MF", 0, 0, ch.MAX_PAYLOAD_BYTES + 1))
    with pytest.raises(ch.FrameError, match="oversized"):
        server.recv(timeout_s=5)

    out = pair()  # a well-formed frame with a forged MAC (an outsider injecting into the stream)
    client, server = out["client"], out["server"]
    text = b'{"op":"x","blobs":[]}'
    client.sock.sendall(struct.pack(">2sHIQ", b"MF", 0, len(text), 0) + text + bytes(32))
    with pytest.raises(ch.FrameError, match="authentication failed"):
        server.recv(timeout_s=5)

    out = pair()  # garbage instead of a frame
    out["client"].sock.sendall(b"\x80\x04\x95" + bytes(40))
    with pytest.raises(ch.FrameError, match="not a frame"):
        out["server"].recv(timeout_s=5)


def test_security_a_replayed_frame_fails_its_mac():
    out = pair()
    client, server = out["client"], out["server"]
    sock, sent = client.sock, []

    class Recorder:  # the client's socket, keeping a copy of what goes on the wire
        def sendall(self, data):
            sent.append(bytes(data))
            sock.sendall(data)

    client.sock = Recorder()
    client.send({"op": "commit"})
    server.recv(timeout_s=5)
    sock.sendall(b"".join(sent))  # the same bytes again: sequence number 1 expected, 0 signed
    with pytest.raises(ch.FrameError, match="authentication failed"):
        server.recv(timeout_s=5)


def test_channel_send_waits_for_a_slow_reader_and_reads_bound_a_stall(monkeypatch):
    """A trainer reads a generate answer only after its train step: the server's send of a large answer
    must wait for it however long that takes, while a frame that stops half-way is given up."""
    monkeypatch.setattr(ch, "READ_TIMEOUT_S", 0.3)
    out = pair()
    client, server = out["client"], out["server"]
    big = bytes(16 << 20)  # far beyond the socket buffers: the send blocks until the client reads
    sender = threading.Thread(target=lambda: server.send({"ok": True}, [big]))
    sender.start()
    threading.Event().wait(1.0)  # the "train step": longer than READ_TIMEOUT_S
    assert client.recv(timeout_s=5).blobs[0].nbytes == len(big)
    sender.join(10)
    client.sock.sendall(struct.pack(">2sHIQ", b"MF", 0, 10, 0) + b"{")  # a frame that stalls half-way
    with pytest.raises(ch.ChannelTimeout, match="stalled"):
        server.recv(timeout_s=5)


def test_security_schema_check_names_the_path():
    schema = {"lengths": [int], "sampling": {"stop": ([str], None), "t?": float}}
    ch.check({"lengths": [1, 2], "sampling": {"stop": None}}, schema)
    ch.check({"lengths": [], "sampling": {"stop": ["a"], "t": 1}}, schema)
    for bad, where in [({"lengths": [1, "2"], "sampling": {"stop": None}}, r"lengths\[1\]"),
                       ({"lengths": [True], "sampling": {"stop": None}}, r"lengths\[0\]"),
                       ({"lengths": [], "sampling": {"stop": None, "x": 1}}, "unknown keys"),
                       ({"lengths": []}, "missing keys"),
                       ({"lengths": [], "sampling": {"stop": "ab"}}, "sampling.stop")]:
        with pytest.raises(ch.SchemaError, match=where):
            ch.check(bad, schema)


def test_security_secret_file_is_owner_only_and_checked(tmp_path, monkeypatch):
    path = make_secret_file(tmp_path / "secrets")
    assert (path.stat().st_mode & 0o777, path.parent.stat().st_mode & 0o777) == (0o600, 0o700)
    assert len(load_secret(path)) == 32 and load_secret(path) != load_secret(make_secret_file(tmp_path / "other"))
    path.chmod(0o640)
    with pytest.raises(SecretError, match="mode 0640"):
        load_secret(path)
    short = tmp_path / "short.key"
    short.write_text("abcd")
    short.chmod(0o600)
    with pytest.raises(SecretError, match="64 hex digits"):
        load_secret(short)
    monkeypatch.delenv("MGTPO_SECRET_FILE", raising=False)
    with pytest.raises(SecretError, match="MGTPO_SECRET_FILE is unset"):
        load_secret()


def _store_listener(host: KeyValueHost, secret: bytes) -> ch.Listener:
    def route(channel):
        hello = channel.recv(timeout_s=5).header
        host.serve(channel, hello["join"])

    return ch.Listener("127.0.0.1", 0, secret, route=route, log=logging.getLogger("test"))


def test_security_transfer_group_forms_only_through_the_open_authenticated_rendezvous():
    host = KeyValueHost()
    listener = _store_listener(host, SECRET)
    address = ("127.0.0.1", listener.address[1])
    try:
        with pytest.raises(ch.AuthenticationError):  # an outsider cannot even reach the store
            ChannelStore(*address, secret=os.urandom(32), join_id="j", timeout_s=2)
        with pytest.raises(RuntimeError, match="did not open"):  # nor can the job outside a join
            ChannelStore(*address, secret=SECRET, join_id="j", timeout_s=0.5)
        received: dict = {}

        def member(rank: int) -> None:
            group = join_group(address, secret=SECRET, join_id="j", senders=2, rank=rank, timeout_s=30,
                               device=torch.device("cpu"))
            data = torch.full((4,), float(rank + 1))
            if rank < 2:
                group.send([data], 2, 0).wait()
            else:
                for sender in range(2):
                    group.recv([data], sender, 0).wait()
                    received[sender] = data.tolist()

        with host.open("j", timeout_s=30):
            threads = [threading.Thread(target=member, args=(r,)) for r in range(3)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
        assert received == {0: [1.0] * 4, 1: [2.0] * 4}
        with pytest.raises(RuntimeError, match="did not open"):  # closed again after the join
            ChannelStore(*address, secret=SECRET, join_id="j", timeout_s=0.5)
    finally:
        listener.close()


class Tap:
    """A socket that keeps a copy of every byte sent through it (what an on-path recorder sees)."""

    def __init__(self, sock: socket.socket):
        self.sock, self.sent = sock, []

    def sendall(self, data) -> None:
        self.sent.append(bytes(data))
        self.sock.sendall(data)

    def __getattr__(self, name):
        return getattr(self.sock, name)


def test_security_a_frame_reflected_to_its_sender_fails_its_mac():
    """Each direction has its own key (injected: the server's send key = its receive key -> the
    server accepts its own frame sent back to it, the test fails)."""
    out = pair()
    client, server = out["client"], out["server"]
    server.send({"ok": True, "op": "close"})  # the server's frame 0; reflected as the client's frame 0
    raw = client.sock.recv(1 << 16)
    client.sock.sendall(raw)
    with pytest.raises(ch.FrameError, match="authentication failed"):
        server.recv(timeout_s=5)


def test_security_a_recorded_connection_replayed_on_a_new_one_is_refused():
    """Both nonces are fresh on every connection: the bytes a recorder saw from a real client (proof
    and frames) replayed to a new server connection fail, and a recorded server's greeting and proof
    replayed to a new client fail (injected: a constant server nonce -> the replayed client proof is
    accepted; a constant client nonce -> the replayed server proof is accepted; both fail the test)."""
    a, b = socket.socketpair()
    tapped_client, tapped_server = Tap(a), Tap(b)
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(server=ch.server_handshake(tapped_server, SECRET, peer="c")))
    thread.start()
    client = ch.client_handshake(tapped_client, SECRET, peer="s")
    thread.join(10)
    client.send({"op": "commit"})
    assert result["server"].recv(timeout_s=5).header["op"] == "commit"
    c, d = socket.socketpair()  # an outsider replays the client's side to a new server connection
    c.sendall(b"".join(tapped_client.sent))
    with pytest.raises(ch.AuthenticationError, match="wrong secret"):
        ch.server_handshake(d, SECRET, peer="replay")
    e, f = socket.socketpair()  # and the server's side to a new client
    replay = threading.Thread(target=lambda: (f.recv(72), f.sendall(b"".join(tapped_server.sent))))
    replay.start()
    with pytest.raises(ch.AuthenticationError, match="does not know"):
        ch.client_handshake(e, SECRET, peer="replayed server")
    replay.join(10)


def test_security_the_mac_is_checked_before_the_header_is_parsed_and_a_bad_header_is_only_a_frame_error():
    """A header no parser survives (100k nested brackets: RecursionError in json) with a forged MAC
    is refused as forged, never parsed (injected: json.loads before compare_digest -> "not JSON",
    fails); with a valid MAC the parser's RecursionError, a huge number or a duplicate key is a
    FrameError, not an exception that escapes the channel (injected: only ValueError caught ->
    RecursionError, fails)."""
    deep = b"[" * 100_000 + b"]" * 100_000
    out = pair()
    client, server = out["client"], out["server"]
    client.sock.sendall(struct.pack(">2sHIQ", b"MF", 0, len(deep), 0) + deep + bytes(32))
    with pytest.raises(ch.FrameError, match="authentication failed"):
        server.recv(timeout_s=5)
    for text, match in [(deep, "RecursionError"), (b'{"a":' + b"9" * 5000 + b',"blobs":[]}', "ValueError"),
                        (b'{"op":"generate","op":"close","blobs":[]}', "duplicate keys")]:
        out = pair()
        client, server = out["client"], out["server"]
        fixed = struct.pack(">2sHIQ", b"MF", 0, len(text), 0)
        mac = ch.hmac.new(client._send_key, struct.pack(">Q", 0) + fixed + text, ch.hashlib.sha256).digest()
        client.sock.sendall(fixed + text + mac)
        with pytest.raises(ch.FrameError, match=match):
            server.recv(timeout_s=5)


def test_security_a_declared_payload_allocates_nothing_until_its_bytes_arrive():
    """A frame declaring the largest payload allowed (1 GiB) and then sending 10 bytes costs the
    receiver ~10 bytes, not 1 GiB (injected: ``bytearray(payload_len)`` up front -> a 1 GiB peak,
    fails)."""
    import tracemalloc

    out = pair()
    client, server = out["client"], out["server"]
    text = b'{"blobs":[1073741824]}'
    client.sock.sendall(struct.pack(">2sHIQ", b"MF", 0, len(text), ch.MAX_PAYLOAD_BYTES) + text + bytes(10))
    client.sock.close()
    tracemalloc.start()
    try:
        with pytest.raises(ch.ChannelClosed, match="after 10 of 1073741824"):
            server.recv(timeout_s=5)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, peak


def test_security_the_handshake_has_one_deadline_however_the_peer_trickles(monkeypatch):
    """A peer sending its greeting one byte at a time, each well within the limit, is dropped when
    the limit for the whole handshake is up (injected: a per-read timeout -> the peer keeps the slot
    for its whole 72-byte trickle, ~14 s here, fails)."""
    monkeypatch.setattr(ch, "HANDSHAKE_TIMEOUT_S", 1.0)
    a, b = socket.socketpair()
    stop = threading.Event()

    def trickle():
        for byte in ch.HELLO + bytes(64):
            if stop.wait(0.2):
                return
            try:
                a.send(bytes([byte]))
            except OSError:
                return

    thread = threading.Thread(target=trickle)
    thread.start()
    start = ch.time.monotonic()
    with pytest.raises(ch.AuthenticationError, match="stalled"):
        ch.server_handshake(b, SECRET, peer="trickle")
    took = ch.time.monotonic() - start
    stop.set()
    thread.join(5)
    assert 0.9 < took < 5.0, took  # the trickle itself lasts 14 s (slack for 2 busy cores)


def _stalled(host: str, port: int, source: str) -> socket.socket:
    """A connection from ``source`` (any 127/8 address reaches loopback) that says nothing."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((source, 0))
    sock.connect((host, port))
    return sock


def _refused_at_once(sock: socket.socket) -> bool:
    """True when the server closed ``sock`` unanswered within 5 s (measured here; the server's
    handshake limit is 20 s in these tests, so only a refusal by the accept loop ends it this fast)."""
    sock.settimeout(8.0)
    start = ch.time.monotonic()
    try:
        data = sock.recv(100)
    except TimeoutError:
        return False
    except ConnectionResetError:
        data = b""
    return data == b"" and ch.time.monotonic() - start < 5.0


def test_security_pending_handshakes_are_capped_per_address_and_in_all(monkeypatch):
    """One address holds at most MAX_PENDING_PER_PEER handshake slots, all addresses at most
    MAX_PENDING; a connection over either cap is closed by the accept loop at once, while another
    address still gets its greeting (injected: no per-address cap -> the 5th connection of one
    address is greeted; no MAX_PENDING -> the 33rd is greeted; each fails the test)."""
    monkeypatch.setattr(ch, "HANDSHAKE_TIMEOUT_S", 20.0)
    listener = ch.Listener("127.0.0.1", 0, SECRET, route=lambda c: c.close(), log=logging.getLogger("test"))
    port = listener.address[1]
    held = []
    try:
        held += [_stalled("127.0.0.1", port, "127.0.0.2") for _ in range(ch.MAX_PENDING_PER_PEER)]
        ch.time.sleep(0.3)
        assert _refused_at_once(_stalled("127.0.0.1", port, "127.0.0.2"))  # a 5th of the same address
        other = _stalled("127.0.0.1", port, "127.0.0.3")
        other.sendall(ch.HELLO + bytes(32))
        other.settimeout(8.0)
        assert other.recv(100)[:8] == ch.HELLO  # another address is greeted
        held.append(other)
        sources = [f"127.0.1.{i}" for i in range(1, 10)]
        while len(held) < ch.MAX_PENDING:
            held.append(_stalled("127.0.0.1", port, sources[len(held) % len(sources)]))
        ch.time.sleep(0.3)
        assert _refused_at_once(_stalled("127.0.0.1", port, "127.0.2.1"))  # the 33rd, of a new address
        for sock in held[:2]:  # slots freed: a job's client authenticates again
            sock.close()
        ch.time.sleep(0.3)
        ch.connect("127.0.0.1", port, SECRET).close()
    finally:
        for sock in held:
            sock.close()
        listener.close()


def test_security_an_authenticated_connection_has_tcp_keepalive():
    """A trainer whose host died leaves a half-open connection that no read ever ends; keep-alive
    probes end it (injected: no ``_keepalive`` call -> SO_KEEPALIVE is 0, fails)."""
    got: list = []
    listener = ch.Listener("127.0.0.1", 0, SECRET, route=got.append, log=logging.getLogger("test"))
    try:
        client = ch.connect("127.0.0.1", listener.address[1], SECRET)
        for _ in range(50):
            if got:
                break
            ch.time.sleep(0.1)
        for sock in (client.sock, got[0].sock):
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == ch.KEEPALIVE[0]
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == ch.KEEPALIVE[2]
        client.close()
    finally:
        listener.close()


def test_security_a_bad_store_request_gets_an_error_answer_and_the_store_goes_on(monkeypatch):
    """``add`` on a value that is no integer raised ValueError past the store's handler and killed
    its thread; a space is capped in keys and bytes (injected: ``_check_room`` not called -> the
    key over the cap is stored, fails)."""
    monkeypatch.setattr(rendezvous, "MAX_KEYS", 16)
    host = KeyValueHost()
    listener = _store_listener(host, SECRET)
    try:
        with host.open("j", timeout_s=30):
            store = ChannelStore("127.0.0.1", listener.address[1], secret=SECRET, join_id="j", timeout_s=10)
            store.set("k", b"not a number")
            with pytest.raises(RuntimeError, match="not an integer"):
                store.add("k", 1)
            assert store.add("n", 2) == 2 and store.get("k") == b"not a number"  # still served
            for i in range(14):  # 16 with "k" and "n"
                store.set(f"x{i}", b"")
            with pytest.raises(RuntimeError, match="more than 16 keys"):
                store.set("one more", b"")
            with pytest.raises(RuntimeError, match="bytes"):
                store.set("n", bytes(17 << 20))
            store.close()
    finally:
        listener.close()
