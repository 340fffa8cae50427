"""Policy weights from the Megatron trainer to the vLLM engines: export, checks, transports.

    build_rollout(rollout_cfg, sync_cfg, model_dir=..., export=ExportPlan(...)) -> (RolloutGroup, WeightSync)
    weight_sync.sync(chunks, version=step) -> sync/* metrics

``export.py`` turns TP/PP-sharded Megatron chunks into HF-named full tensors in buckets;
``checks.py`` checks a whole push against the engine before vLLM is touched; ``colocated`` (engines
in the trainer processes) and ``separate`` (one engine in its own process, fed over a gloo group)
are the transports; ``placement`` builds the engines and their weight sync.
"""

from megatron_gtpo.sync.base import ExportPlan, SyncStats, WeightSync
from megatron_gtpo.sync.checks import PushChecker, WeightPushError, WeightSpec
from megatron_gtpo.sync.colocated import ColocatedSync
from megatron_gtpo.sync.config import SyncConfig
from megatron_gtpo.sync.placement import build_rollout
from megatron_gtpo.sync.separate import EngineProcessError, SeparateEngine, SeparateSync

__all__ = ["ColocatedSync", "EngineProcessError", "ExportPlan", "PushChecker", "SeparateEngine", "SeparateSync",
           "SyncConfig", "SyncStats", "WeightPushError", "WeightSpec", "WeightSync", "build_rollout"]
