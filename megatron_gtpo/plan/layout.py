"""Parallel layout of a job: trainer TP/PP/VPP/DP, rollout engines, micro-batches, nodes.

``plan_layout`` is pure arithmetic on a :class:`ModelShape` and the recipe's sizes. It collects
*every* reason a layout cannot run (each naming the recipe key or flag to change) and raises them
together as a :class:`LayoutError`, so one dry-run shows all that needs fixing.

Placement follows :mod:`megatron_gtpo.sync.placement`:

* ``colocated``: trainer ranks and engines share every GPU; the GPUs are cut into engines of
  ``rollout_tp`` GPUs (one per rank at rollout TP 1).
* ``separate``: the engines get GPUs of their own, whole nodes at the end of the allocation
  (``ROLLOUT_NODES`` of ``slurm/train.sbatch``); the trainer uses the remaining nodes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from megatron_gtpo.models.shape import ModelShape
from megatron_gtpo.parallel.layout import batch_split_problem, divisors, model_split_problems, pipeline_problem
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
    """Trainer data-parallel size: trainer GPUs / (TP * PP)."""
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
    micro_batch_size: int
    """Sequences per micro-batch."""
    microbatches: int
    """Micro-batches each DP rank runs per step: sequences / (DP * micro_batch_size)."""
    seq_len: int
    """Longest sequence: max prompt tokens + max completion tokens."""
    warnings: list[str] = field(default_factory=list)
    """Legal but costly choices (TP across nodes, pipeline bubbles, idle GPUs)."""

    @property
    def trainer_gpus(self) -> int:
        return self.trainer_nodes * self.gpus_per_node

    @property
    def world(self) -> int:
        """Trainer ranks (torchrun world size)."""
        return self.tp * self.pp * self.dp


def plan_layout(*, shape: ModelShape, nodes: int, gpus_per_node: int, tp: int, pp: int,
                vpp: int | None, dp: int | None = None, placement: str, rollout_tp: int, engines: int | None,
                prompts_per_step: int, group_size: int, micro_batch_size: int,
                max_prompt_tokens: int, max_completion_tokens: int) -> Layout:
    """Checks a layout and returns it; raises LayoutError listing every violated rule.

    ``dp`` is the recipe's own data-parallel size (it must match what the GPUs give; None: no check).
    ``engines`` None means "as many as fit" (colocated) or one (separate, as the driver runs it).
    """
    problems: list[str] = []
    _check_positive(problems, nodes=nodes, gpus_per_node=gpus_per_node, tp=tp, pp=pp,
                    rollout_tp=rollout_tp, prompts_per_step=prompts_per_step, group_size=group_size,
                    micro_batch_size=micro_batch_size)
    if problems:  # every rule below divides by these
        raise LayoutError(problems)
    vpp = None if vpp in (None, 1) else vpp
    warnings: list[str] = []
    rollout_problems: list[str] = []  # reported after the trainer's, which the reader checks first
    engines, rollout_nodes = _plan_rollout(rollout_problems, warnings, shape=shape, nodes=nodes,
                                           gpus_per_node=gpus_per_node, placement=placement,
                                           rollout_tp=rollout_tp, engines=engines)
    trainer_gpus = max(nodes - rollout_nodes, 0) * gpus_per_node
    problems += model_split_problems(shape, tp=tp, pp=pp, vpp=vpp)
    if trainer_gpus and trainer_gpus % (tp * pp):
        problems.append(f"{trainer_gpus} trainer GPUs are not divisible by TP*PP = {tp}*{pp} = {tp * pp}: "
                        f"change parallel.tp/parallel.pp or the GPU count")
    derived_dp = max(trainer_gpus // (tp * pp), 1)
    if dp is not None and dp != derived_dp and not trainer_gpus % (tp * pp):
        problems.append(f"parallel.dp={dp}, but {trainer_gpus} trainer GPUs / (TP*PP = {tp * pp}) give "
                        f"{derived_dp} data-parallel ranks: set parallel.dp={derived_dp}")
    dp = derived_dp
    sequences = prompts_per_step * group_size
    microbatches = _check_batch(problems, warnings, sequences=sequences, dp=dp, mbs=micro_batch_size,
                                pp=pp, vpp=vpp)
    seq_len = max_prompt_tokens + max_completion_tokens
    too_long = context_problem(context=shape.max_positions, source="the model's max_position_embeddings",
                               max_prompt_tokens=max_prompt_tokens, max_tokens=max_completion_tokens)
    if too_long:
        problems.append(too_long)
    if tp > gpus_per_node:
        warnings.append(f"TP={tp} spans nodes ({gpus_per_node} GPUs each): every layer then all-reduces "
                        f"over the network; keep parallel.tp <= {gpus_per_node}")
    problems += rollout_problems
    if problems:
        raise LayoutError(problems)
    return Layout(
        nodes=nodes, gpus_per_node=gpus_per_node, placement=placement,  # type: ignore[arg-type]
        trainer_nodes=nodes - rollout_nodes, rollout_nodes=rollout_nodes, tp=tp, pp=pp, vpp=vpp,
        dp=dp, layers_per_stage=shape.layers // pp,
        rollout_tp=rollout_tp, engines=engines, sequences=sequences,
        sequences_per_engine=math.ceil(sequences / engines), micro_batch_size=micro_batch_size,
        microbatches=microbatches, seq_len=seq_len, warnings=warnings)


def _check_positive(problems: list[str], **values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or value < 1:
            problems.append(f"{name}={value!r} must be an integer >= 1")


def _check_batch(problems: list[str], warnings: list[str], *, sequences: int, dp: int, mbs: int,
                 pp: int, vpp: int | None) -> int:
    """Micro-batches per DP rank; the global batch must split evenly into DP * micro-batch."""
    problem = batch_split_problem(sequences, dp=dp, micro_batch_size=mbs)
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


def _plan_rollout(problems: list[str], warnings: list[str], *, shape: ModelShape, nodes: int,
                  gpus_per_node: int, placement: str, rollout_tp: int, engines: int | None) -> tuple[int, int]:
    """(engines, rollout-only nodes). vLLM's own rules plus the launcher's: an engine stays in a node."""
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
    if placement == "colocated":
        fit = nodes * gpus_per_node // rollout_tp
        if engines not in (None, fit):
            problems.append(f"colocated engines share all {nodes * gpus_per_node} GPUs: {fit} engines of "
                            f"TP={rollout_tp}, not {engines}")
        return fit, 0
    if placement != "separate":
        problems.append(f"placement={placement!r} must be 'colocated' or 'separate' (sync.transport)")
        return engines or 1, 0
    engines = engines or 1
    rollout_gpus = engines * rollout_tp
    rollout_nodes = math.ceil(rollout_gpus / gpus_per_node)
    if rollout_nodes >= nodes:
        problems.append(f"separate placement: {engines} engine(s) of TP={rollout_tp} take {rollout_nodes} "
                        f"node(s), leaving none of the {nodes} for the trainer: add nodes or shrink the engines")
    elif rollout_gpus % gpus_per_node:
        warnings.append(f"separate placement: {rollout_nodes * gpus_per_node - rollout_gpus} GPU(s) of the "
                        f"rollout node(s) stay idle")
    return engines, rollout_nodes
