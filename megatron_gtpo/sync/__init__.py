"""Policy weights from the Megatron trainer to the vLLM engines, one class per transport.

    build_rollout(rollout_cfg, sync_cfg, model_dir=...) -> (RolloutGroup, WeightSync)
    syncer.push(export_hf_weights(..., dst_ranks=syncer.dst_ranks), version=step) -> SyncStats

``colocated`` (:mod:`.colocated`): engines in the trainer processes. ``separate`` (:mod:`.separate`):
one engine in its own process, fed over a gloo group. See :mod:`.base` for the contract and
:mod:`.placement` for which ranks hold engines.
"""

from megatron_gtpo.rollout.weights import WeightPushError
from megatron_gtpo.sync.base import SyncStats, WeightSync
from megatron_gtpo.sync.colocated import ColocatedSync
from megatron_gtpo.sync.config import SyncConfig
from megatron_gtpo.sync.placement import RolloutGroup, build_rollout
from megatron_gtpo.sync.separate import EngineProcessError, SeparateEngine, SeparateSync

__all__ = ["SyncConfig", "SyncStats", "WeightSync", "WeightPushError", "ColocatedSync", "SeparateSync",
           "SeparateEngine", "EngineProcessError", "RolloutGroup", "build_rollout"]
