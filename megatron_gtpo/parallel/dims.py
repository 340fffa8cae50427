"""Process-group set-up: the one place that initialises torch.distributed and Megatron's parallel_state.

Other modules receive a :class:`ParallelDims` (sizes and this rank's coordinates) and never call
``parallel_state`` getters deep inside their own code.
"""

from __future__ import annotations

import datetime
import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_gtpo.parallel import control, cpu_shims, strict, unpickle
from megatron_gtpo.parallel.launch import free_port
from megatron_gtpo.parallel.layout import expert_world_problem, world_problem
from megatron_gtpo.utils.configuration import require


@dataclass(kw_only=True)
class ParallelConfig:
    """Parallel layout of the trainer (the ``parallel:`` block); world size = tp * cp * pp * dp
    (``world_size``, checked against the launched world by ``world_size_problem``)."""

    tp: int = 1
    """Tensor-parallel size: must divide attention heads, KV heads and intermediate_size (the vocabulary is
    padded to fit any TP: model.make_vocab_size_divisible_by)."""
    pp: int = 1
    """Pipeline-parallel size: must divide the number of layers (times vpp)."""
    vpp: int | None = None
    """Virtual pipeline chunks per PP rank (interleaved 1F1B); None = no interleaving. Needs pp > 1."""
    cp: int = 1
    """Context-parallel size: every sequence is split over ``cp`` ranks (Megatron's load-balanced
    2 x cp chunks; packed rows per sequence, in Transformer Engine's THD convention), so a rank holds
    1/cp of each micro-batch's activations and logits. Gradients are reduced over DP x CP. On GPU the
    attention is Transformer Engine's CP attention (``cp_comm_type`` among the model's Megatron
    overrides: p2p by default, a2a or all_gather); on CPU the exact stand-in of
    ``parallel/cp_attention.py``. Must divide the world; sequences are padded to a multiple of 2 x cp."""
    dp: int = 1
    """Data-parallel size. torchrun launches tp * cp * pp * dp ranks."""
    ep: int = 1
    """Expert-parallel size (mixture-of-experts models): the routed experts of every layer are split
    over ``ep`` ranks, each holding experts / ep of them, and tokens travel to their experts by
    all-to-all. Expert-parallel ranks are taken from the tp * cp * dp ranks of a pipeline stage (no
    extra ranks: Megatron's layout), so ep * etp must divide tp * cp * dp, and ep must divide the experts."""
    etp: int = 1
    """Expert tensor-parallel size: each expert's weights are cut ``etp`` ways like a dense MLP over
    TP. 1 (the default here; Megatron's own default is the dense TP): fine-grained experts are small,
    and whole experts per rank avoid a reduction per expert."""
    timeout_s: float = 1800
    """Seconds a collective may wait for its peers before it fails instead of hanging: applies to
    the default group, the gloo control group and Megatron's groups. Raise it when a rank can
    legitimately be busy alone for longer (e.g. rank 0 scoring or saving between collectives)."""

    def __post_init__(self):
        for name in ("tp", "cp", "pp", "dp", "ep", "etp"):
            require(getattr(self, name) >= 1, name, getattr(self, name), "an integer >= 1")
        problem = expert_world_problem(self.tp * self.cp * self.dp, ep=self.ep, etp=self.etp)
        require(problem is None, "ep", self.ep, f"a value that fits: {problem}")
        require(self.timeout_s > 0, "timeout_s", self.timeout_s, "a number of seconds > 0")
        require(self.vpp is None or (self.vpp >= 2 and self.pp >= 2), "vpp", self.vpp,
                "null, or an integer >= 2 together with pp >= 2")

    def sizes(self) -> dict[str, int]:
        """Every parallel size whose product is the world, in Megatron's rank order (tp, cp, pp, dp;
        ``world_size`` and ``world_size_problem`` follow). Expert parallelism is not a factor: Megatron
        takes its ranks from the tp * cp * dp ranks of each stage (``expert_world_problem``)."""
        return {"tp": self.tp, "cp": self.cp, "pp": self.pp, "dp": self.dp}

    @property
    def world_size(self) -> int:
        """Ranks the layout needs: the product of ``sizes()``."""
        return math.prod(self.sizes().values())

    def world_size_problem(self, world: int, *, launcher: str) -> str | None:
        """Why ``world`` launched ranks cannot run this layout, or None: the world must equal the
        product of the parallel sizes. The one start-up check of the world size, made before
        anything loads (``megatron-gtpo train --world-size`` in slurm/train.sbatch's prepare step,
        and every rank before it builds anything); ``launcher`` says who chose ``world``."""
        need = self.world_size
        if world == need:
            return None
        product = " x ".join(f"parallel.{name}={size}" for name, size in self.sizes().items())
        model = math.prod(size for name, size in self.sizes().items() if name != "dp")
        fix = (f"set parallel.dp={world // model}, or launch {need} rank(s)" if world % model == 0 else
               f"launch {need} rank(s) (a multiple of {model} for this model split)")
        return f"{launcher} starts {world} rank(s), but {product} = {need}: {fix}"


@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    """Sizes of each parallel dimension and this rank's coordinates in them."""

    world: int
    """Number of ranks in the job."""
    tp: int
    """Tensor-parallel size."""
    pp: int
    """Pipeline-parallel size."""
    dp: int
    """Data-parallel size (world / (tp * cp * pp))."""
    vpp: int | None
    """Virtual pipeline stages per PP rank (interleaved schedule), or None."""
    rank: int
    """Global rank."""
    tp_rank: int
    pp_rank: int
    dp_rank: int
    cp: int = 1
    """Context-parallel size: ranks that hold one sequence's tokens between them."""
    cp_rank: int = 0
    """This rank's index in its context-parallel group (which load-balanced chunks it holds)."""
    ep: int = 1
    """Expert-parallel size (1 for dense models)."""
    etp: int = 1
    """Expert tensor-parallel size."""
    ep_rank: int = 0
    """This rank's index in its expert-parallel group: it holds experts ep_rank * E/ep .. (ep_rank+1) * E/ep - 1."""
    etp_rank: int = 0
    """This rank's index in its expert tensor-parallel group."""
    edp_rank: int = 0
    """This rank's index among the replicas of its experts (expert data parallel: tp * cp * dp / (ep * etp))."""

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def first_copy(self) -> bool:
        """True on the ranks of data-parallel replica 0 and context-parallel rank 0: together one
        copy of every weight of the model. CP ranks hold identical weights, as DP replicas do, so
        what must happen once per weight (a push's senders, an export's writer, a checkpoint's main
        replica) happens on these ranks only."""
        return self.dp_rank == 0 and self.cp_rank == 0


def init_distributed(*, tp: int = 1, pp: int = 1, vpp: int | None = None, cp: int = 1, seed: int = 1234,
                     timeout_s: float = ParallelConfig.timeout_s, ep: int = 1, etp: int = 1) -> ParallelDims:
    """Initialises the default group (gloo on CPU, NCCL on GPU), the CPU shims (and strict mode,
    see strict.py), the gloo control group, Megatron's model-parallel groups with the control
    plane's twins of the DP and PP groups, and the RNG tracker; every group gets ``timeout_s``
    (``parallel.timeout_s``). ``cp`` > 1 makes Megatron's context-parallel groups, and its DDP then
    reduces gradients over ``get_data_parallel_group(with_context_parallel=True)`` (DP x CP).
    ``ep``/``etp``: expert parallelism of a mixture of experts, carved out of the tp * cp * dp ranks
    of each stage (Megatron's expert groups). Works single-process too (world of 1, no torchrun needed).
    """
    from megatron.core import parallel_state as ps

    timeout = datetime.timedelta(seconds=timeout_s)
    unpickle.install()  # before any collective: what peers send is built as data only
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, timeout=timeout)
    world = dist.get_world_size()
    problem = world_problem(world, tp=tp, cp=cp, pp=pp) or expert_world_problem(world // pp, ep=ep, etp=etp)
    if problem:
        raise ValueError(problem)
    strict_mode = strict.requested() or strict.active()
    on_cpu = cpu_shims.install(device_mode=not strict_mode)
    if on_cpu and strict_mode:
        strict.install()  # before any group: strict mode classifies groups as they are made
    control.init(timeout=timeout)
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vpp,
            context_parallel_size=cp,
            expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
            distributed_timeout_minutes=timeout_s / 60,
        )
        twins = [ps.get_data_parallel_group(), ps.get_pipeline_model_parallel_group()]
        if cp > 1:  # metric extrema and Python values of a CP step travel over the CP and DP x CP groups
            twins += [ps.get_context_parallel_group(), ps.get_data_parallel_group(with_context_parallel=True)]
        control.add_twins(twins)
    if on_cpu:
        cpu_shims.install_rng_tracker(seed)
    else:
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return current_dims(vpp=vpp)


def current_dims(vpp: int | None = None) -> ParallelDims:
    """Reads this rank's coordinates from an initialised parallel_state."""
    from megatron.core import parallel_state as ps

    return ParallelDims(
        world=dist.get_world_size(),
        tp=ps.get_tensor_model_parallel_world_size(),
        pp=ps.get_pipeline_model_parallel_world_size(),
        dp=ps.get_data_parallel_world_size(),
        vpp=vpp,
        rank=dist.get_rank(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        cp=ps.get_context_parallel_world_size(),
        cp_rank=ps.get_context_parallel_rank(),
        ep=ps.get_expert_model_parallel_world_size(), etp=ps.get_expert_tensor_parallel_world_size(),
        ep_rank=ps.get_expert_model_parallel_rank(), etp_rank=ps.get_expert_tensor_parallel_rank(),
        edp_rank=ps.get_expert_data_parallel_rank(),
    )

