"""Which engines a job starts and which weight sync feeds them (called once by the driver).

    build_rollout(rollout_cfg, sync_cfg, model_dir=..., export=...) -> (RolloutGroup, WeightSync)

* colocated: every trainer rank is one rank of an engine in its own process; engines of
  ``rollout.vllm.tensor_parallel_size`` = k span k consecutive ranks (vLLM's external launcher),
  which are Megatron's TP groups when the trainer's TP is k too (then every rank receives only its
  own shard). A :class:`~megatron_gtpo.sync.colocated.ColocatedSync` on every rank.
* separate: a pool of rollout servers (:mod:`megatron_gtpo.rollout.pool`); rank 0 holds the control
  connections and generates for all; a :class:`~megatron_gtpo.sync.separate.PoolSync` on every rank.
"""

from __future__ import annotations

import torch

from megatron_gtpo.plan.memory import EngineBudget, check_engine_start
from megatron_gtpo.rollout.config import RolloutConfig
from megatron_gtpo.rollout.engine import RolloutEngine
from megatron_gtpo.rollout.group import RolloutGroup
from megatron_gtpo.parallel import control
from megatron_gtpo.sync.base import ExportPlan, WeightSync
from megatron_gtpo.sync.colocated import ColocatedSync
from megatron_gtpo.sync.config import SyncConfig
from megatron_gtpo.rollout.pool import connect
from megatron_gtpo.sync.separate import PoolSync
from megatron_gtpo.sync.shards import delivery_mode
from megatron_gtpo.utils.configuration import ConfigError


def build_rollout(rollout: RolloutConfig, sync: SyncConfig, *, model_dir: str, export: ExportPlan,
                  budget: EngineBudget | None = None) -> tuple[RolloutGroup, WeightSync]:
    """The job's engines and the weight sync that feeds them; call on every rank at the same point.
    ``budget`` (colocated engines on GPUs, from ``plan.recipe.plan_engine_memory``): the engine start
    is refused with the plan's numbers when its share of the GPU is not free."""
    if budget is not None and sync.transport == "colocated":
        free, total = torch.cuda.mem_get_info()
        check_engine_start(budget, free=free, total=total)
    return _TRANSPORTS[sync.transport](rollout, sync, str(model_dir), export)


def engine_tp(rollout: RolloutConfig) -> int:
    """vLLM tensor-parallel size of one engine (``rollout.vllm.tensor_parallel_size``)."""
    return int(rollout.vllm.get("tensor_parallel_size", 1))


def _colocated(rollout: RolloutConfig, sync: SyncConfig, model_dir: str,
               export: ExportPlan) -> tuple[RolloutGroup, WeightSync]:
    tp, dims = engine_tp(rollout), export.dims
    per_engine = tp * int(rollout.vllm.get("pipeline_parallel_size", 1))
    if dims.world % per_engine:
        raise ConfigError(f"rollout.vllm tensor x pipeline parallel size = {per_engine}: colocated engines span "
                          f"consecutive trainer ranks, so it must divide the {dims.world} ranks")
    engine = RolloutEngine(model_dir=model_dir, vllm_kwargs=rollout.vllm, seed=rollout.seed,
                           request_seeds=rollout.seeded_requests())
    group = RolloutGroup(engine, shard=True, model_dir=model_dir, seed=rollout.seed, ranks_per_engine=per_engine)
    mode = delivery_mode(transport="colocated", trainer_tp=dims.tp, engine_tp=tp)
    return group, ColocatedSync(engine, export, mode=mode, engine_tp=tp)


def _separate(rollout: RolloutConfig, sync: SyncConfig, model_dir: str,
              export: ExportPlan) -> tuple[RolloutGroup, WeightSync]:
    pool, error = None, None
    if control.world()[0] == 0:
        try:
            pool = connect(sync, model_dir=model_dir, vllm=rollout.vllm, seed=rollout.seed)
        except Exception as err:  # noqa: BLE001 - every rank raises it below
            error = f"{type(err).__name__}: {err}"
    error = control.broadcast_object(error)
    if error:
        raise RuntimeError(f"rollout pool unavailable: {error}")
    group = RolloutGroup(pool, shard=False, model_dir=model_dir, seed=rollout.seed)
    return group, PoolSync(pool, export, timeout_s=sync.timeout_s)


_TRANSPORTS = {"colocated": _colocated, "separate": _separate}
