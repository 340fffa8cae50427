"""The rollout server's side of a push: its requests (:class:`PushReceiver`, composed into the server by
``cli/rollout_server.py``) and a backend of vLLM 0.32's stateful weight-transfer API in its workers.

vLLM lets a worker receive weights through a pluggable ``WeightTransferEngine`` driven by four
worker calls (``init_weight_transfer_engine``, ``start_weight_update``, ``update_weights``,
``finish_weight_update``). Its built-in ``nccl`` backend streams straight into the layer-wise
reload and has a single sender; a pool of servers that must all switch versions together, fed by
every pipeline stage, needs more, so this module registers its own backend, ``mgtpo_staged``::

    request (server process)       vLLM workers
    join      {join, senders}      worker 0 joins the transfer group (utils/rendezvous.py: the
                                   server's authenticated store, open during this request only)
    plan      {version, tensors}   (none: the server checks the plan against its config.json)
    receive   {version, buckets}   worker 0 receives every bucket into the server's one shared
                                   staging area (sync/staging.py); the others only note the layout
    commit    {version}            every worker loads the staged push (layer-wise in-place reload),
                                   inside the server's ``swapping()`` (rollout/inflight.py)
    abort     {}                   the staged push is dropped; the served version stays

Staging costs one copy of the push per server in host memory, never GPU memory (on GPU worker 0
receives each bucket into one device buffer and copies it to the shared area). The area is kept
from push to push (the plan is the same every step), so only the first push pays its page faults.
The backend is registered in every vLLM process by importing this module, which vLLM does for the
worker extension class :class:`StagedReceiverExtension` (``worker_extension_cls``).
"""

from __future__ import annotations

import hmac
import logging
import mmap
from dataclasses import dataclass, field

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, \
    WeightTransferUpdateInfo
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from megatron_gtpo.errors import WeightPushError
from megatron_gtpo.rollout.protocol import Op, ServerContext
import megatron_gtpo.sync.wire as wire
from megatron_gtpo.sync.checks import WeightSpec, check_plan
from megatron_gtpo.sync.export import view_of
from megatron_gtpo.sync.shards import TensorMeta
from megatron_gtpo.sync.staging import SharedArea, StagedBucket, layout, map_area
from megatron_gtpo.utils.secret import load_secret
from megatron_gtpo.utils.vllm_reload import reload_model

BACKEND = "mgtpo_staged"
_DTYPES = ("float32", "bfloat16", "float16", "float64")
"""Dtype names a push may carry (anything else is refused before a name reaches torch)."""
log = logging.getLogger("megatron_gtpo.rollout_server")


@dataclass
class StagedInitInfo(WeightTransferInitInfo):
    """Where the transfer group meets (the server's port) and who sends."""

    host: str
    port: int
    join: str
    senders: int
    timeout_s: float = 900.0


@dataclass
class StagedUpdateInfo(WeightTransferUpdateInfo):
    """One whole push: the staging area and its buckets in order."""

    version: int
    area: str = ""
    """Path of the server's staging file (``/proc/<pid>/fd/<fd>``)."""
    area_bytes: int = 0
    generation: int = 0
    """Changes whenever the server makes a new area (workers then map it again)."""
    buckets: list = field(default_factory=list)
    """``(owner stage, start, nbytes, [TensorMeta fields as dicts])`` per bucket."""


class StagedWeightTransferEngine(WeightTransferEngine[StagedInitInfo, StagedUpdateInfo]):
    """Receives a push into host staging (worker 0); loads it only at ``finish_weight_update``."""

    init_info_cls = StagedInitInfo
    update_info_cls = StagedUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model):
        super().__init__(config, vllm_config, device, model)
        self.group = None
        self.senders = 0
        self.staged: list[tuple[str, torch.Tensor]] = []
        self.area: tuple[int, torch.Tensor] | None = None  # (generation, mapping), kept across pushes
        self.discard = False
        self.received_bytes = 0

    @property
    def receiving(self) -> bool:
        """Worker 0 of the server takes the bytes for all of them."""
        return self.parallel_config.rank == 0

    def init_transfer_engine(self, init_info: StagedInitInfo) -> None:
        self.senders = init_info.senders
        if self.receiving:
            self.group = wire.join_group((init_info.host, init_info.port), secret=load_secret(), join_id=init_info.join,
                                         senders=init_info.senders, rank=init_info.senders,
                                         timeout_s=init_info.timeout_s, device=torch.device(self.device))

    def start_weight_update(self) -> None:
        self.staged, self.discard = [], False

    def receive_weights(self, update_info: StagedUpdateInfo) -> None:
        if self.area is None or self.area[0] != update_info.generation:
            self.area = (update_info.generation, map_area(update_info.area, update_info.area_bytes))
        area = self.area[1]
        on_gpu = torch.device(self.device).type == "cuda"
        wire_buffer = torch.empty(max(n for _, _, n, _ in update_info.buckets), dtype=torch.uint8,
                                  device=self.device) if on_gpu and self.receiving else None
        for owner, start, nbytes, metas in update_info.buckets:
            host = area[start:start + nbytes]
            if self.receiving:
                target = wire_buffer[:nbytes] if on_gpu else host
                self.group.recv([target], owner, 0).wait()
                if on_gpu:
                    host.copy_(target)
                self.received_bytes += nbytes
            self.staged.extend((m["name"], view_of(host, TensorMeta(**m))) for m in metas)

    def finish_weight_update(self) -> None:
        staged, self.staged = self.staged, []
        if self.discard:
            return
        dtype = self.model_config.dtype
        weights = ((name, t.to(device=self.device, dtype=dtype)) for name, t in staged)
        reload_model(self.model, self.model_config, weights)

    def shutdown(self) -> None:
        self.group = None
        self.staged, self.area = [], None


class StagedReceiverExtension:
    """Worker extension (``worker_extension_cls``): importing it registers the backend in every vLLM
    worker process; its calls turn the next ``finish_weight_update`` into a discard and report what
    the worker received."""

    def mgtpo_discard_staged(self) -> int:
        engine = self.weight_transfer_engine
        dropped = len(engine.staged)
        engine.discard = True
        return dropped

    def mgtpo_received_bytes(self) -> int:
        return int(self.weight_transfer_engine.received_bytes)


class PushReceiver:
    """The server's push requests (module docstring); one per server, composed in by the CLI."""

    vllm_kwargs = {"weight_transfer_config": {"backend": BACKEND},
                   "worker_extension_cls": f"{__name__}.StagedReceiverExtension"}

    def __init__(self):
        self.ctx: ServerContext | None = None
        self.session = False  # a weight update is open in the workers
        self._plan: tuple[int, list[TensorMeta]] | None = None
        self._staged: tuple[int, list[StagedBucket]] | None = None  # version, its buckets in the area
        self._verified: int | None = None  # the version whose staged bytes matched their digests
        self._area: SharedArea | None = None

    def bind(self, ctx: ServerContext) -> dict[str, Op]:
        self.ctx = ctx
        self.weights = WeightSpec.from_model_dir(ctx.engine.model_dir, dtype=ctx.engine.dtype)
        return {"join": Op(wire.JOIN, self._on_join), "plan": Op(wire.PLAN, self._on_plan),
                "receive": Op(wire.RECEIVE, self._on_receive), "verify": Op(wire.VERIFY, self._on_verify),
                "commit": Op(wire.COMMIT, self._on_commit),
                "abort": Op(wire.ABORT, self._on_abort), "status": Op(wire.STATUS, self._on_status)}

    def _on_join(self, args: dict, blobs: list) -> None:
        ctx = self.ctx
        if not 1 <= args["senders"] <= 1024:
            raise WeightPushError(f"join: {args['senders']} senders")
        with ctx.rendezvous.open(args["join"], timeout_s=ctx.timeout_s):
            host, port = ctx.address
            ctx.engine.rpc("init_weight_transfer_engine", init_info=dict(
                host=host, port=port, join=args["join"], senders=args["senders"], timeout_s=ctx.timeout_s))

    def _on_plan(self, args: dict, blobs: list) -> None:
        version = args["version"]
        self.ctx.engine.check_version(version)
        bad = sorted({t["dtype"] for t in args["tensors"] if t["dtype"].removeprefix("torch.") not in _DTYPES})
        if bad:
            raise WeightPushError(f"weight push v{version}: dtypes {bad} are not among {list(_DTYPES)}")
        metas = [TensorMeta(name=t["name"], shape=tuple(t["shape"]), dtype=t["dtype"], offset=t["offset"])
                 for t in args["tensors"]]
        self._plan = None
        check_plan(self.weights, metas, version=version)
        self._plan = (version, metas)

    def _on_receive(self, args: dict, blobs: list) -> dict:
        version = args["version"]
        if self._plan is None or self._plan[0] != version:
            raise WeightPushError(f"receive of v{version} without its checked plan")
        buckets = layout(self._plan[1], args["buckets"])
        self._staged, self._verified = (version, buckets), None
        area = self._staging_area(sum(b.nbytes for b in buckets))
        self._end_session()
        engine = self.ctx.engine
        engine.rpc("start_weight_update")
        self.session = True
        try:
            engine.rpc("update_weights", update_info=dict(
                version=version, area=area.path, area_bytes=area.nbytes, generation=area.generation,
                buckets=[(b.owner, b.start, b.nbytes, [_meta_dict(m) for m in b.tensors]) for b in buckets]))
        except BaseException:
            self.session = False  # vLLM ends the update session when update_weights raises
            raise
        return {"buckets": len(buckets)}

    def _staging_area(self, nbytes: int) -> SharedArea:
        """The server's one staging area, made again only when the push's size changes."""
        if self._area is None or self._area.nbytes != nbytes:
            generation = self._area.generation + 1 if self._area else 1
            if self._area is not None:
                self._area.close()
            self._area = SharedArea(nbytes, generation)
        return self._area

    def _on_verify(self, args: dict, blobs: list) -> dict:
        """Every staged bucket against the digest its sender computed before sending it; a mismatch
        (bytes injected or corrupted on the transfer group) drops the push."""
        version = args["version"]
        if not self.session or self._staged is None or self._staged[0] != version:
            raise WeightPushError(f"verify of v{version} without a complete transfer")
        buckets = self._staged[1]
        if len(args["digests"]) != len(buckets):
            self.drop()
            raise WeightPushError(f"verify of v{version}: {len(args['digests'])} digests for {len(buckets)} buckets")
        with mmap.mmap(self._area.fileno, self._area.nbytes, prot=mmap.PROT_READ) as area:
            view = memoryview(area)
            try:
                bad = [i for i, (b, want) in enumerate(zip(buckets, args["digests"]))
                       if not hmac.compare_digest(wire.bucket_digest(view[b.start:b.start + b.nbytes]), want)]
            finally:
                view.release()
        if bad:
            self.drop()
            raise WeightPushError(f"weight push v{version}: buckets {bad} arrived corrupted (digest mismatch); "
                                  f"dropped, still serving v{self.ctx.engine.weight_version}")
        self._verified = version
        return {"buckets": len(buckets)}

    def _on_commit(self, args: dict, blobs: list) -> dict:
        version, engine = args["version"], self.ctx.engine
        if not self.session:
            raise WeightPushError(f"commit of v{version} without a complete transfer")
        if self._verified != version:
            raise WeightPushError(f"commit of v{version} before its digests were verified")
        self.session, self._plan = False, None
        with self.ctx.swapping():  # between two steps of the server's background generation
            try:
                engine.rpc("finish_weight_update")
            except BaseException:
                engine.loaded(version, ok=False)
                raise
            engine.loaded(version, ok=True)
        return {"version": version}

    def _on_status(self, args: dict, blobs: list) -> dict:
        return {"version": self.ctx.engine.weight_version, "staging_bytes": self._area.nbytes if self._area else 0,
                "received_bytes": self.ctx.engine.rpc("mgtpo_received_bytes")}

    def _on_abort(self, args: dict, blobs: list) -> dict:
        self.drop()
        return {"version": self.ctx.engine.weight_version}

    def drop(self) -> None:
        """Forgets the push under way: an open weight update ends without loading (the engine keeps
        its version) and its plan is gone (the next push is checked again)."""
        self._end_session()
        self._plan = self._staged = self._verified = None

    def _end_session(self) -> None:
        if self.session:
            self.ctx.engine.rpc("mgtpo_discard_staged")
            self.ctx.engine.rpc("finish_weight_update")
            self.session = False


def _meta_dict(meta: TensorMeta) -> dict:
    return {"name": meta.name, "shape": tuple(meta.shape), "dtype": meta.dtype, "offset": meta.offset}


def register() -> None:
    """Registers the ``mgtpo_staged`` backend with vLLM's factory (idempotent)."""
    try:
        WeightTransferEngineFactory.register_engine(BACKEND, StagedWeightTransferEngine)
    except ValueError:  # already registered in this process
        pass


register()
