"""Which engines a job starts and which weight sync feeds them (called once by the driver).

    build_rollout(rollout_cfg, sync_cfg, model_dir=..., export=...) -> (RolloutGroup, WeightSync)

* colocated: every trainer rank holds one engine in its own process (``rollout.group`` says how
  the ranks share one generate call) and a :class:`~megatron_gtpo.sync.colocated.ColocatedSync`.
* separate: global rank 0 owns one engine process (:class:`~megatron_gtpo.sync.separate.SeparateEngine`)
  and a :class:`~megatron_gtpo.sync.separate.SeparateSync` on every rank.
"""

from __future__ import annotations

import torch.distributed as dist

from megatron_gtpo.rollout.config import RolloutConfig
from megatron_gtpo.rollout.engine import RolloutEngine
from megatron_gtpo.rollout.group import RolloutGroup
from megatron_gtpo.sync.base import ExportPlan, WeightSync
from megatron_gtpo.sync.colocated import ColocatedSync
from megatron_gtpo.sync.config import SyncConfig
from megatron_gtpo.sync.separate import SeparateEngine, SeparateSync


def build_rollout(rollout: RolloutConfig, sync: SyncConfig, *, model_dir: str,
                  export: ExportPlan) -> tuple[RolloutGroup, WeightSync]:
    """The job's engines and the weight sync that feeds them; call on every rank at the same point."""
    return _TRANSPORTS[sync.transport](rollout, sync, str(model_dir), export)


def _colocated(rollout: RolloutConfig, sync: SyncConfig, model_dir: str,
               export: ExportPlan) -> tuple[RolloutGroup, WeightSync]:
    engine = RolloutEngine(model_dir=model_dir, vllm_kwargs=rollout.vllm, seed=rollout.seed)
    per_engine = int(rollout.vllm.get("tensor_parallel_size", 1)) * int(rollout.vllm.get("pipeline_parallel_size", 1))
    group = RolloutGroup(engine, shard=True, model_dir=model_dir, seed=rollout.seed, ranks_per_engine=per_engine)
    return group, ColocatedSync(engine, export)


def _separate(rollout: RolloutConfig, sync: SyncConfig, model_dir: str,
              export: ExportPlan) -> tuple[RolloutGroup, WeightSync]:
    first = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
    engine = SeparateEngine(model_dir=model_dir, vllm_kwargs=rollout.vllm, seed=rollout.seed,
                            timeout_s=sync.timeout_s) if first else None
    return RolloutGroup(engine, shard=False, model_dir=model_dir, seed=rollout.seed), SeparateSync(engine, export)


_TRANSPORTS = {"colocated": _colocated, "separate": _separate}
