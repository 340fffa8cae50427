"""A rollout server: one vLLM engine (of any TP) serving generate requests and weight pushes.

Started by ``megatron-gtpo rollout-server`` (one per rollout node under ``slurm/train.sbatch`` with
``ROLLOUT_NODES``, or spawned on localhost by trainer rank 0). It serves one trainer connection at
a time, one request at a time, so a push never overlaps a generate and the engine serves exactly
one weight version at a time::

    trainer rank 0 (control, TCP)                 server
    ("hello",)                           -->      host, served version, engine dtype, engine TP
    ("join", prefix, world, offset)      -->      every vLLM worker joins the transfer group
    ("generate", prompts, seeds, ...)    -->      (version, completions)
    ("plan", version, [TensorMeta])      -->      the whole push checked before any byte moves
    ("receive", version, buckets, ...)   -->      buckets arrive from the trainer's senders over the
                                                  transfer group into host staging ("received")
    ("commit", version) / ("abort",)     -->      staged push loaded (serves version) / dropped
    ("close",)                           -->      exit

The transfer group rendezvous is a TCP store the server hosts at ``port + 1``. Weights move through
vLLM 0.32's stateful weight-transfer API with this package's ``mgtpo_staged`` backend
(:mod:`megatron_gtpo.sync.receiver`).
"""

from __future__ import annotations

import logging
import socket
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Listener

from megatron_gtpo.rollout.engine import RolloutEngine
from megatron_gtpo.sync import receiver
from megatron_gtpo.sync.checks import WeightPushError, WeightSpec, check_plan
from megatron_gtpo.sync.shards import TensorMeta
from megatron_gtpo.sync.wire import AUTHKEY, tcp_store

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
    host: str = "0.0.0.0"
    """Address to listen on."""
    port: int = 29650
    """Control port; the transfer-group store listens on ``port + 1``."""
    timeout_s: float = 900.0
    """Longest wait inside one request (transfer-group rendezvous, one bucket)."""


class RolloutServer:
    """The engine plus the request loop (see the module docstring)."""

    def __init__(self, spec: ServerSpec):
        self.spec = spec
        kwargs = {**spec.vllm, "weight_transfer_config": {"backend": receiver.BACKEND},
                  "worker_extension_cls": f"{receiver.__name__}.StagedReceiverExtension"}
        self.engine = RolloutEngine(model_dir=spec.model_dir, vllm_kwargs=kwargs, seed=spec.seed,
                                    request_seeds=spec.request_seeds)
        self.weights = WeightSpec.from_model_dir(spec.model_dir, dtype=self.engine.dtype)
        self.store = tcp_store(spec.host, spec.port + 1, is_master=True, timeout_s=spec.timeout_s)
        self.listener = Listener((spec.host, spec.port), authkey=AUTHKEY)
        self.session = False  # a weight update is open in the workers
        self.name = f"{socket.gethostname()}:{spec.port}"

    def run(self) -> None:
        """Serves trainer connections until one sends ``close``."""
        log.info("rollout server %s ready (engine TP=%s, %s)", self.name,
                 self.spec.vllm.get("tensor_parallel_size", 1), self.spec.model_dir)
        print(f"rollout-server ready on {self.name}", flush=True)
        while True:
            with self.listener.accept() as conn:
                if self._serve(conn):
                    break
        self.listener.close()

    def _serve(self, conn) -> bool:
        """One trainer connection; True when it asked the server to exit."""
        while True:
            try:
                request = conn.recv()
            except (EOFError, OSError):
                self._drop()  # the trainer went away: nothing staged survives it
                return False
            if request[0] == "close":
                conn.send(("ok", None))
                return True
            try:
                reply = ("ok", getattr(self, f"_on_{request[0]}")(*request[1:]))
            except BaseException as err:  # noqa: BLE001 - reported to the trainer, which raises
                reply = ("error", f"{type(err).__name__}: {err}", traceback.format_exc(limit=8))
            conn.send(reply)

    def _on_hello(self) -> dict:
        return {"host": self.name, "version": self.engine.weight_version, "dtype": str(self.engine.dtype),
                "tp": int(self.spec.vllm.get("tensor_parallel_size", 1)), "model_dir": self.spec.model_dir}

    def _on_join(self, prefix: str, world: int, rank_offset: int) -> None:
        host = "127.0.0.1" if self.spec.host in ("0.0.0.0", "") else self.spec.host
        self.engine.rpc("init_weight_transfer_engine", init_info=dict(
            host=host, port=self.spec.port + 1, prefix=prefix, world=world, rank_offset=rank_offset,
            timeout_s=self.spec.timeout_s))

    def _on_generate(self, prompts, seeds, sampling: dict):
        return self.engine.weight_version, self.engine.sample(prompts, seeds=seeds, **sampling)

    def _on_plan(self, version: int, metas: list[TensorMeta]) -> None:
        self.engine.check_version(version)
        check_plan(self.weights, metas, version=version)

    def _on_receive(self, version: int, buckets: list, senders: dict) -> int:
        self._drop()
        self.engine.rpc("start_weight_update")
        self.session = True
        try:
            self.engine.rpc("update_weights", update_info=dict(version=version, buckets=buckets, senders=senders))
        except BaseException:
            self.session = False  # vLLM ends the update session when update_weights raises
            raise
        return len(buckets)

    def _on_commit(self, version: int) -> int:
        if not self.session:
            raise WeightPushError(f"commit of v{version} without a complete transfer")
        self.session = False
        try:
            self.engine.rpc("finish_weight_update")
        except BaseException:
            self.engine.loaded(version, ok=False)
            raise
        self.engine.loaded(version, ok=True)
        return version

    def _on_abort(self) -> int:
        self._drop()
        return self.engine.weight_version

    def _drop(self) -> None:
        """Ends an open weight update without loading it (the engine keeps its version)."""
        if self.session:
            self.engine.rpc("mgtpo_discard_staged")
            self.engine.rpc("finish_weight_update")
            self.session = False
