"""``megatron-gtpo dry-run``: check a recipe's parallel layout on N nodes x G GPUs, and estimate memory.

Example::

    megatron-gtpo dry-run configs/gtpo.yaml parallel.tp=2 --nodes 2 --gpus-per-node 8 \\
        --hf-config configs/models/llama3-8b.json

Pure arithmetic from the model's ``config.json`` and the recipe: no GPU, no torch.distributed, no
weights. Prints the trainer layout (TP/PP/VPP/DP), the rollout engines (colocated engines of TP=k
over k trainer ranks, or rollout servers x TP on nodes of their own: ``sync.transport: separate``
with ``--rollout-nodes``), the micro-batches, the weight push of one step, and the per-GPU memory
plan term by term, phase by phase, with the vLLM share it leaves (``gpu_memory_utilization``, which
the driver then uses unless the recipe sets it).
Exit status: 0 for a valid layout, 1 for an impossible one (every reason is printed, each naming
the key or flag to change), 2 for unreadable input.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from functools import partial
from pathlib import Path

import torch

from megatron_gtpo.config import load_config
from megatron_gtpo.models.hub import CONFIG_ONLY
from megatron_gtpo.models.resolve import resolve_model
from megatron_gtpo.models.shape import ModelShape, load_model_shape
from megatron_gtpo.plan.checkpoint_cost import checkpoint_cost, checkpoint_warnings
from megatron_gtpo.plan.engine_args import check_vllm_kwargs, context_problem
from megatron_gtpo.plan.layout import Layout, LayoutError, LayoutRequest, plan_layout
from megatron_gtpo.plan.memory import GIB, MemoryEstimate, MemorySizes, check_memory, estimate_memory, \
    expert_data_parallel, in_flight, micro_batch_dims, optimizer_bytes_per_param, push_bytes
from megatron_gtpo.plan.recipe import recipe_request
from megatron_gtpo.tracking.perf import TrainWork, known_peak, precision_of
from megatron_gtpo.train.lora import adapter_params
from megatron_gtpo.utils.configuration import ConfigError, apply_overrides, load_recipe

EXIT_IMPOSSIBLE = 1
EXIT_BAD_INPUT = 2


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
    parser.add_argument("--rollout-nodes", type=int, default=None,
                        help="sync.transport=separate: nodes running one rollout server each (ROLLOUT_NODES); "
                             "default 1")
    parser.add_argument("--hf-config", default=None,
                        help="HF config.json (or its directory) to size the model from; default: the "
                             "recipe's model directory. Copies for common models: configs/models/")
    parser.add_argument("--gpu-memory-gib", type=float, default=80.0,
                        help="memory of one GPU in GiB (default: 80, an H100/A100-80GB)")
    parser.add_argument("--fs-gbps", type=float, default=2.0,
                        help="the job's write bandwidth to the checkpoint directory in GB/s, for the time per save "
                             "(default: 2, a shared parallel filesystem; measure yours)")
    parser.add_argument("--step-time-s", type=float, default=120.0,
                        help="expected seconds per training step, to judge the checkpoints' share of the time "
                             "(default: 120, a guess for long completions; take it from a run's step lines)")
    parser.add_argument("--disk-gib", type=float, default=None,
                        help="space of the checkpoint directory in GiB: warn when the kept checkpoints need over half")
    return parser


def main(argv: list[str] | None = None) -> int:
    # Intermixed: overrides may follow the flags, as in the README examples.
    args = build_parser().parse_intermixed_args(argv)
    try:
        cfg = load_config(args.recipe, args.overrides)
        check_vllm_kwargs(cfg.rollout.vllm)
        shape = load_model_shape(args.hf_config) if args.hf_config else model_shape_of(cfg.model.path)
        request, sizes, notes = recipe_request(cfg, shape=shape, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                                               rollout_nodes=args.rollout_nodes, gpu_memory_gib=args.gpu_memory_gib)
        if not sets_dp(args.recipe, args.overrides):
            request = dataclasses.replace(request, dp=None)  # plan_layout derives it from the GPUs
    except ConfigError as err:
        print(f"dry-run: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    max_model_len = cfg.rollout.vllm.get("max_model_len")
    lines, warnings = _checkpoint_lines(cfg, shape, sizes, args)
    return report(request, sizes, notes=[*notes, *warnings], title=" ".join([args.recipe, *args.overrides]),
                  max_model_len=None if max_model_len is None else int(max_model_len), extra_lines=lines,
                  perf_line=partial(_perf_line, cfg, shape))


def _perf_line(cfg, shape: ModelShape, lay: Layout) -> str:
    """Model FLOPs of a step's train phase at full-length rows (an upper bound) and what an assumed
    MFU (``perf.plan_mfu``) makes of them on ``lay``'s trainer GPUs: seconds and tokens/s/GPU."""
    spec, row = cfg.algorithm, cfg.longest_row
    rows = cfg.train.prompts_per_step * cfg.rollout.n
    precision = precision_of(cfg.model.dtype, cfg.model.megatron)
    peak, source = cfg.perf.peak_tflops, "perf.peak_tflops"
    if peak is None:
        peak, source = known_peak("H100", precision), f"H100 SXM {precision} datasheet; set perf.peak_tflops for others"
    work = TrainWork.of_run(shape, spec=spec, lora=cfg.model.lora)
    tokens, flops = work.of(torch.full((rows,), row), torch.zeros(rows, dtype=torch.long))
    seconds = flops / (lay.trainer_gpus * peak * 1e12 * cfg.perf.plan_mfu)
    return (f"perf     {flops / tokens / 1e9:.3g} GFLOP per token (6N + 12LdS at {row}-token rows, {spec.mu} update(s)"
            f"{' + reference forward' if work.forward_passes else ''}), {flops / 1e12:.3g} TFLOP per train phase of "
            f"{rows} full-length rows; peak {peak:g} TFLOPS/GPU ({source}); at an assumed MFU of "
            f"{cfg.perf.plan_mfu:.0%} (perf.plan_mfu): ~{seconds:.3g} s per train phase, "
            f"{tokens / seconds / lay.trainer_gpus:.3g} tokens/s/GPU")


def _checkpoint_lines(cfg, shape: ModelShape, sizes: MemorySizes, args) -> tuple[list[str], list[str]]:
    """The checkpoint line (size, time and disk of the recipe's saves) and its warnings."""
    lora, train = sizes.lora, cfg.train
    params = adapter_params(lora, shape, tp=1) if lora is not None else shape.params_total()
    cost = checkpoint_cost(params, param_bytes=sizes.param_bytes, optimizer=sizes.optimizer,
                           keep_last=train.keep_last, fs_gbps=args.fs_gbps)
    what = "LoRA adapters + their optimizer state" if lora is not None else "weights + optimizer state"
    line = (f"ckpt     {cost.bytes_per_save / GIB:.1f} GiB per save ({what}) every {train.checkpoint_every} step(s), "
            f"{cost.disk_bytes / GIB:.1f} GiB on disk (train.keep_last={train.keep_last} + the save in progress); "
            f"~{cost.seconds_per_save:.0f} s per save at {args.fs_gbps:g} GB/s (--fs-gbps)")
    return [line], checkpoint_warnings(cost, every=train.checkpoint_every, step_time_s=args.step_time_s,
                                       disk_gib=args.disk_gib)


def report(request: LayoutRequest, sizes: MemorySizes, *, notes: list[str] = (), title: str = "", out=None,
           max_model_len: int | None = None, extra_lines: list[str] = (), perf_line=None) -> int:
    """Plans, estimates and prints; returns the exit status (``perf_line(layout)``: the MFU line)."""
    out = out or sys.stdout
    print(f"dry-run: {title}", file=out)
    print(f"cluster  {request.nodes} node(s) x {request.gpus_per_node} GPU(s) = "
          f"{request.nodes * request.gpus_per_node} GPUs", file=out)
    print(_model_line(request.shape), file=out)
    if max_model_len is not None:
        too_long = context_problem(context=max_model_len, source="rollout.vllm.max_model_len",
                                   max_prompt_tokens=request.max_prompt_tokens,
                                   max_tokens=request.max_completion_tokens)
        if too_long:
            print(f"REJECTED: {LayoutError([too_long])}", file=out)
            return EXIT_IMPOSSIBLE
    try:
        layout = plan_layout(request)
    except LayoutError as err:
        print(f"REJECTED: {err}", file=out)
        return EXIT_IMPOSSIBLE
    if request.dp is None:
        notes = [*notes, f"parallel.dp is not set: derived DP={layout.dp} from the GPUs; `train` needs it "
                         f"set, add parallel.dp={layout.dp} to the recipe or the sbatch line"]
    mem = estimate_memory(request.shape, layout, sizes)
    problems, warnings = check_memory(mem, layout)
    lines = [*_layout_lines(layout, sizes), _push_line(request.shape, layout, sizes),
             *_routing_lines(request.shape, layout), *_host_lines(mem, layout),
             *_lora_lines(mem, sizes), *_memory_lines(mem, layout, sizes), *extra_lines,
             *([perf_line(layout)] if perf_line else [])]
    for line in lines:
        print(line, file=out)
    for note in [*notes, *layout.warnings, *warnings]:
        print(f"warning  {note}", file=out)
    if problems:
        print(LayoutError(problems).args[0].replace("impossible layout", "REJECTED: does not fit"), file=out)
        return EXIT_IMPOSSIBLE
    print(f"OK       launch: {_sbatch_hint(layout)}", file=out)
    return 0


def _model_line(shape: ModelShape) -> str:
    experts = (f", {shape.experts} experts x {shape.expert_ffn} (top-{shape.top_k}"
               + (f", shared expert {shape.shared_ffn})" if shape.shared_ffn else ")")) if shape.is_moe else ""
    return (f"model    {shape.name} ({shape.family}): {shape.layers} layers, hidden {shape.hidden}, "
            f"{shape.heads} heads / {shape.kv_heads} KV heads x {shape.head_dim}, vocab {shape.vocab}{experts}, "
            f"{shape.params_total() / 1e9:.2f} B parameters")


def _layout_lines(lay: Layout, sizes: MemorySizes) -> list[str]:
    vpp = f" x VPP={lay.vpp}" if lay.vpp else ""
    cp = f" x CP={lay.cp}" if lay.cp > 1 else ""
    stage = f"{lay.layers_per_stage} layers per PP stage" + (
        f" ({lay.layers_per_stage // lay.vpp} per virtual stage)" if lay.vpp else "")
    if lay.placement == "colocated":
        span = (f", each over {lay.rollout_tp} consecutive ranks = Megatron's TP groups" if lay.rollout_tp == lay.tp > 1
                else f", each over {lay.rollout_tp} consecutive ranks" if lay.rollout_tp > 1 else "")
        rollout = (f"colocated on the trainer's {lay.trainer_gpus} GPUs: {lay.engines} vLLM engine(s) x "
                   f"TP={lay.rollout_tp}{span}")
    else:
        rollout = (f"separate: {lay.engines} rollout server(s) x TP={lay.rollout_tp}, one per rollout node "
                   f"({lay.rollout_nodes} node(s) of their own)")
    experts = (f"; experts EP={lay.ep} x ETP={lay.etp} (from the TP x DP ranks of a stage)"
               if lay.ep > 1 or lay.etp > 1 else "")
    return [
        f"trainer  TP={lay.tp}{cp} x PP={lay.pp}{vpp} x DP={lay.dp} = {lay.world} ranks on {lay.trainer_nodes} "
        f"node(s); {stage}{experts}",
        f"rollout  {rollout}; {lay.sequences_per_engine} sequences per engine per step" + (
            f", up to {lay.sequences_in_flight} in flight (rollout.staleness: the next steps' batches)"
            if lay.sequences_in_flight > lay.sequences_per_engine else ""),
        f"batch    {lay.sequences} sequences per step; {lay.sequences // lay.dp} per DP rank " + (
            f"packed into micro-batches of <= {sizes.micro_batch_tokens} tokens (rows up to {lay.seq_len})"
            if sizes.micro_batch_tokens else
            f"= {lay.microbatches} micro-batch(es) of {lay.micro_batch_size}; up to {lay.seq_len} tokens each"),
    ]


def _push_line(shape: ModelShape, lay: Layout, sizes: MemorySizes) -> str:
    """Transfer volume of one step's weight push (sync/shards.py delivery modes)."""
    full = push_bytes(shape, sizes)
    if lay.placement == "separate":
        return (f"push     {full / GIB:.1f} GiB per step to each of {lay.engines} rollout server(s) "
                f"({lay.engines * full / GIB:.1f} GiB in all) from {lay.pp} sender rank(s) (TP rank 0 of each stage), "
                f"{sizes.bucket_bytes >> 20} MiB buckets")
    if lay.rollout_tp == lay.tp > 1:
        local = (shape.layers * shape.layer_params(lay.tp)
                 + shape.embedding_params() * (1 if shape.tied_embeddings else 2) + shape.hidden) * sizes.param_bytes
        return (f"push     {local / GIB:.1f} GiB per engine rank per step: its own TP shards, no gather (vocabulary "
                f"tensors whole); engine TP={lay.rollout_tp} = trainer TP")
    why = ("one whole-model engine per rank" if lay.rollout_tp == 1 else
           f"engine TP={lay.rollout_tp} != trainer TP={lay.tp}: vLLM cuts each engine rank's slice")
    return f"push     {full / GIB:.1f} GiB per engine rank per step: full tensors gathered over TP/PP one at a time ({why})"


def _routing_lines(shape: ModelShape, lay: Layout) -> list[str]:
    """What a mixture's routed experts cost per step: every completion carries ``[tokens - 1, layers,
    top_k]`` int16 (rollout/engine.py), gathered to every trainer rank from each engine's first rank
    (rollout/group.py) over the gloo control group; the bound is every sequence at full length."""
    if not shape.is_moe or lay.placement != "colocated":
        return []
    per_sequence = (lay.seq_len - 1) * shape.layers * shape.top_k * 2
    total = lay.sequences * per_sequence
    return [f"routing  <= {total / GIB:.2f} GiB of routed experts per step reach every rank over gloo "
            f"({lay.sequences} sequences x <= {per_sequence / 2**20:.2f} MiB, from the first rank of each of "
            f"{lay.engines} engine(s); each of its {lay.rollout_tp} ranks sending would be {lay.rollout_tp}x)"]


def _host_lines(mem: MemoryEstimate, lay: Layout) -> list[str]:
    """Host memory a rollout node stages a push in (separate transport only)."""
    if mem.colocated:
        return []
    return [f"host     {mem.host_staging / GIB:.1f} GiB staged per rollout node per push: one copy of the push in one "
            f"node-local staging area per server; each of its engine's {lay.rollout_tp} worker(s) takes only its own "
            f"shards (not one copy per worker)"]


def _lora_lines(mem: MemoryEstimate, sizes: MemorySizes) -> list[str]:
    """What LoRA trains and what it saves against full fine-tuning of the same layout (none without LoRA)."""
    lora = sizes.lora
    if lora is None:
        return []
    state, unit = mem.grads + mem.optimizer, GIB if mem.full_state >= GIB else 1 << 20
    name = "GiB" if unit == GIB else "MiB"
    targets = ", ".join(t.name for t in lora.targets())
    return [f"lora     r={lora.rank}, alpha/r={lora.scale:g} on {targets}: {mem.adapters / sizes.param_bytes / 1e6:.1f} M "
            f"adapter parameters per rank ({100 * mem.adapters / mem.weights:.1f}% of its weights); the base is frozen",
            f"lora     gradients + optimizer {state / unit:.2f} {name} per GPU vs {mem.full_state / unit:.2f} {name} for "
            f"full fine-tuning: {(mem.full_state - state) / unit:.2f} {name} saved ({100 * state / mem.full_state:.1f}% "
            f"of full)"]


def _memory_lines(mem: MemoryEstimate, lay: Layout, sizes: MemorySizes) -> list[str]:
    opt_bytes = optimizer_bytes_per_param(optimizer=sizes.optimizer, param_bytes=sizes.param_bytes)
    sharded = (f"sharded over DP={lay.dp}" + (f" x CP={lay.cp}" if lay.cp > 1 else "")) if sizes.distributed_optimizer \
        else "not sharded"
    lora = sizes.lora is not None
    sharded += "; LoRA adapters only" if lora else ""
    if sizes.distributed_optimizer and mem.expert_weights:
        sharded += f" (experts over their {expert_data_parallel(lay)} expert-DP rank(s))"
    experts = f"{mem.expert_weights / GIB:.1f} GiB of it this EP rank's experts" if mem.expert_weights else ""
    util = (f"gpu_memory_utilization={mem.gpu_memory_utilization} "
            f"({'set by the recipe' if not mem.planned else 'planned: what the rollout phase leaves' if mem.colocated else 'planned: a rollout node holds nothing else'})")
    held = "one decoder layer in vLLM's reload" if mem.colocated else f"one bucket of {sizes.bucket_bytes >> 20} MiB"
    rows = [
        (f"weights ({_dtype(sizes.param_bytes)})", mem.weights,
         f"frozen base + {mem.adapters / GIB:.2f} GiB of LoRA adapters" if lora else experts),
        (f"gradients ({_dtype(sizes.grad_bytes)})", mem.grads, "LoRA adapters only" if lora else ""),
        (f"optimizer ({sizes.optimizer}, {opt_bytes} B/param)", mem.optimizer, sharded),
        ("reference model (KL term)", mem.reference, "" if mem.reference else
         "none: the base, adapters disabled" if lora and sizes.reference else "none: kl_beta = 0"),
        (f"logits (1 micro-batch: 2 copies, {_dtype(sizes.logits_bytes)})", mem.logits,
         f"last stage; {_micro_batch(lay, sizes)}"),
        (f"activations ({sizes.layer_spec} layers)", mem.activations,
         f"recompute: {sizes.recompute or 'none'}; {in_flight(lay):g} micro-batch(es) in flight"),
        ("= train phase (trainer total)", mem.trainer_total, ""),
        ("push buffers", mem.push, f"{held} + one gathered tensor"),
        ("= push phase", mem.push_phase, "trainer + engine weights + push" if mem.colocated else "trainer + push"),
        (f"rollout weights ({_dtype(sizes.rollout_bytes)}, TP={lay.rollout_tp})", mem.rollout_weights, ""),
        (f"KV cache ({lay.sequences_in_flight} seqs x {lay.seq_len} tokens)", mem.kv_needed,
         f"{mem.kv_cache / GIB:.1f} GiB " + ("set: rollout.vllm.kv_cache_memory_bytes" if mem.kv_cache_bytes is not None
                                             else "free for KV")),
        ("vLLM share", mem.engine_share, util),
    ]
    if mem.colocated:
        resident = ("weights only: rollout.offload_trainer" if mem.offload_trainer else
                    "weights + gradients + optimizer") + (" + reference" if mem.reference else "")
        rows.append(("= rollout phase (trainer resident + vLLM)", mem.trainer_resident + mem.engine_share,
                     f"trainer resident {mem.trainer_resident / GIB:.1f} ({resident})"))
    rows.append(("reserve (CUDA context, NCCL, fragmentation)", mem.reserve, ""))
    # GiB for real models; MiB when everything would print as 0.0 GiB (the CPU test recipes).
    unit, name = (GIB, "GiB") if max(mem.trainer_total, mem.rollout_weights) >= GIB else (1 << 20, "MiB")
    lines = [f"memory   per GPU, {name} (largest pipeline stage; one GPU has {mem.gpu / GIB:.0f} GiB):"]
    lines += [f"  {label:<44}{value / unit:>8.1f}  {note}".rstrip() for label, value, note in rows]
    return lines


def _micro_batch(lay: Layout, sizes: MemorySizes) -> str:
    rows, tokens = micro_batch_dims(lay, sizes)
    share = f", {tokens // lay.cp} of them on each of CP={lay.cp} ranks" if lay.cp > 1 else ""
    return (f"packed: 1 row of {tokens} tokens" if sizes.micro_batch_tokens else f"{rows} rows x {tokens} tokens") + share


def _dtype(nbytes: int) -> str:
    return {4: "fp32", 2: "bf16", 1: "fp8"}.get(nbytes, f"{nbytes} B")


def _sbatch_hint(lay: Layout) -> str:
    env = f"ROLLOUT_NODES={lay.rollout_nodes} " if lay.rollout_nodes else ""
    return (f"{env}sbatch --nodes={lay.nodes} --gpus-per-node={lay.gpus_per_node} slurm/train.sbatch "
            f"RECIPE [OVERRIDES]  (torchrun: {lay.trainer_nodes} node(s) x {lay.gpus_per_node} ranks)")


# ----------------------------------------------------------------------------- recipe

def sets_dp(recipe: str, overrides: list[str]) -> bool:
    """Whether the recipe (with its ``base:`` chain) or an override sets ``parallel.dp``; when
    neither does, the dry-run derives DP from ``--nodes x --gpus-per-node`` instead of the default 1."""
    data = apply_overrides(load_recipe(recipe), overrides)
    parallel = data.get("parallel")
    return isinstance(parallel, dict) and "dp" in parallel


def model_shape_of(model_path: str) -> ModelShape:
    """Shape of ``model.path``: a model directory's config.json, or a built-in name ('tiny', 'smollm2' ...)
    resolved by megatron_gtpo.models (which builds such a test model once and caches it)."""
    path = Path(model_path).expanduser()
    if not path.is_dir():
        try:
            path = resolve_model(model_path, hub_files=CONFIG_ONLY)  # a hub id: config.json only
        except FileNotFoundError as err:
            raise ConfigError(f"{err}; or pass --hf-config with the model's Hugging Face config.json "
                              f"(copies for common models: configs/models/)") from None
    if not (path / "config.json").is_file():
        raise ConfigError(f"model.path={model_path!r} has no config.json; pass --hf-config with the model's "
                          f"Hugging Face config.json (copies for common models: configs/models/)")
    return load_model_shape(path)
