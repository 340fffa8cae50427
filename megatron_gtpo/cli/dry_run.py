"""``megatron-gtpo dry-run``: check a recipe's parallel layout on N nodes x G GPUs, and estimate memory.

Example::

    megatron-gtpo dry-run configs/gtpo.yaml parallel.tp=2 --nodes 2 --gpus-per-node 8 \\
        --hf-config configs/models/llama3-8b.json

Pure arithmetic from the model's ``config.json`` and the recipe: no GPU, no torch.distributed, no
weights. Prints the trainer layout (TP/PP/VPP/DP), the rollout engines and their TP, the
micro-batches, and a per-GPU memory estimate (weights, gradients, optimizer state, KV cache).
Exit status: 0 for a valid layout, 1 for an impossible one (every reason is printed, each naming
the key or flag to change), 2 for unreadable input.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_gtpo.plan.engine_args import check_vllm_kwargs, context_problem
from megatron_gtpo.plan.layout import Layout, LayoutError, plan_layout
from megatron_gtpo.plan.memory import GIB, MemoryEstimate, check_memory, estimate_memory, \
    optimizer_bytes_per_param
from megatron_gtpo.models.shape import ModelShape, load_model_shape
from megatron_gtpo.utils.configuration import ConfigError
from megatron_gtpo.config import load_config
from megatron_gtpo.models.resolve import resolve_model

EXIT_IMPOSSIBLE = 1
EXIT_BAD_INPUT = 2
_DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2,
                "auto": 2}


@dataclass(frozen=True, kw_only=True)
class RecipeSizes:
    """What dry-run reads from a recipe (see ``recipe_sizes``)."""

    tp: int
    """parallel.tp"""
    pp: int
    """parallel.pp"""
    vpp: int | None
    """parallel.vpp (None: no interleaving)"""
    dp: int | None
    """parallel.dp as the recipe states it (None: whatever the GPUs give)"""
    placement: str
    """'colocated' or 'separate' (sync.transport)"""
    rollout_tp: int
    """rollout.vllm.tensor_parallel_size"""
    engines: int | None
    """Number of vLLM engines, None: derived from the placement"""
    prompts_per_step: int
    """Prompts sampled per RL step."""
    group_size: int
    """Completions per prompt (G)."""
    micro_batch_size: int
    """Sequences per trainer micro-batch."""
    max_prompt_tokens: int
    """Longest prompt kept."""
    max_completion_tokens: int
    """rollout.max_tokens"""
    param_bytes: int = 2
    """Bytes of a trainer parameter (model dtype)."""
    grad_bytes: int = 4
    """Bytes of a gradient in Megatron's grad buffer."""
    optimizer: str = "adam"
    """Optimizer name (adam|sgd)."""
    distributed_optimizer: bool = False
    """Whether optimizer state is sharded over DP."""
    rollout_bytes: int = 2
    """Bytes of an engine weight / KV entry (vLLM dtype)."""
    gpu_memory_utilization: float = 0.9
    """rollout.vllm.gpu_memory_utilization"""
    max_model_len: int | None = None
    """rollout.vllm.max_model_len (None: the model's max_position_embeddings, checked by the layout)"""
    notes: list[str] = field(default_factory=list)
    """Assumptions made while reading the recipe."""


def build_parser() -> argparse.ArgumentParser:
    intro, rest = __doc__.split("\n\n", 1)
    parser = argparse.ArgumentParser(prog="megatron-gtpo dry-run", description=intro, epilog=rest,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe", help="YAML recipe, e.g. configs/gtpo.yaml")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="recipe overrides, as for `megatron-gtpo train` (e.g. parallel.tp=2)")
    parser.add_argument("--nodes", type=int, required=True, help="nodes of the SLURM allocation")
    parser.add_argument("--gpus-per-node", type=int, required=True,
                        help="GPUs per node (ranks per node, NPROC_PER_NODE, on CPU)")
    parser.add_argument("--hf-config", default=None,
                        help="HF config.json (or its directory) to size the model from; default: the "
                             "recipe's model directory. Copies for common models: configs/models/")
    parser.add_argument("--gpu-memory-gib", type=float, default=80.0,
                        help="memory of one GPU in GiB (default: 80, an H100/A100-80GB)")
    return parser


def main(argv: list[str] | None = None) -> int:
    # Intermixed: overrides may follow the flags, as in the README examples.
    args = build_parser().parse_intermixed_args(argv)
    try:
        cfg = load_config(args.recipe, args.overrides)
        check_vllm_kwargs(cfg.rollout.vllm)
        sizes = sizes_from_config(cfg)
        shape = load_model_shape(args.hf_config) if args.hf_config else model_shape_of(cfg.model.path)
    except ConfigError as err:
        print(f"dry-run: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return report(shape=shape, sizes=sizes, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                  gpu_memory_gib=args.gpu_memory_gib, title=" ".join([args.recipe, *args.overrides]))


def report(*, shape: ModelShape, sizes: RecipeSizes, nodes: int, gpus_per_node: int,
           gpu_memory_gib: float, title: str, out=None) -> int:
    """Plans, estimates and prints; returns the exit status."""
    out = out or sys.stdout
    print(f"dry-run: {title}", file=out)
    print(f"cluster  {nodes} node(s) x {gpus_per_node} GPU(s) = {nodes * gpus_per_node} GPUs", file=out)
    print(_model_line(shape), file=out)
    if sizes.max_model_len is not None:
        too_long = context_problem(context=sizes.max_model_len, source="rollout.vllm.max_model_len",
                                   max_prompt_tokens=sizes.max_prompt_tokens,
                                   max_tokens=sizes.max_completion_tokens)
        if too_long:
            print(f"REJECTED: {LayoutError([too_long])}", file=out)
            return EXIT_IMPOSSIBLE
    try:
        layout = plan_layout(
            shape=shape, nodes=nodes, gpus_per_node=gpus_per_node, tp=sizes.tp, pp=sizes.pp, vpp=sizes.vpp, dp=sizes.dp,
            placement=sizes.placement, rollout_tp=sizes.rollout_tp, engines=sizes.engines,
            prompts_per_step=sizes.prompts_per_step, group_size=sizes.group_size,
            micro_batch_size=sizes.micro_batch_size, max_prompt_tokens=sizes.max_prompt_tokens,
            max_completion_tokens=sizes.max_completion_tokens)
    except LayoutError as err:
        print(f"REJECTED: {err}", file=out)
        return EXIT_IMPOSSIBLE
    mem = estimate_memory(shape=shape, layout=layout, param_bytes=sizes.param_bytes, grad_bytes=sizes.grad_bytes,
                          optimizer=sizes.optimizer, distributed_optimizer=sizes.distributed_optimizer,
                          rollout_bytes=sizes.rollout_bytes, gpu_memory_gib=gpu_memory_gib,
                          gpu_memory_utilization=sizes.gpu_memory_utilization)
    problems, warnings = check_memory(mem, layout)
    for line in [*_layout_lines(layout), *_memory_lines(mem, layout, sizes)]:
        print(line, file=out)
    for note in [*sizes.notes, *layout.warnings, *warnings, *_driver_notes(layout)]:
        print(f"warning  {note}", file=out)
    if problems:
        print(LayoutError(problems).args[0].replace("impossible layout", "REJECTED: does not fit"), file=out)
        return EXIT_IMPOSSIBLE
    print(f"OK       launch: {_sbatch_hint(layout)}", file=out)
    return 0


def _driver_notes(lay: Layout) -> list[str]:
    """Layouts vLLM and Megatron accept but today's driver (megatron_gtpo.sync.placement) does not run."""
    notes = []
    if lay.placement == "colocated" and lay.rollout_tp > 1:
        notes.append(f"colocated engines of TP={lay.rollout_tp}: sync/placement.py gives every trainer rank its own "
                     f"TP=1 engine today; engines spanning ranks need driver support")
    if lay.placement == "separate":
        notes.append("separate: the driver starts its engine next to trainer rank 0 today; engines on rollout "
                     "nodes need an engine server started by slurm/train.sbatch (ROLLOUT_CMD)")
    return notes


def _model_line(shape: ModelShape) -> str:
    return (f"model    {shape.name} ({shape.family}): {shape.layers} layers, hidden {shape.hidden}, "
            f"{shape.heads} heads / {shape.kv_heads} KV heads x {shape.head_dim}, vocab {shape.vocab}, "
            f"{shape.params_total() / 1e9:.2f} B parameters")


def _layout_lines(lay: Layout) -> list[str]:
    vpp = f" x VPP={lay.vpp}" if lay.vpp else ""
    stage = f"{lay.layers_per_stage} layers per PP stage" + (
        f" ({lay.layers_per_stage // lay.vpp} per virtual stage)" if lay.vpp else "")
    if lay.placement == "colocated":
        rollout = (f"colocated on the trainer's {lay.trainer_gpus} GPUs: {lay.engines} vLLM engine(s) x "
                   f"TP={lay.rollout_tp}")
    else:
        rollout = (f"separate: {lay.engines} vLLM engine(s) x TP={lay.rollout_tp} on {lay.rollout_nodes} "
                   f"rollout node(s) of their own")
    return [
        f"trainer  TP={lay.tp} x PP={lay.pp}{vpp} x DP={lay.dp} = {lay.world} ranks on {lay.trainer_nodes} "
        f"node(s); {stage}",
        f"rollout  {rollout}; {lay.sequences_per_engine} sequences per engine per step",
        f"batch    {lay.sequences} sequences per step; {lay.sequences // lay.dp} per DP rank = "
        f"{lay.microbatches} micro-batch(es) of {lay.micro_batch_size}; up to {lay.seq_len} tokens each",
    ]


def _memory_lines(mem: MemoryEstimate, lay: Layout, sizes: RecipeSizes) -> list[str]:
    opt_bytes = optimizer_bytes_per_param(optimizer=sizes.optimizer, param_bytes=sizes.param_bytes)
    sharded = f"sharded over DP={lay.dp}" if sizes.distributed_optimizer else "not sharded"
    rows = [
        (f"weights ({_dtype(sizes.param_bytes)})", mem.weights, ""),
        (f"gradients ({_dtype(sizes.grad_bytes)})", mem.grads, ""),
        (f"optimizer ({sizes.optimizer}, {opt_bytes} B/param)", mem.optimizer, sharded),
        ("logits (fp32, 1 micro-batch)", mem.logits, "last stage"),
        ("trainer total", mem.trainer_total, "activations not counted"),
        (f"rollout weights ({_dtype(sizes.rollout_bytes)}, TP={lay.rollout_tp})", mem.rollout_weights, ""),
        (f"KV cache ({lay.sequences_per_engine} seqs x {lay.seq_len} tokens)", mem.kv_needed,
         f"{mem.kv_available / GIB:.1f} GiB free for KV at gpu_memory_utilization={mem.gpu_memory_utilization}"),
    ]
    # GiB for real models; MiB when everything would print as 0.0 GiB (the CPU test recipes).
    unit, name = (GIB, "GiB") if max(mem.trainer_total, mem.rollout_weights) >= GIB else (1 << 20, "MiB")
    lines = [f"memory   per GPU, {name} (largest pipeline stage; one GPU has {mem.gpu / GIB:.0f} GiB):"]
    lines += [f"  {label:<42}{value / unit:>8.1f}  {note}".rstrip() for label, value, note in rows]
    return lines


def _dtype(nbytes: int) -> str:
    return {4: "fp32", 2: "bf16", 1: "fp8"}.get(nbytes, f"{nbytes} B")


def _sbatch_hint(lay: Layout) -> str:
    env = f"ROLLOUT_NODES={lay.rollout_nodes} " if lay.rollout_nodes else ""
    return (f"{env}sbatch --nodes={lay.nodes} --gpus-per-node={lay.gpus_per_node} slurm/train.sbatch "
            f"RECIPE [OVERRIDES]  (torchrun: {lay.trainer_nodes} node(s) x {lay.gpus_per_node} ranks)")


# ----------------------------------------------------------------------------- recipe

def sizes_from_config(cfg: Any) -> RecipeSizes:
    """Maps a RunConfig onto RecipeSizes: the one place that knows the recipe's key names."""
    vllm, optimizer, ddp = cfg.rollout.vllm, cfg.optim.optimizer, cfg.optim.ddp
    param_bytes = _DTYPE_BYTES[cfg.model.dtype]
    notes = []
    engine_dtype = str(vllm.get("dtype", "auto"))
    if engine_dtype not in _DTYPE_BYTES:
        raise ConfigError(f"rollout.vllm.dtype={engine_dtype!r} is not one of {', '.join(_DTYPE_BYTES)}")
    if engine_dtype == "auto":
        notes.append("rollout.vllm.dtype is auto: engine weights and KV cache counted as bf16")
    return RecipeSizes(
        tp=cfg.parallel.tp, pp=cfg.parallel.pp, vpp=cfg.parallel.vpp, dp=cfg.parallel.dp,
        placement=cfg.sync.transport, rollout_tp=int(vllm.get("tensor_parallel_size", 1)), engines=None,
        prompts_per_step=cfg.train.prompts_per_step, group_size=cfg.rollout.n,
        micro_batch_size=cfg.train.micro_batch_size, max_prompt_tokens=cfg.data.max_prompt_tokens,
        max_completion_tokens=cfg.rollout.max_tokens, param_bytes=param_bytes,
        grad_bytes=4 if ddp.get("grad_reduce_in_fp32", False) else param_bytes,
        optimizer=str(optimizer.get("optimizer", "adam")),
        distributed_optimizer=bool(optimizer.get("use_distributed_optimizer", False)),
        rollout_bytes=_DTYPE_BYTES[engine_dtype],
        gpu_memory_utilization=float(vllm.get("gpu_memory_utilization", 0.9)),
        max_model_len=None if vllm.get("max_model_len") is None else int(vllm["max_model_len"]), notes=notes)


def model_shape_of(model_path: str) -> ModelShape:
    """Shape of ``model.path``: a model directory's config.json, or a built-in name ('tiny', 'smollm2' ...)
    resolved by megatron_gtpo.models (which builds such a test model once and caches it)."""
    path = Path(model_path).expanduser()
    if not path.is_dir():
        try:
            path = resolve_model(model_path)
        except FileNotFoundError as err:
            raise ConfigError(f"{err}; or pass --hf-config with the model's Hugging Face config.json "
                              f"(copies for common models: configs/models/)") from None
    if not (path / "config.json").is_file():
        raise ConfigError(f"model.path={model_path!r} has no config.json; pass --hf-config with the model's "
                          f"Hugging Face config.json (copies for common models: configs/models/)")
    return load_model_shape(path)
