"""The trainer's side of a pool of rollout servers: finding them, talking to them, generating.

* Where the servers are (:func:`server_addresses`): ``sync.servers``; else the rollout nodes
  ``slurm/train.sbatch`` exports (``MGTPO_ROLLOUT_HOSTS`` with ``MGTPO_ROLLOUT_PORT`` /
  ``sync.server_port``); else trainer rank 0 starts ``sync.local_servers`` of them on its own node
  (:class:`LocalServers`, the same ``megatron-gtpo rollout-server`` program).
* :class:`ServerLink`: trainer rank 0's control connection to one server, with a ready check (retry
  until ``sync.timeout_s``) and a deadline on every answer; a server that dies or stops answering
  raises :class:`ServerError` naming its host, never a hang.
* :class:`RolloutPool`: the engine API of rank 0 (``sample``/``tokenizer``) over all servers. Each
  step's prompts are split into contiguous, balanced runs of whole prompts (a prompt's n samples
  are one group and stay on one server); every prompt keeps the seed it has in the whole batch and
  the results come back in prompt order, so the completions are what one engine would have made.
  ``submit`` sends a call and returns (the servers generate while the trainer trains: one-step-off
  rollouts); ``wait`` collects it. One call is in flight at most; any later request (another
  call, a weight push) first waits for it, so a server never changes weights mid-generation.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Client

from megatron_gtpo.sync.checks import WeightPushError
from megatron_gtpo.sync.config import SyncConfig
from megatron_gtpo.sync.wire import AUTHKEY
from megatron_gtpo.types import Completion, Prompt

# A trainer rank's launcher variables would make the server's vLLM join the trainer's world.
_LAUNCHER_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                 "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "GROUP_WORLD_SIZE",
                 "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE")


class ServerError(RuntimeError):
    """A rollout server could not be reached, died, timed out or failed a request."""


def server_addresses(sync: SyncConfig) -> list[str] | None:
    """``host:port`` of the pool's servers, or None when rank 0 must start local ones."""
    if sync.servers:
        return list(sync.servers)
    hosts = [h for h in os.environ.get("MGTPO_ROLLOUT_HOSTS", "").split(",") if h]
    port = int(os.environ.get("MGTPO_ROLLOUT_PORT", sync.server_port))
    return [f"{h}:{port}" for h in hosts] or None


class ServerLink:
    """Control connection to one server (trainer rank 0)."""

    def __init__(self, address: str, *, timeout_s: float, alive=None, log_hint=lambda: ""):
        host, _, port = address.rpartition(":")
        self.address, self._timeout = address, timeout_s
        deadline, last = time.monotonic() + timeout_s, None
        while True:
            if alive is not None and not alive():
                raise ServerError(f"rollout server {address} exited before it was ready{log_hint()}")
            try:
                self._conn = Client((host, int(port)), authkey=AUTHKEY)
                break
            except OSError as err:
                last = err
            if time.monotonic() > deadline:
                raise ServerError(f"rollout server {address} not reachable after {timeout_s:.0f} s ({last}); is "
                                  f"`megatron-gtpo rollout-server` running there (ROLLOUT_NODES)?{log_hint()}")
            time.sleep(1.0)
        self.info = self.call(("hello",))
        """host, served version, engine dtype and TP, model directory (from the server)."""

    def send(self, message: tuple) -> None:
        try:
            self._conn.send(message)
        except OSError as err:
            raise ServerError(f"rollout server {self.address} is gone ({err})") from None

    def recv(self, timeout_s: float | None = None):
        """The reply to the oldest unanswered request; raises on death, timeout or error replies."""
        timeout = self._timeout if timeout_s is None else timeout_s
        try:
            ready = self._conn.poll(timeout)
            reply = self._conn.recv() if ready else None
        except (EOFError, OSError):
            raise ServerError(f"rollout server {self.address} died (connection closed)") from None
        if reply is None:
            raise ServerError(f"rollout server {self.address} did not answer within {timeout:.0f} s")
        if reply[0] == "ok":
            return reply[1]
        kind, _, message = reply[1].partition(": ")
        error = WeightPushError if kind in ("WeightPushError", "ValueError") else ServerError
        raise error(f"rollout server {self.address}: {reply[1]}" + ("" if error is WeightPushError else f"\n{reply[2]}"))

    def call(self, message: tuple, timeout_s: float | None = None):
        self.send(message)
        return self.recv(timeout_s)

    def close(self, *, stop: bool) -> None:
        try:
            if stop:
                self.call(("close",), timeout_s=30)
            self._conn.close()
        except (ServerError, WeightPushError, OSError):
            pass


class LocalServers:
    """``count`` rollout servers started by trainer rank 0 on localhost (no cluster, tests)."""

    def __init__(self, count: int, *, model_dir: str, vllm: dict, seed: int):
        self.log_dir = tempfile.mkdtemp(prefix="mgtpo-rollout-")
        env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_ENV}
        self.procs, self.addresses = [], []
        for index in range(count):
            port = _free_port_pair()
            cmd = [sys.executable, "-m", "megatron_gtpo.cli.rollout_server", "--model-dir", model_dir,
                   "--vllm-json", json.dumps(vllm), "--seed", str(seed), "--host", "127.0.0.1", "--port", str(port)]
            log = open(os.path.join(self.log_dir, f"server{index}.log"), "w")  # noqa: SIM115 - lives with the process
            self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env))
            self.addresses.append(f"127.0.0.1:{port}")

    def alive(self, index: int):
        return lambda: self.procs[index].poll() is None

    def hint(self, index: int) -> str:
        """The tail of server ``index``'s log, for an error message."""
        path = os.path.join(self.log_dir, f"server{index}.log")
        try:
            with open(path) as f:
                tail = "".join(f.readlines()[-20:])
        except OSError:
            tail = ""
        return f"; log {path}:\n{tail}"

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


@dataclass(kw_only=True)
class PoolTicket:
    """One generate call sent to the servers (``RolloutPool.submit``)."""

    runs: list[tuple[int, int]]
    """``[lo, hi)`` prompt run of each server (in link order)."""
    completions: list[Completion] | None = None
    """Filled once every server answered (``drain``)."""


class RolloutPool:
    """Rank 0's engine API over every server (see the module docstring)."""

    def __init__(self, links: list[ServerLink], *, model_dir: str, local: LocalServers | None = None):
        self.links, self._model_dir, self._local = links, model_dir, local
        self._tokenizer = None
        self._in_flight: PoolTicket | None = None

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self._model_dir)
        return self._tokenizer

    def sample(self, prompts: Sequence[Prompt], *, seeds: Sequence[int], **sampling) -> list[Completion]:
        return self.wait(self.submit(prompts, seeds=seeds, **sampling))

    def submit(self, prompts: Sequence[Prompt], *, seeds: Sequence[int], **sampling) -> PoolTicket:
        """Sends one generate call to the servers and returns at once; they generate in the background.
        A server answers one request at a time, in order, so any earlier call still in flight is
        received first (:meth:`drain`)."""
        self.drain()
        runs = balanced_runs(len(prompts), len(self.links))
        for link, (lo, hi) in zip(self.links, runs):
            if hi > lo:
                link.send(("generate", list(prompts[lo:hi]), list(seeds[lo:hi]), sampling))
        self._in_flight = PoolTicket(runs=runs)
        return self._in_flight

    def wait(self, ticket: PoolTicket) -> list[Completion]:
        """The completions of ``ticket``'s call, in prompt order (waits for them if still in flight)."""
        if ticket is self._in_flight:
            self.drain()
        if ticket.completions is None:
            raise ServerError("this generate call failed or was dropped when the pool closed")
        return ticket.completions

    def drain(self) -> None:
        """Waits for the generate call in flight, if any, and keeps its completions for ``wait``.
        A weight push calls it first: the servers finish the call on the weights it started with and
        only then take the push, so each serves exactly one version at a time."""
        ticket, self._in_flight = self._in_flight, None
        if ticket is None:
            return
        out, versions = [], {}
        for link, (lo, hi) in zip(self.links, ticket.runs):
            if hi > lo:
                version, part = link.recv()
                versions[link.address] = version
                for c in part:
                    c.prompt_index += lo
                out += part
        if len(set(versions.values())) > 1:
            raise ServerError(f"rollout servers serve different weight versions: {versions}")
        ticket.completions = out

    def sleep(self) -> None:
        """Nothing to give back: the servers do not share the trainer's GPUs."""

    def wake_up(self, tags=("weights", "kv_cache")) -> None:
        """Nothing to re-allocate (see :meth:`sleep`)."""

    def close(self) -> None:
        try:  # a call still in flight (a run stopped with step k+1 generating) is answered first
            self.drain()
        except (ServerError, WeightPushError):
            pass
        for link in self.links:
            link.close(stop=self._local is not None)
        if self._local is not None:
            self._local.stop()


def balanced_runs(num_prompts: int, servers: int) -> list[tuple[int, int]]:
    """Contiguous ``[lo, hi)`` prompt runs, one per server, sizes differing by at most one."""
    base, extra = divmod(num_prompts, servers)
    runs, lo = [], 0
    for index in range(servers):
        hi = lo + base + (1 if index < extra else 0)
        runs.append((lo, hi))
        lo = hi
    return runs


def connect(sync: SyncConfig, *, model_dir: str, vllm: dict, seed: int) -> RolloutPool:
    """Rank 0: reaches (or starts) the servers and waits until every one is ready."""
    addresses, local = server_addresses(sync), None
    if addresses is None:
        local = LocalServers(sync.local_servers, model_dir=model_dir, vllm=vllm, seed=seed)
        addresses = local.addresses
    try:
        links = [ServerLink(a, timeout_s=sync.timeout_s, alive=local.alive(i) if local else None,
                            log_hint=(lambda i=i: local.hint(i)) if local else (lambda: "")) for i, a in enumerate(addresses)]
    except BaseException:
        if local is not None:
            local.stop()
        raise
    return RolloutPool(links, model_dir=model_dir, local=local)


def _free_port_pair() -> int:
    """A port p with p and p + 1 free (control and transfer store of one server)."""
    for _ in range(100):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
            return port
    raise OSError("no two consecutive free ports on 127.0.0.1")
