"""Policy weights from the Megatron trainer to the vLLM engines: plan, export, checks, transports.

    build_weight_sync(sync_cfg, export=ExportPlan(...), engine) -> WeightSync      (sync/build.py)
    weight_sync.sync(chunks, version=step) -> sync/* metrics

``shards.py`` plans a push (names, shapes, owners, buckets) before any byte moves; ``export.py``
streams TP/PP-sharded Megatron chunks as HF tensors; ``checks.py`` checks the plan against the
engine; ``colocated`` (engines in the trainer processes, TP=k over k ranks) and ``separate`` (a
pool of rollout servers, ``receiver.py`` on the servers) are the transports. The engines come from
:mod:`megatron_gtpo.rollout` and are reached only through ``rollout/protocol.py``.

``build`` and ``separate`` are not imported here: ``rollout/pool.py`` still imports this package, and
``separate`` imports the pool (``receiver`` imports vLLM).
"""

from megatron_gtpo.sync.base import ExportPlan, PushSource, SyncStats, WeightSync
from megatron_gtpo.sync.checks import WeightPushError, WeightSpec, check_plan
from megatron_gtpo.sync.colocated import ColocatedSync
from megatron_gtpo.sync.config import SyncConfig

__all__ = ["ColocatedSync", "ExportPlan", "PushSource", "SyncConfig", "SyncStats", "WeightPushError", "WeightSpec",
           "WeightSync", "check_plan"]
