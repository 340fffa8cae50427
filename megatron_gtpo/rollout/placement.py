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

from megatron_gtpo.models.families import family_of
from megatron_gtpo.models.hf_config import read_hf_config
from megatron_gtpo.parallel import control
from megatron_gtpo.plan.memory import EngineBudget, check_engine_start
from megatron_gtpo.rollout.config import EnginePlacement, RolloutConfig
from megatron_gtpo.rollout.engine import RolloutEngine
from megatron_gtpo.rollout.group import RolloutGroup
from megatron_gtpo.rollout.pool import connect
from megatron_gtpo.utils.configuration import ConfigError
from megatron_gtpo.utils.memory import release_cached_memory


def build_engines(rollout: RolloutConfig, placement: EnginePlacement, *, model_dir: str,
                  budget: EngineBudget | None = None) -> RolloutGroup:
    """The job's engines behind one :class:`RolloutGroup`; call on every rank at the same point.
    ``budget`` (colocated engines on GPUs, from ``plan.recipe.plan_engine_memory``): the engine start
    is refused with the plan's numbers when its share of the GPU is not free."""
    if placement.kind == "colocated":
        if budget is not None:
            check_free_memory(budget)
        return _colocated(rollout, str(model_dir))
    return _separate(rollout, placement, str(model_dir))


def check_free_memory(budget: EngineBudget) -> None:
    """The engine-start check on what the device has free once PyTorch's cache is emptied: blocks
    the trainer freed (DDP's parameter re-map, an offload) stay reserved by the caching allocator
    and count as used in ``mem_get_info`` until then; vLLM empties the cache before its own check."""
    release_cached_memory()
    free, total = torch.cuda.mem_get_info()
    check_engine_start(budget, free=free, total=total)


def _colocated(rollout: RolloutConfig, model_dir: str) -> RolloutGroup:
    per_engine = int(rollout.vllm.get("tensor_parallel_size", 1)) * int(rollout.vllm.get("pipeline_parallel_size", 1))
    world = control.world()[1]
    if world % per_engine:
        raise ConfigError(f"rollout.vllm tensor x pipeline parallel size = {per_engine}: colocated engines span "
                          f"consecutive trainer ranks, so it must divide the {world} ranks")
    # A mixture of experts' engines return the experts they routed each token to: replayed by the
    # trainer (model.moe_routing_replay: rollout), and its routing agreement either way.
    moe = family_of(read_hf_config(model_dir)).experts is not None
    engine = RolloutEngine(model_dir=model_dir, vllm_kwargs=rollout.vllm, seed=rollout.seed,
                           request_seeds=rollout.seeded_requests(), routing=moe)
    return RolloutGroup(engine, shard=True, model_dir=model_dir, seed=rollout.seed, ranks_per_engine=per_engine)


def _separate(rollout: RolloutConfig, placement: EnginePlacement, model_dir: str) -> RolloutGroup:
    pool, error = None, None
    if control.world()[0] == 0:
        try:
            pool = connect(placement, model_dir=model_dir, vllm=rollout.vllm, seed=rollout.seed,
                           partial=rollout.in_flight_pushes())
        except Exception as err:  # noqa: BLE001 - every rank raises it below
            error = f"{type(err).__name__}: {err}"
    error = control.broadcast_data(error)
    if error:
        raise RuntimeError(f"rollout pool unavailable: {error}")
    return RolloutGroup(pool, shard=False, model_dir=model_dir, seed=rollout.seed,
                        overlap=pool.overlap if pool is not None else None)
