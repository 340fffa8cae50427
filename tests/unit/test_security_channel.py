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


@pytest.mark.parametrize("guess", [b"megatron-gtpo-rollout", b"", os.urandom(32)])
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
