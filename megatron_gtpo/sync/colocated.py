"""Colocated transport: the engines live in the trainer's own processes.

Engines of TP=k span k consecutive trainer ranks (vLLM's ``external_launcher``), which are exactly
Megatron's TP groups when the trainer's TP is k too. What each rank hands its engine follows the
delivery mode (:mod:`megatron_gtpo.sync.shards`):

* ``local`` (engine TP == trainer TP > 1): its own TP shard of every linear layer, no gather
  (vocabulary tensors are gathered: vLLM pads the vocabulary its own way);
* ``full`` (engine TP=1 on every rank, or engine TP != trainer TP): full tensors, gathered per
  parameter; vLLM's loaders cut each engine rank's slice (the resharding happens in vLLM).

A push moves no bytes between processes beyond the exporter's own TP/PP collectives::

    rank r: plan --check (all ranks agree)--> exporter stream --checked_stream--> engine r reloads

The stream goes straight into vLLM's layer-wise in-place reload, which keeps a layer's tensors
until the layer is complete; so the push holds at most about one decoder layer (and the one
parameter being gathered) beyond the model, never the whole model. A failure after the first byte
marks the engine broken and fails the step on every rank (see sync/base.py).
"""

from __future__ import annotations

from megatron_gtpo.rollout.protocol import LocalWeights
from megatron_gtpo.sync.base import ExportPlan, PushSource, PushTimer, SyncStats, WeightSync, agree, drain
from megatron_gtpo.sync.checks import WeightPushError, WeightSpec, check_plan, checked_stream
from megatron_gtpo.sync.shards import Mode, push_bytes


class ColocatedSync(WeightSync):
    """Pushes into the engine of this process (one rank of it), through the ``LocalWeights`` protocol."""

    def __init__(self, engine: LocalWeights, export: ExportPlan | None, *, mode: Mode = "full", engine_tp: int = 1):
        super().__init__(export)
        self.mode, self._engine_tp = mode, engine_tp
        self._engine = engine
        self._spec = WeightSpec.from_model_dir(engine.model_dir, dtype=engine.dtype)

    def push(self, source: PushSource, *, version: int) -> SyncStats:
        timer = PushTimer()
        metas, error = source.metas(self.mode), None
        try:
            check_plan(self._spec, metas, version=version, tp=self._engine_tp if self.mode == "local" else 1)
            self._engine.check_version(version)
        except (WeightPushError, ValueError) as err:
            error = err
        agree(error)  # no byte moves unless every rank's plan matches its engine
        timer.phase("plan")
        stream, error = source.tensors(self.mode), None
        try:
            self._engine.load_weights(checked_stream(stream, metas, dtype=self._engine.dtype), version=version,
                                      sharded=self.mode == "local")
        except Exception as err:  # noqa: BLE001 - re-raised on every rank by agree()
            error = err
            drain(stream)
        timer.phase("load")  # export and vLLM's reload, interleaved tensor by tensor
        stats = timer.stats(version=version, num_tensors=len(metas), num_bytes=push_bytes(metas))
        return agree(error, stats)
