"""Parallel layout of a job: trainer TP/PP/VPP/DP, rollout engines, micro-batches, nodes.

``plan_layout`` is pure arithmetic on a :class:`LayoutRequest` (model shape, cluster, recipe sizes). It collects
*every* reason a layout cannot run (each naming the recipe key or flag to change) and raises them
together as a :class:`LayoutError`, so one dry-run shows all that needs fixing.

Placement follows :mod:`megatron_gtpo.rollout.placement`:

* ``colocated``: trainer ranks and engines share every GPU; the GPUs are cut into engines of
  ``rollout_tp`` consecutive ranks (one per rank at rollout TP 1), i.e. Megatron's TP groups when
  the trainer's TP equals the engine's.
* ``separate``: rollout servers get whole nodes of their own at the end of the allocation, one
  server (one engine of ``rollout_tp`` GPUs) per node (``ROLLOUT_NODES`` of ``slurm/train.sbatch``);
  the trainer uses the remaining nodes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from megatron_gtpo.models.shape import ModelShape
from megatron_gtpo.parallel.layout import (batch_split_problem, context_parallel_problems, divisors,
                                          expert_world_problem,
                                           model_split_problems, pipeline_problem)
from megatron_gtpo.plan.engine_args import context_problem
from megatron_gtpo.utils.configuration import ConfigError


class LayoutError(ConfigError):
    """A layout that cannot run; ``problems`` holds one message per violated rule."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("impossible layout:\n" + "\n".join(f"  - {p}" for p in self.problems))


@dataclass(frozen=True, kw_only=True)
class Layout:
    """Where every rank and engine of a job runs, and how a step's batch is cut."""

    nodes: int
    """Nodes of the allocation."""
    gpus_per_node: int
    """GPUs per node (ranks per node on CPU)."""
    placement: Literal["colocated", "separate"]
    """Whether engines share the trainer's GPUs or own whole nodes."""
    trainer_nodes: int
    """Nodes running trainer ranks (all of them when colocated)."""
    rollout_nodes: int
    """Nodes holding only rollout engines (0 when colocated)."""
    tp: int
    """Trainer tensor-parallel size."""
    pp: int
    """Trainer pipeline-parallel size."""
    vpp: int | None
    """Virtual pipeline stages per PP rank (interleaved schedule), or None."""
    dp: int
    """Trainer data-parallel size: trainer GPUs / (TP * CP * PP)."""
    ep: int = 1
    """Expert-parallel size (mixture of experts; taken from the TP * CP * DP ranks of a stage)."""
    etp: int = 1
    """Expert tensor-parallel size."""
    layers_per_stage: int
    """Transformer blocks per PP rank (all of its virtual stages together)."""
    rollout_tp: int
    """Tensor-parallel size of one vLLM engine."""
    engines: int
    """vLLM engines in the job."""
    sequences: int
    """Sequences per step: prompts * completions per prompt."""
    sequences_per_engine: int
    """Sequences one engine generates per step (the largest share)."""
    sequences_in_flight: int
    """Sequences an engine may hold at once (what its KV cache is sized for): its share of one step,
    times k for rollout servers with ``rollout.staleness`` k >= 1 (the batches of the next k steps
    generate together); colocated engines generate one batch at a time."""
    micro_batch_size: int
    """Sequences per padded micro-batch; 1 when packing (``LayoutRequest.rows_per_micro_batch``)."""
    microbatches: int
    """Micro-batches each DP rank runs per step: sequences / (DP * micro_batch_size); when packing the
    most it can run (one row each), fewer when rows share a packed micro-batch."""
    seq_len: int
    """Longest sequence: max prompt tokens + max completion tokens."""
    warnings: list[str] = field(default_factory=list)
    """Legal but costly choices (TP across nodes, pipeline bubbles, idle GPUs)."""
    cp: int = 1
    """Trainer context-parallel size: every sequence split over this many ranks."""

    @property
    def trainer_gpus(self) -> int:
        return self.trainer_nodes * self.gpus_per_node

    @property
    def world(self) -> int:
        """Trainer ranks (torchrun world size)."""
        return self.tp * self.cp * self.pp * self.dp


@dataclass(frozen=True, kw_only=True)
class LayoutRequest:
    """What a layout is planned from: the model, the cluster and the recipe's sizes."""

    shape: ModelShape
    """The model (from its config.json)."""
    nodes: int
    """Nodes of the allocation."""
    gpus_per_node: int
    """GPUs per node (ranks per node on CPU)."""
    tp: int
    """parallel.tp"""
    pp: int
    """parallel.pp"""
    vpp: int | None = None
    """parallel.vpp (None or 1: no interleaving)."""
    dp: int | None = None
    """parallel.dp as the recipe states it (must match what the GPUs give; None: no check)."""
    placement: str = "colocated"
    """sync.transport: ``colocated`` or ``separate``."""
    rollout_tp: int = 1
    """rollout.vllm.tensor_parallel_size"""
    engines: int | None = None
    """vLLM engines: None = as many as fit (colocated) / one rollout server (separate); with
    ``separate`` the number of rollout servers, one per rollout node (``ROLLOUT_NODES``)."""
    prompts_per_step: int = 1
    """train.prompts_per_step"""
    staleness: int = 0
    """rollout.staleness: rollout servers hold the batches of this many later steps at once."""
    group_size: int = 8
    """rollout.n"""
    rows_per_micro_batch: int = 1
    """``train.rows_per_micro_batch``: train.micro_batch_size for padded micro-batches
    (train.micro_batch_tokens: 0), 1 when packing (the default), which ignores micro_batch_size."""
    max_prompt_tokens: int = 1024
    """data.max_prompt_tokens"""
    max_completion_tokens: int = 1024
    """rollout.max_tokens"""
    cp: int = 1
    """parallel.cp"""
    cp_comm_type: str | list | None = None
    """model.megatron.cp_comm_type (Megatron's own setting; None = p2p)."""
    ep: int = 1
    """parallel.ep"""
    etp: int = 1
    """parallel.etp"""


def plan_layout(req: LayoutRequest) -> Layout:
    """Checks a layout and returns it; raises LayoutError listing every violated rule."""
    problems: list[str] = []
    _check_positive(problems, nodes=req.nodes, gpus_per_node=req.gpus_per_node, tp=req.tp, pp=req.pp, cp=req.cp,
                    rollout_tp=req.rollout_tp, prompts_per_step=req.prompts_per_step, group_size=req.group_size,
                    rows_per_micro_batch=req.rows_per_micro_batch)
    if problems:  # every rule below divides by these
        raise LayoutError(problems)
    shape, tp, pp, cp, gpus_per_node = req.shape, req.tp, req.pp, req.cp, req.gpus_per_node
    vpp = None if req.vpp in (None, 1) else req.vpp
    warnings: list[str] = []
    rollout_problems: list[str] = []  # reported after the trainer's, which the reader checks first
    engines, rollout_nodes = _plan_rollout(rollout_problems, warnings, req)
    trainer_gpus = max(req.nodes - rollout_nodes, 0) * gpus_per_node
    problems += model_split_problems(shape, tp=tp, pp=pp, vpp=vpp, ep=req.ep, etp=req.etp)
    problems += context_parallel_problems(shape, tp=tp, cp=cp, comm_type=req.cp_comm_type)
    model = tp * cp * pp
    # the sizes as the recipe sets them: CP named only when it is used
    names, sizes, keys = ("TP*CP*PP", f"{tp}*{cp}*{pp}", "parallel.tp/parallel.cp/parallel.pp") if cp > 1 else \
        ("TP*PP", f"{tp}*{pp}", "parallel.tp/parallel.pp")
    if trainer_gpus and trainer_gpus % model:
        problems.append(f"{trainer_gpus} trainer GPUs are not divisible by {names} = {sizes} = {model}: "
                        f"change {keys} or the GPU count")
    dp = max(trainer_gpus // model, 1)
    if req.dp is not None and req.dp != dp and not trainer_gpus % model:
        problems.append(f"parallel.dp={req.dp}, but {trainer_gpus} trainer GPUs / ({names} = {model}) give "
                        f"{dp} data-parallel ranks: set parallel.dp={dp}")
    if problem := expert_world_problem(tp * cp * dp, ep=req.ep, etp=req.etp):
        problems.append(problem)
    sequences = req.prompts_per_step * req.group_size
    microbatches = _check_batch(problems, warnings, sequences=sequences, dp=dp, mbs=req.rows_per_micro_batch,
                                pp=pp, vpp=vpp)
    seq_len = req.max_prompt_tokens + req.max_completion_tokens
    too_long = context_problem(context=shape.max_positions, source="the model's max_position_embeddings",
                               max_prompt_tokens=req.max_prompt_tokens, max_tokens=req.max_completion_tokens)
    if too_long:
        problems.append(too_long)
    if tp > gpus_per_node:
        warnings.append(f"TP={tp} spans nodes ({gpus_per_node} GPUs each): every layer then all-reduces "
                        f"over the network; keep parallel.tp <= {gpus_per_node}")
    problems += rollout_problems
    if problems:
        raise LayoutError(problems)
    return Layout(
        nodes=req.nodes, gpus_per_node=gpus_per_node, placement=req.placement,  # type: ignore[arg-type]
        trainer_nodes=req.nodes - rollout_nodes, rollout_nodes=rollout_nodes, tp=tp, pp=pp, vpp=vpp, ep=req.ep,
        etp=req.etp,
        dp=dp, layers_per_stage=shape.layers // pp, rollout_tp=req.rollout_tp, engines=engines, sequences=sequences,
        sequences_per_engine=math.ceil(sequences / engines), micro_batch_size=req.rows_per_micro_batch,
        sequences_in_flight=math.ceil(sequences / engines) * (max(req.staleness, 1) if req.placement == "separate"
                                                              else 1),
        microbatches=microbatches, seq_len=seq_len, warnings=warnings, cp=cp)


def _check_positive(problems: list[str], **values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or value < 1:
            problems.append(f"{name}={value!r} must be an integer >= 1")


def _check_batch(problems: list[str], warnings: list[str], *, sequences: int, dp: int, mbs: int,
                 pp: int, vpp: int | None) -> int:
    """Micro-batches per DP rank; the global batch must split evenly into DP * micro-batch."""
    problem = batch_split_problem(sequences, dp=dp, rows_per_micro_batch=mbs)
    if problem:
        problems.append(problem)
        return 0
    microbatches = sequences // (dp * mbs)
    problem = pipeline_problem(microbatches, pp=pp, vpp=vpp)
    if problem:
        problems.append(problem)
    elif pp > 1 and microbatches < pp:
        warnings.append(f"{microbatches} micro-batches for PP={pp}: most of the pipeline idles; "
                        f"use at least {pp} (smaller micro-batches or more prompts per step)")
    return microbatches


def _plan_rollout(problems: list[str], warnings: list[str], req: LayoutRequest) -> tuple[int, int]:
    """(engines, rollout-only nodes). vLLM's own rules plus the launcher's: an engine stays in a
    node; colocated engines span consecutive trainer ranks; a rollout server owns a whole node."""
    shape, rollout_tp, gpus_per_node, engines = req.shape, req.rollout_tp, req.gpus_per_node, req.engines
    if shape.heads % rollout_tp:
        problems.append(f"num_attention_heads={shape.heads} is not divisible by the rollout TP={rollout_tp} "
                        f"(rollout.vllm.tensor_parallel_size): choose among {divisors(shape.heads)}")
    if shape.kv_heads % rollout_tp and rollout_tp % shape.kv_heads:
        problems.append(f"num_key_value_heads={shape.kv_heads} and rollout TP={rollout_tp}: vLLM needs one to "
                        f"divide the other (rollout.vllm.tensor_parallel_size)")
    if rollout_tp > gpus_per_node or gpus_per_node % rollout_tp:
        problems.append(f"rollout TP={rollout_tp} must divide the {gpus_per_node} GPUs of a node: an engine "
                        f"spanning nodes needs a Ray cluster, which the launcher does not start")
        return engines or 1, 0
    if req.placement == "colocated":
        fit = req.nodes * gpus_per_node // rollout_tp
        if engines not in (None, fit):
            problems.append(f"colocated engines share all {req.nodes * gpus_per_node} GPUs: {fit} engines of "
                            f"TP={rollout_tp}, not {engines}")
        return fit, 0
    if req.placement != "separate":
        problems.append(f"placement={req.placement!r} must be 'colocated' or 'separate' (sync.transport)")
        return engines or 1, 0
    engines = engines or 1  # one rollout server per rollout node (slurm/train.sbatch ROLLOUT_NODES)
    if engines >= req.nodes:
        problems.append(f"separate placement: {engines} rollout server(s) take {engines} node(s), leaving none "
                        f"of the {req.nodes} for the trainer: add nodes or use fewer rollout nodes")
    elif rollout_tp < gpus_per_node:
        warnings.append(f"separate placement: a rollout server's engine of TP={rollout_tp} leaves "
                        f"{gpus_per_node - rollout_tp} GPU(s) of its node idle (one server per node): raise "
                        f"rollout.vllm.tensor_parallel_size")
    return engines, engines
