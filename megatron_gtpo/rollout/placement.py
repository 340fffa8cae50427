"""Which engines a job starts (called once by the driver, on every rank at the same point).

    build_engines(rollout_cfg, placement, model_dir=..., budget=...) -> RolloutGroup

* colocated: every trainer rank is one rank of an engine in its own process; engines of
  ``rollout.vllm.tensor_parallel_size`` = k span k consecutive ranks (vLLM's external launcher),
  which are Megatron's TP groups when the trainer's TP is k too.
* separate: a pool of rollout servers (:mod:`megatron_gtpo.rollout.pool`); rank 0 holds the control
  connections and generates for all.

The weights reach these engines through the weight sync the driver builds next, from the engine of
each rank (``sync.build.build_weight_sync``).
"""

from __future__ import annotations

import torch

from megatron_gtpo.parallel import control
from megatron_gtpo.plan.memory import EngineBudget, check_engine_start
from megatron_gtpo.rollout.config import EnginePlacement, RolloutConfig
from megatron_gtpo.rollout.engine import RolloutEngine
from megatron_gtpo.rollout.group import RolloutGroup
from megatron_gtpo.rollout.pool import connect
from megatron_gtpo.utils.configuration import ConfigError


def build_engines(rollout: RolloutConfig, placement: EnginePlacement, *, model_dir: str,
                  budget: EngineBudget | None = None) -> RolloutGroup:
    """The job's engines behind one :class:`RolloutGroup`; call on every rank at the same point.
    ``budget`` (colocated engines on GPUs, from ``plan.recipe.plan_engine_memory``): the engine start
    is refused with the plan's numbers when its share of the GPU is not free."""
    if placement.kind == "colocated":
        if budget is not None:
            free, total = torch.cuda.mem_get_info()
            check_engine_start(budget, free=free, total=total)
        return _colocated(rollout, str(model_dir))
    return _separate(rollout, placement, str(model_dir))


def _colocated(rollout: RolloutConfig, model_dir: str) -> RolloutGroup:
    per_engine = int(rollout.vllm.get("tensor_parallel_size", 1)) * int(rollout.vllm.get("pipeline_parallel_size", 1))
    world = control.world()[1]
    if world % per_engine:
        raise ConfigError(f"rollout.vllm tensor x pipeline parallel size = {per_engine}: colocated engines span "
                          f"consecutive trainer ranks, so it must divide the {world} ranks")
    engine = RolloutEngine(model_dir=model_dir, vllm_kwargs=rollout.vllm, seed=rollout.seed,
                           request_seeds=rollout.seeded_requests())
    return RolloutGroup(engine, shard=True, model_dir=model_dir, seed=rollout.seed, ranks_per_engine=per_engine)


def _separate(rollout: RolloutConfig, placement: EnginePlacement, model_dir: str) -> RolloutGroup:
    pool, error = None, None
    if control.world()[0] == 0:
        try:
            pool = connect(placement, model_dir=model_dir, vllm=rollout.vllm, seed=rollout.seed)
        except Exception as err:  # noqa: BLE001 - every rank raises it below
            error = f"{type(err).__name__}: {err}"
    error = control.broadcast_object(error)
    if error:
        raise RuntimeError(f"rollout pool unavailable: {error}")
    return RolloutGroup(pool, shard=False, model_dir=model_dir, seed=rollout.seed)
