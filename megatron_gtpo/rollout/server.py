"""A rollout server: one vLLM engine (of any TP) serving one trainer's generate requests and weight pushes.

Started by ``megatron-gtpo rollout-server`` (one per rollout node under ``slurm/train.sbatch`` with
``ROLLOUT_NODES``, or on localhost by trainer rank 0). It listens on one port of the job's own
interface and speaks only the authenticated, data-only channel of :mod:`megatron_gtpo.utils.channel`
(every connection proves the job's secret; nothing is unpickled; docs/security.md):

* one **control** connection at a time, the trainer's (rank 0): requests are answered one at a
  time, in order. ``generate`` samples inside its request, so no push overlaps it; a ``submit``ted
  job generates in the background (:mod:`megatron_gtpo.rollout.inflight`) while later requests are
  answered, a push included: the commit changes the weights between two engine steps, inside the
  generator's ``swapping()`` (the receiver gets it as ``ServerContext.swapping``), and each job's
  ``partial`` says what its unfinished completions do then; ``fetch`` waits for the job. A second
  control connection while one is served is refused (no takeover); when the trainer goes away,
  whatever it had staged is dropped, its jobs too, and the next one may connect;
* **store** connections: the rendezvous of a transfer group (:mod:`megatron_gtpo.utils.rendezvous`),
  open only while a ``join`` runs;
* anything else (no or a wrong secret, a malformed, oversized or forged frame, a request of the
  wrong shape) is refused and logged, and the server goes on serving its trainer.

Requests: ``hello``, ``generate``, ``submit``, ``fetch`` and ``close`` here (rollout/messages.py); the
weight requests come from a :class:`~megatron_gtpo.rollout.protocol.WeightReceiver` the program composes in
(``sync/receiver.py``: join, plan, receive, commit, abort), so this module knows nothing of how
weights travel.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
import traceback
from dataclasses import dataclass, field

import megatron_gtpo.rollout.messages as msg
from megatron_gtpo.rollout.engine import RolloutEngine
from megatron_gtpo.rollout.inflight import InflightGenerator
from megatron_gtpo.rollout.protocol import Op, ServerContext, WeightReceiver
from megatron_gtpo.utils.channel import Channel, ChannelError, FrameError, Listener, SchemaError, check
from megatron_gtpo.utils.rendezvous import KeyValueHost

log = logging.getLogger("megatron_gtpo.rollout_server")

@dataclass(frozen=True, kw_only=True)
class ServerSpec:
    """What one rollout server runs."""

    model_dir: str
    """HF model directory (config.json, tokenizer; weights unless ``load_format: dummy``)."""
    vllm: dict = field(default_factory=dict)
    """``vllm.LLM`` keyword arguments (``tensor_parallel_size`` sets the engine TP)."""
    seed: int = 0
    """Engine seed."""
    request_seeds: bool = True
    """Seed every request (``rollout.request_seeds``, resolved where the server runs)."""
    host: str = "127.0.0.1"
    """Address to listen on: the job's own interface (cli/rollout_server.py picks it), never all."""
    port: int = 29650
    """The one port of the server: control and transfer-group rendezvous (0: any free port, printed
    as ``rollout-server listening on HOST:PORT`` before the engine starts)."""
    timeout_s: float = 900.0
    """Longest wait inside one request (transfer-group rendezvous, one bucket)."""


class RolloutServer:
    """The engine plus the request loop (see the module docstring)."""

    def __init__(self, spec: ServerSpec, *, secret: bytes, receiver: WeightReceiver | None = None):
        self.spec, self._receiver = spec, receiver
        self.rendezvous = KeyValueHost()
        self._control: queue.Queue[Channel] = queue.Queue()
        self._busy = threading.Lock()  # held while a trainer is served (a second one is refused)
        # The port first (``port`` 0: any free one): held from the start, it cannot be taken while the
        # engine loads. A trainer that connects meanwhile is answered once the engine is up.
        self.listener = Listener(spec.host, spec.port, secret, route=self._route, log=log)
        self.port = self.listener.address[1]
        print(f"rollout-server listening on {spec.host}:{self.port}", flush=True)
        kwargs = {**spec.vllm, **(receiver.vllm_kwargs if receiver else {})}
        self.engine = RolloutEngine(model_dir=spec.model_dir, vllm_kwargs=kwargs, seed=spec.seed,
                                    request_seeds=spec.request_seeds)
        self.generator = InflightGenerator(self.engine)
        self.ops = self._own_ops()
        local = "127.0.0.1" if spec.host in ("0.0.0.0", "") else spec.host
        if receiver is not None:
            self.ops.update(receiver.bind(ServerContext(engine=self.engine, rendezvous=self.rendezvous,
                                                        address=(local, self.port), timeout_s=spec.timeout_s,
                                                        swapping=self.generator.swapping)))
        self.name = f"{socket.gethostname()}:{self.port}"
        self.limits = msg.GenerateLimits(max_model_len=self.engine.max_model_len, vocab_size=self.engine.vocab_size)

    def run(self) -> None:
        """Serves trainer connections until one sends ``close``."""
        log.info("rollout server %s ready on %s:%d (engine TP=%s, %s)", self.name, self.spec.host, self.port,
                 self.spec.vllm.get("tensor_parallel_size", 1), self.spec.model_dir)
        print(f"rollout-server ready on {self.name}", flush=True)
        try:
            while True:
                channel = self._control.get()
                try:
                    if self._serve(channel):
                        break
                finally:
                    channel.close()
                    self._busy.release()
        finally:
            self.generator.close()
            self.listener.close()

    def _route(self, channel: Channel) -> None:
        """An authenticated connection's first frame: which role it plays (listener thread)."""
        hello = channel.recv(timeout_s=10.0).header
        role = hello.get("role")
        if role == "store" and isinstance(hello.get("join"), str):
            self.rendezvous.serve(channel, hello["join"])
        elif role == "control" and self._busy.acquire(blocking=False):
            try:
                channel.send({"ok": True})
            except BaseException:  # gone before its answer: the slot is free again
                self._busy.release()
                raise
            self._control.put(channel)
        else:
            reason = "this server already serves a trainer" if role == "control" else f"unknown role {role!r}"
            self.listener.refuse(channel.peer, reason)
            channel.send({"ok": False, "error": reason})
            channel.close()

    def _serve(self, channel: Channel) -> bool:
        """One trainer connection; True when it asked the server to exit. Nothing the connection
        sends ends the server: a frame that fails, or any exception while reading or answering,
        ends this connection only (the next trainer may connect)."""
        log.info("serving the trainer at %s", channel.peer)
        try:
            while True:
                message = channel.recv()
                op = message.header.get("op")
                if op == "close":
                    channel.send({"ok": True, "result": {}})
                    return True
                channel.send(*self._answer(op, message))
        except FrameError as err:  # the stream cannot be trusted any more: drop this connection
            log.warning("refused %s: %s; connection closed", channel.peer, err)
        except ChannelError as err:
            log.info("trainer at %s went away (%s)", channel.peer, err)
        except Exception as err:  # noqa: BLE001 - e.g. MemoryError reading a frame, an answer that cannot be sent
            log.warning("dropped the trainer at %s after %s: %s", channel.peer, type(err).__name__, str(err)[:500])
        finally:
            self._drop_push()
        return False

    def _drop_push(self) -> None:
        """Forgets the gone trainer's jobs (their requests aborted) and push; a failure here is logged
        (the engine reports it next)."""
        try:
            self.generator.drop()
        except Exception:  # noqa: BLE001 - the next request meets the broken engine and reports it
            log.exception("dropping the trainer's generation jobs failed")
        if self._receiver is None:
            return
        try:
            self._receiver.drop()
        except Exception:  # noqa: BLE001 - the next request meets the broken engine and reports it
            log.exception("dropping the trainer's staged push failed")

    def _answer(self, op, message) -> tuple[dict, list]:
        try:
            check({k: v for k, v in message.header.items() if k != "blobs"}, msg.REQUEST, "request")
            if op not in self.ops:
                raise SchemaError(f"unknown request {op!r}")
            check(message.header["args"], self.ops[op].schema, op)
            out = self.ops[op].handle(message.header["args"], message.blobs)
        except SchemaError as err:
            log.warning("refused a malformed request from the trainer: %s", err)
            return {"ok": False, "kind": "ProtocolError", "message": str(err), "trace": ""}, []
        except BaseException as err:  # noqa: BLE001 - reported to the trainer, which raises
            return {"ok": False, "kind": type(err).__name__, "message": str(err),
                    "trace": traceback.format_exc(limit=8)}, []
        result, blobs = out if isinstance(out, tuple) else (out or {}, [])
        return {"ok": True, "result": result}, blobs

    def _own_ops(self) -> dict[str, Op]:
        """The server's own requests (the receiver adds the weight requests)."""
        return {"hello": Op(msg.HELLO, self._on_hello), "generate": Op(msg.GENERATE, self._on_generate),
                "submit": Op(msg.SUBMIT, self._on_submit), "fetch": Op(msg.FETCH, self._on_fetch)}

    def _on_hello(self, args: dict, blobs: list) -> dict:
        return {"host": self.name, "version": self.engine.weight_version, "dtype": str(self.engine.dtype),
                "tp": int(self.spec.vllm.get("tensor_parallel_size", 1)), "model_dir": self.spec.model_dir}

    def _on_generate(self, args: dict, blobs: list) -> tuple[dict, list]:
        prompts, seeds, sampling = msg.decode_generate(args, blobs, self.limits)
        with self.engine.lock:
            if self.engine.has_unfinished_requests():  # vLLM's generate would step (and swallow) them
                raise RuntimeError("generate while submitted jobs are unfinished: fetch them first")
            version, start = self.engine.weight_version, time.time()
            completions = self.engine.sample(prompts, seeds=seeds, sampling=sampling)
            return msg.encode_completions(version, completions, window=(start, time.time()))

    def _on_submit(self, args: dict, blobs: list) -> dict:
        prompts, seeds, sampling = msg.decode_submit(args, blobs, self.limits)
        if not 0 <= args["job"] < 1 << 63 or self.generator.has(args["job"]):
            raise SchemaError(f"submit: job {args['job']} is already in flight (or not an id in [0, 2^63))")
        if self.generator.in_flight() + len(prompts) * sampling.n > self.limits.max_sequences:
            # Jobs stay until fetched: together they are held to one request's cap.
            raise SchemaError(f"submit: more than {self.limits.max_sequences} completions in flight; fetch first")
        self.generator.submit(args["job"], prompts, seeds, sampling, partial=args["partial"])
        return {}

    def _on_fetch(self, args: dict, blobs: list) -> tuple[dict, list]:
        if not self.generator.has(args["job"]):
            raise SchemaError(f"fetch: no job {args['job']} in flight")
        completions, window = self.generator.take(args["job"])
        return msg.encode_completions(self.engine.weight_version, completions, window=window)
