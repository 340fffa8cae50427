"""Policy weights from the Megatron trainer to the vLLM engines: plan, export, checks, transports.

    build_rollout(rollout_cfg, sync_cfg, model_dir=..., export=ExportPlan(...)) -> (RolloutGroup, WeightSync)
    weight_sync.sync(chunks, version=step) -> sync/* metrics

``shards.py`` plans a push (names, shapes, owners, buckets) before any byte moves; ``export.py``
streams TP/PP-sharded Megatron chunks as HF tensors; ``checks.py`` checks the plan against the
engine; ``colocated`` (engines in the trainer processes, TP=k over k ranks) and ``separate`` (a
pool of rollout servers: ``rollout/pool.py`` on the trainer, ``rollout/server.py`` +
``receiver.py`` on the servers) are the transports; ``placement`` builds the engines and their
weight sync. (``receiver`` imports vLLM and is not imported here.)
"""

from megatron_gtpo.sync.base import ExportPlan, ListSource, PushSource, SyncStats, WeightSync
from megatron_gtpo.sync.checks import WeightPushError, WeightSpec, check_plan
from megatron_gtpo.sync.colocated import ColocatedSync
from megatron_gtpo.sync.config import SyncConfig
from megatron_gtpo.sync.placement import build_rollout
from megatron_gtpo.sync.separate import PoolSync

__all__ = ["ColocatedSync", "ExportPlan", "ListSource", "PoolSync", "PushSource",
           "SyncConfig", "SyncStats", "WeightPushError", "WeightSpec", "WeightSync", "build_rollout", "check_plan"]
