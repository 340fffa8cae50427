"""Which weight sync feeds the job's engines (called once by the driver, after ``build_engines``).

    build_weight_sync(sync_cfg, export, engine) -> WeightSync

* colocated: a :class:`~megatron_gtpo.sync.colocated.ColocatedSync` on every rank, into that rank's
  engine (:class:`~megatron_gtpo.rollout.protocol.LocalWeights`); each rank receives only its own
  TP shards when engine and trainer TP match and the family's checkpoint fuses no pieces
  (``shards.delivery_mode``), full tensors otherwise.
* separate: a :class:`~megatron_gtpo.sync.separate.PoolSync` on every rank; rank 0's engine is the
  pool of rollout servers (:class:`~megatron_gtpo.rollout.protocol.ServerPool`), the others have none.

The transport follows ``sync.transport``, the same setting that placed the engines
(``SyncConfig.placement``); the engine is only used through the protocols.
"""

from __future__ import annotations

from megatron_gtpo.models.families import family_of
from megatron_gtpo.rollout.protocol import LocalWeights, ServerPool
from megatron_gtpo.sync.base import ExportPlan, WeightSync
from megatron_gtpo.sync.colocated import ColocatedSync
from megatron_gtpo.sync.config import SyncConfig
from megatron_gtpo.sync.separate import PoolSync
from megatron_gtpo.sync.shards import delivery_mode


def build_weight_sync(sync: SyncConfig, export: ExportPlan, engine: LocalWeights | ServerPool | None) -> WeightSync:
    """The weight sync of ``sync.transport`` into this rank's ``engine`` (``RolloutGroup.engine``);
    call on every rank at the same point."""
    if sync.transport == "colocated":
        tp = engine.tensor_parallel_size
        mode = delivery_mode(transport="colocated", trainer_tp=export.dims.tp, engine_tp=tp,
                             family=family_of(export.hf_config))
        return ColocatedSync(engine, export, mode=mode, engine_tp=tp)
    return PoolSync(engine, export, timeout_s=sync.timeout_s)
