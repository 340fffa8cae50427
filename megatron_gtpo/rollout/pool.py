"""The trainer's side of a pool of rollout servers: finding them, talking to them, generating.

* Where the servers are (:func:`server_addresses`, from the job's
  :class:`~megatron_gtpo.rollout.config.EnginePlacement`): ``sync.servers``; else the rollout nodes
  ``slurm/train.sbatch`` exports (``MGTPO_ROLLOUT_HOSTS`` with ``MGTPO_ROLLOUT_PORT`` /
  ``sync.server_port``); else trainer rank 0 starts ``sync.local_servers`` of them on its own node
  (:class:`LocalServers`, the same ``megatron-gtpo rollout-server`` program, on loopback).
* :class:`ServerLink`: trainer rank 0's control channel to one server (authenticated with the job's
  secret, data-only: rollout/messages.py, utils/channel.py), with a ready check (retry until
  ``sync.timeout_s``) and a deadline on every answer; a server that dies, stops answering or
  refuses this job raises :class:`ServerError` naming its host, never a hang.
* :class:`RolloutPool`: the :class:`~megatron_gtpo.rollout.protocol.Engine` of rank 0 over all servers. Each
  step's prompts are split into contiguous, balanced runs of whole prompts (a prompt's n samples
  are one group and stay on one server); every prompt keeps the seed it has in the whole batch and
  the results come back in prompt order, so the completions are what one engine would have made.
  ``submit`` sends a call and returns (the servers generate while the trainer trains: off-policy
  rollouts); ``wait`` collects it. Two ways, chosen by ``rollout.in_flight_pushes()``:

  - one call in flight (``rollout.staleness`` <= 1, no partial rollouts): the ``generate`` request;
    any later request (another call, a weight push) first waits for its answer (``drain``), so a
    server never changes weights mid-generation;
  - calls in flight across pushes (``staleness`` >= 2 or ``rollout.partial``): each call is a
    ``submit`` job (answered at once) and a ``fetch`` of its completions when ``wait`` needs them;
    the servers keep generating while weights are pushed and apply the job's ``partial`` mode at
    each commit (rollout/inflight.py), tagging every token with the version that sampled it.

The pool is also the :class:`~megatron_gtpo.rollout.protocol.ServerPool` the weight sync
(``sync/separate.py``) drives, and nothing else of this module::

    pool.servers() -> [(address, hello info)]      every server, in a fixed order
    pool.secret_path                               the job-secret file the servers were started with
    pool.drain()                                   wait for the generate call in flight
    pool.post(op, args, skip=()) -> {address: error}      send one request to every server not skipped
    pool.collect(skip=(), timeout_s=None) -> {address: error}  take each posted server's answer

``post`` + ``collect`` let the servers work in parallel (a request is sent to all before any
answer is awaited); failures come back by address, never raised. ``WeightPushError`` (a server
refused the push and keeps its weights) and ``ServerError`` live in :mod:`megatron_gtpo.errors`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from megatron_gtpo.errors import ServerError, WeightPushError
import megatron_gtpo.rollout.messages as msg
from megatron_gtpo.rollout.config import EnginePlacement, Sampling
from megatron_gtpo.rollout.overlap import overlap_metrics
from megatron_gtpo.types import Completion, Prompt
from megatron_gtpo.utils.channel import AuthenticationError, ChannelError, SchemaError, check
from megatron_gtpo.utils.channel import connect as open_channel
from megatron_gtpo.utils.secret import SECRET_ENV, load_secret, make_secret_file, secret_path

__all__ = ["LocalServers", "PoolTicket", "RolloutPool", "ServerError", "ServerLink", "balanced_runs", "connect",
           "server_addresses"]

# A trainer rank's launcher variables would make the server's vLLM join the trainer's world.
_LAUNCHER_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                 "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "GROUP_WORLD_SIZE",
                 "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE")
_PUSH_ERRORS = ("WeightPushError", "ValueError")
_LISTENING = re.compile(r"rollout-server listening on (\S+):(\d+)")


def server_addresses(sync: EnginePlacement) -> list[str] | None:
    """``host:port`` of the pool's servers, or None when rank 0 must start local ones."""
    if sync.servers:
        return list(sync.servers)
    hosts = [h for h in os.environ.get("MGTPO_ROLLOUT_HOSTS", "").split(",") if h]
    port = int(os.environ.get("MGTPO_ROLLOUT_PORT", sync.server_port))
    return [f"{h}:{port}" for h in hosts] or None


class ServerLink:
    """Control channel to one server (trainer rank 0)."""

    def __init__(self, address: str, *, secret: bytes, timeout_s: float, alive=None, log_hint=lambda: ""):
        host, _, port = address.rpartition(":")
        self.address, self._timeout, self.pending = address, timeout_s, 0
        deadline, last = time.monotonic() + timeout_s, None
        while True:
            if alive is not None and not alive():
                raise ServerError(f"rollout server {address} exited before it was ready{log_hint()}")
            try:
                self._channel = open_channel(host, int(port), secret)
                break
            except AuthenticationError as err:
                raise ServerError(f"rollout server {address} refused this job ({err}): it was started with another "
                                  f"secret; give both the same {SECRET_ENV}") from None
            except OSError as err:
                last = err
            if time.monotonic() > deadline:
                raise ServerError(f"rollout server {address} not reachable after {timeout_s:.0f} s ({last}); is "
                                  f"`megatron-gtpo rollout-server` running there (ROLLOUT_NODES)?{log_hint()}")
            time.sleep(1.0)
        self._channel.send({"role": "control"})
        answer = self._receive(60.0).header
        if answer.get("ok") is not True:
            raise ServerError(f"rollout server {address} refused the connection: {answer.get('error')}")
        self.info: dict = {}
        """host, served version, engine dtype and TP, model directory (from the server)."""
        try:  # answered once the engine is up (the port is held from the server's start)
            self.info = self.call("hello")
        except ServerError:
            if alive is not None and _exits(alive, within_s=30.0):
                raise ServerError(f"rollout server {address} exited before it was ready{log_hint()}") from None
            raise

    def send(self, op: str, args: dict | None = None, blobs: Sequence = ()) -> None:
        try:
            self._channel.send({"op": op, "args": args or {}}, blobs)
        except ChannelError as err:
            raise ServerError(f"rollout server {self.address} is gone ({err})") from None
        self.pending += 1

    def _receive(self, timeout: float):
        try:
            return self._channel.recv(timeout)
        except ChannelError as err:
            raise ServerError(f"rollout server {self.address} died or did not answer within {timeout:.0f} s "
                              f"({err})") from None

    def recv(self, timeout_s: float | None = None) -> tuple[dict, list]:
        """The answer to the oldest unanswered request (result, blobs); raises on death, timeout or
        an error answer (WeightPushError when the server refused a push, ServerError otherwise)."""
        self.pending -= 1
        message = self._receive(self._timeout if timeout_s is None else timeout_s)
        reply = message.header
        if reply.get("ok") is True and isinstance(reply.get("result"), dict):
            return reply["result"], message.blobs
        kind, text = str(reply.get("kind", "Error")), str(reply.get("message", reply))
        if kind in _PUSH_ERRORS:
            raise WeightPushError(f"rollout server {self.address}: {kind}: {text}")
        raise ServerError(f"rollout server {self.address}: {kind}: {text}\n{reply.get('trace', '')}")

    def call(self, op: str, args: dict | None = None, blobs: Sequence = (), timeout_s: float | None = None) -> dict:
        self.send(op, args, blobs)
        return self.recv(timeout_s)[0]

    def submit_generate(self, prompts: Sequence[Prompt], seeds: Sequence[int], sampling: Sampling) -> None:
        self.send("generate", *msg.encode_generate(prompts, seeds, sampling))

    def submit_job(self, job: int, partial: str, prompts: Sequence[Prompt], seeds: Sequence[int],
                   sampling: Sampling) -> None:
        """Starts generation job ``job`` on the server (answered at once: it generates in the background)."""
        self.call("submit", *msg.encode_submit(job, partial, prompts, seeds, sampling))

    def generated(self, prompts: Sequence[Prompt]) -> tuple[int, list[Completion]]:
        """The answer to :meth:`submit_generate` (or a ``fetch``) of ``prompts``: (served version, completions)."""
        return self.answer(prompts)[:2]

    def answer(self, prompts: Sequence[Prompt]) -> tuple[int, list[Completion], tuple[float, float] | None]:
        """:meth:`generated` and the server's generation window of the call (None: not reported)."""
        result, blobs = self.recv()
        try:
            check(result, msg.GENERATE_REPLY, "generate answer")
            return (*msg.decode_completions(result, blobs, prompts), msg.decode_window(result))
        except SchemaError as err:
            raise ServerError(f"rollout server {self.address} sent a malformed answer: {err}") from None

    def close(self, *, stop: bool) -> None:
        try:
            if stop:
                self.call("close", timeout_s=30)
        except (ServerError, WeightPushError):
            pass
        self._channel.close()


class LocalServers:
    """``count`` rollout servers started by trainer rank 0 on loopback (no cluster, tests). Their logs
    and, when ``MGTPO_SECRET_FILE`` is unset, the job secret live in a private (0700) directory."""

    def __init__(self, count: int, *, model_dir: str, vllm: dict, seed: int):
        self.log_dir = tempfile.mkdtemp(prefix="mgtpo-rollout-")
        self._own_secret = not os.environ.get(SECRET_ENV)
        self.secret_path = Path(os.environ.get(SECRET_ENV) or make_secret_file(self.log_dir))
        env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_ENV}
        env[SECRET_ENV] = str(self.secret_path)
        self.procs = []
        for index in range(count):  # port 0: each server takes a free port itself and prints it
            cmd = [sys.executable, "-m", "megatron_gtpo.cli.rollout_server", "--model-dir", model_dir,
                   "--vllm-json", json.dumps(vllm), "--seed", str(seed), "--host", "127.0.0.1", "--port", "0"]
            log = open(os.path.join(self.log_dir, f"server{index}.log"), "w")  # noqa: SIM115 - lives with the process
            self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env))

    def address(self, index: int, *, timeout_s: float) -> str:
        """``host:port`` server ``index`` listens on, from its log (it binds before its engine loads)."""
        path, deadline = os.path.join(self.log_dir, f"server{index}.log"), time.monotonic() + timeout_s
        while True:
            with open(path, errors="replace") as f:
                found = _LISTENING.search(f.read())
            if found:
                return f"{found.group(1)}:{found.group(2)}"
            if self.procs[index].poll() is not None or time.monotonic() > deadline:
                raise ServerError(f"rollout server {index} exited before it was ready{self.hint(index)}")
            time.sleep(0.2)

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
        if self._own_secret:  # the servers are gone: a key left behind would only be a key to steal
            self.secret_path.unlink(missing_ok=True)


@dataclass(kw_only=True)
class PoolTicket:
    """One generate call sent to the servers (``RolloutPool.submit``)."""

    runs: list[tuple[int, int]]
    """``[lo, hi)`` prompt run of each server (in link order)."""
    prompts: list[Prompt]
    """The whole call's prompts."""
    completions: list[Completion] | None = None
    """Filled once every server answered (``drain``, or ``wait`` of a job)."""
    job: int | None = None
    """The servers' job id (calls in flight across pushes); None for a ``generate`` call."""


class RolloutPool:
    """Rank 0's engine API over every server (see the module docstring)."""

    def __init__(self, links: list[ServerLink], *, model_dir: str, local: LocalServers | None = None,
                 secret_path: Path | None = None, partial: str | None = None):
        self.links, self._model_dir, self._local = links, model_dir, local
        self.partial = partial
        """What a push does to the servers' jobs (``rollout.partial``); None: one ``generate`` call in
        flight, which a push waits for (module docstring)."""
        self._jobs = 0
        self.secret_path = secret_path
        """The job-secret file the servers were started with (the senders read it too)."""
        self.prompts_served = {link.address: 0 for link in links}
        """Prompts each server was given to generate, by address (balance checks, tests)."""
        self._tokenizer = None
        self._in_flight: PoolTicket | None = None
        self._windows: list[tuple[float, float]] = []  # the servers' generation windows not yet measured

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self._model_dir)
        return self._tokenizer

    def submit(self, prompts: Sequence[Prompt], *, seeds: Sequence[int], sampling: Sampling) -> PoolTicket:
        """Sends one generate call to the servers and returns at once; they generate in the background.
        A server answers one request at a time, in order, so any earlier call still in flight is
        received first (:meth:`drain`). With calls in flight across pushes: a job on every server."""
        if self.partial is not None:
            return self._submit_job(prompts, seeds=seeds, sampling=sampling)
        self.drain()
        runs = balanced_runs(len(prompts), len(self.links))
        for link, (lo, hi) in zip(self.links, runs):
            if hi > lo:
                link.submit_generate(prompts[lo:hi], seeds[lo:hi], sampling)
                self.prompts_served[link.address] += hi - lo
        self._in_flight = PoolTicket(runs=runs, prompts=list(prompts))
        return self._in_flight

    def _submit_job(self, prompts: Sequence[Prompt], *, seeds: Sequence[int], sampling: Sampling) -> PoolTicket:
        self._jobs += 1
        runs = balanced_runs(len(prompts), len(self.links))
        for link, (lo, hi) in zip(self.links, runs):
            if hi > lo:
                link.submit_job(self._jobs, self.partial, prompts[lo:hi], seeds[lo:hi], sampling)
                self.prompts_served[link.address] += hi - lo
        return PoolTicket(runs=runs, prompts=list(prompts), job=self._jobs)

    def wait(self, ticket: PoolTicket) -> list[Completion]:
        """The completions of ``ticket``'s call, in prompt order (waits for them if still in flight)."""
        if ticket is self._in_flight:
            self.drain()
        if ticket.job is not None and ticket.completions is None:
            self._fetch(ticket)
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
        versions, out = self._answers(ticket)
        if len(set(versions.values())) > 1:
            raise ServerError(f"rollout servers serve different weight versions: {versions}")
        ticket.completions = out

    def _answers(self, ticket: PoolTicket) -> tuple[dict[str, int], list[Completion]]:
        """Every server's answer to ``ticket``'s call (a ``generate`` or a ``fetch``): the version each
        served, and the completions in prompt order."""
        out, versions = [], {}
        for link, (lo, hi) in zip(self.links, ticket.runs):
            if hi > lo:
                version, part, window = link.answer(ticket.prompts[lo:hi])
                versions[link.address] = version
                if window is not None:
                    self._windows.append(window)
                for c in part:
                    c.prompt_index += lo
                out += part
        return versions, out

    def _fetch(self, ticket: PoolTicket) -> None:
        """A job's completions from every server it ran on (asked of all before any answer is read)."""
        for link, (lo, hi) in zip(self.links, ticket.runs):
            if hi > lo:
                link.send("fetch", {"job": ticket.job})
        ticket.completions = self._answers(ticket)[1]

    def overlap(self, start: float, end: float) -> dict[str, float] | None:
        """``rollout/overlap_*`` of a train phase [start, end] (wall clock) against the generation
        windows the servers reported (rollout/overlap.py); windows that ended before ``start`` are
        forgotten (the phases come in order). Call it once the call that ran during the phase was
        answered: with one call in flight, the push after the step drains it. None with calls in
        flight across pushes: a job's window comes with its ``fetch``, steps after the phases it
        overlapped, so the metric is not logged there."""
        self._windows = [w for w in self._windows if w[1] >= start]
        if self.partial is not None:
            return None
        return overlap_metrics(self._windows, (start, end))

    # ------------------------------------------------------------------ ServerPool (the weight sync's interface)

    def servers(self) -> list[tuple[str, dict]]:
        """(address, hello info) of every server, in link order."""
        return [(link.address, link.info) for link in self.links]

    def post(self, op: str, args: dict, *, skip: Sequence[str] = ()) -> dict[str, str]:
        """Sends ``op`` to every server not in ``skip``; the failures by address."""
        failures = {}
        for link in self.links:
            if link.address not in skip:
                try:
                    link.send(op, args)
                except ServerError as err:
                    failures[link.address] = str(err)
        return failures

    def collect(self, *, skip: Sequence[str] = (), timeout_s: float | None = None) -> dict[str, str]:
        """The answer of every server with a request outstanding (not in ``skip``); failures by address."""
        failures = {}
        for link in self.links:
            if link.address not in skip and link.pending > 0:
                try:
                    link.recv(timeout_s)
                except (ServerError, WeightPushError) as err:
                    failures[link.address] = str(err)
        return failures

    # ------------------------------------------------------------------ engine API, continued

    def sleep(self, *, keep_weights: bool = False) -> None:
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


def _exits(alive, *, within_s: float) -> bool:
    """Whether a local server whose connection just broke exits within ``within_s``: its socket closes
    while the process is still going down (an engine that failed to load), and its whole log, the
    reason, is there only once it has exited."""
    deadline = time.monotonic() + within_s
    while alive():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def balanced_runs(num_prompts: int, servers: int) -> list[tuple[int, int]]:
    """Contiguous ``[lo, hi)`` prompt runs, one per server, sizes differing by at most one."""
    base, extra = divmod(num_prompts, servers)
    runs, lo = [], 0
    for index in range(servers):
        hi = lo + base + (1 if index < extra else 0)
        runs.append((lo, hi))
        lo = hi
    return runs


def connect(sync: EnginePlacement, *, model_dir: str, vllm: dict, seed: int, partial: str | None = None
            ) -> RolloutPool:
    """Rank 0: reaches (or starts) the servers and waits until every one is ready. ``partial``:
    ``rollout.in_flight_pushes()`` (the pool's ``partial``)."""
    addresses, local = server_addresses(sync), None
    if addresses is None:
        local = LocalServers(sync.local_servers, model_dir=model_dir, vllm=vllm, seed=seed)
    try:
        if local is not None:
            addresses = [local.address(i, timeout_s=sync.timeout_s) for i in range(sync.local_servers)]
        path = local.secret_path if local else secret_path()  # external servers: the job's secret file
        secret = load_secret(path)
        links = [ServerLink(a, secret=secret, timeout_s=sync.timeout_s, alive=local.alive(i) if local else None,
                            log_hint=(lambda i=i: local.hint(i)) if local else (lambda: ""))
                 for i, a in enumerate(addresses)]
    except BaseException:
        if local is not None:
            local.stop()
        raise
    return RolloutPool(links, model_dir=model_dir, local=local, secret_path=path, partial=partial)

