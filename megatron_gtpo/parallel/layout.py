"""The divisibility rules of a parallel layout: the one place they are written.

Megatron asserts most of these deep inside model construction or its schedules; here each rule
names the setting to change and the values that work. The model builder raises on them
(``train.model.check_layout``), the dry-run reports all of them at once (``launch.layout``), the
config checks the batch split at load time, and the train step refuses a batch that breaks it.
"""

from __future__ import annotations

from megatron_gtpo.models.shape import ModelShape


def divisors(n: int) -> str:
    """``"1, 2, 3, 6"`` for 6: the values a message offers."""
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def model_split_problems(shape: ModelShape, *, tp: int, pp: int, vpp: int | None, ep: int = 1,
                         etp: int = 1) -> list[str]:
    """Every reason a model cannot be split into ``tp`` x ``pp`` (x ``vpp``) pieces, its experts
    into ``ep`` x ``etp``."""
    problems = expert_split_problems(shape, tp=tp, ep=ep, etp=etp)
    if shape.heads % tp:
        problems.append(f"num_attention_heads={shape.heads} is not divisible by TP={tp}: "
                        f"choose parallel.tp among {divisors(shape.heads)}")
    if shape.kv_heads % tp:
        problems.append(f"num_key_value_heads={shape.kv_heads} is not divisible by TP={tp} (Megatron splits "
                        f"query groups evenly): choose parallel.tp among {divisors(shape.kv_heads)}")
    if shape.heads % shape.kv_heads:
        problems.append(f"num_attention_heads={shape.heads} is not a multiple of num_key_value_heads={shape.kv_heads}")
    if shape.ffn % tp and not shape.is_moe:  # (the vocabulary is padded to a multiple of TP: padded_vocab_size)
        problems.append(f"intermediate_size={shape.ffn} is not divisible by TP={tp}: choose parallel.tp dividing it")
    if shape.layers % pp:
        problems.append(f"num_hidden_layers={shape.layers} is not divisible by PP={pp}: "
                        f"choose parallel.pp among {divisors(shape.layers)}")
    elif vpp is not None:
        if pp < 2:
            problems.append(f"VPP={vpp} needs PP >= 2 (the interleaved schedule runs virtual stages "
                            f"across pipeline ranks): set parallel.vpp to null or raise parallel.pp")
        elif (shape.layers // pp) % vpp:
            problems.append(f"{shape.layers // pp} layers per PP stage (num_hidden_layers={shape.layers} / "
                            f"PP={pp}) are not divisible by VPP={vpp}: choose parallel.vpp among "
                            f"{divisors(shape.layers // pp)}")
    return problems


def expert_split_problems(shape: ModelShape, *, tp: int, ep: int, etp: int) -> list[str]:
    """Every reason the experts cannot be split ``ep`` x ``etp`` ways (and a shared expert ``tp`` ways)."""
    if not shape.is_moe:
        return [] if ep == etp == 1 else [
            f"parallel.ep={ep} / parallel.etp={etp} need a mixture-of-experts model; {shape.name} ({shape.family}) is "
            "dense: set parallel.ep=1 and parallel.etp=1"]
    problems = []
    if shape.experts % ep:
        problems.append(f"{shape.experts} experts per layer are not divisible by EP={ep}: choose parallel.ep among "
                        f"{divisors(shape.experts)}")
    if shape.expert_ffn % etp:
        problems.append(f"expert width {shape.expert_ffn} is not divisible by ETP={etp}: choose parallel.etp among "
                        f"{divisors(shape.expert_ffn)}")
    if shape.shared_ffn % tp:
        problems.append(f"shared expert width {shape.shared_ffn} is not divisible by TP={tp}: choose parallel.tp "
                        f"among {divisors(shape.shared_ffn)}")
    return problems


def batch_split_problem(sequences: int, *, dp: int, rows_per_micro_batch: int) -> str | None:
    """Why a global batch of ``sequences`` rows cannot be cut into DP ranks x equal micro-batches
    (Megatron's schedules need equally sized micro-batches), or None. ``rows_per_micro_batch`` is
    ``train.rows_per_micro_batch``: ``train.micro_batch_size`` for padded micro-batches
    (``train.micro_batch_tokens: 0``), 1 when packing (the default: a packed micro-batch takes any
    number of whole rows). The config, the dry-run and the train step all ask this one rule with it."""
    if not sequences % (dp * rows_per_micro_batch):
        return None
    what = f"global batch of {sequences} sequences (train.prompts_per_step x rollout.n) is not divisible by "
    if rows_per_micro_batch == 1:
        return what + f"parallel.dp = {dp}: change the prompts per step or the group size"
    return (what + f"parallel.dp x train.micro_batch_size = {dp} x {rows_per_micro_batch} = "
            f"{dp * rows_per_micro_batch} (padded micro-batches, train.micro_batch_tokens: 0): change the prompts "
            "per step, the group size or the micro-batch size, or pack (train.micro_batch_tokens: null)")


def pipeline_problem(microbatches: int, *, pp: int, vpp: int | None) -> str | None:
    """The interleaved schedule needs the micro-batches per DP rank to be a multiple of PP (Megatron's
    schedules reject it otherwise), or None."""
    if vpp is not None and pp > 1 and (microbatches < pp or microbatches % pp):
        return (f"the interleaved schedule (VPP={vpp}) needs the micro-batches per DP rank ({microbatches}) to be "
                f"a multiple of PP={pp}: change train.micro_batch_size or the rollout batch size")
    return None


CP_COMM_TYPES = ("p2p", "all_gather", "a2a")
"""Megatron's ``cp_comm_type`` values a CP layout may use (None = p2p, Megatron's default for TE).
``a2a+p2p`` also needs hierarchical CP groups (``hierarchical_context_parallel_sizes``), which
``parallel.dims.init_distributed`` does not create."""


CP_PACKED_COMM_TYPES = ("p2p", "a2a")
"""The ``cp_comm_type`` values whose Transformer Engine kernels take packed (THD) sequences: TE
2.11's all-gather CP attention asserts ``qkv_format != "thd"`` (``AttnFuncWithCPAndKVAllGather``)."""


def cp_packing_problem(comm_type, *, cp: int, packed: bool) -> str | None:
    """Why ``cp_comm_type`` cannot take the run's micro-batches (packed rows reach TE as THD), or None."""
    kinds = list(comm_type) if isinstance(comm_type, (list, tuple)) else [comm_type]
    bad = sorted({str(k) for k in kinds if k is not None and k in CP_COMM_TYPES and k not in CP_PACKED_COMM_TYPES})
    if cp == 1 or not packed or not bad:
        return None
    return (f"model.megatron.cp_comm_type={comm_type!r} cannot take packed micro-batches: Transformer Engine's "
            f"{', '.join(bad)} context-parallel attention refuses packed (THD) sequences; set "
            f"model.megatron.cp_comm_type to {' or '.join(CP_PACKED_COMM_TYPES)}, or train.micro_batch_tokens=0 "
            "(padded micro-batches)")


def context_parallel_problems(shape: ModelShape, *, tp: int, cp: int, comm_type=None,
                              cp_attention: bool = True) -> list[str]:
    """Every reason the model cannot run with ``cp`` context-parallel ranks.

    ``comm_type``: Megatron's ``cp_comm_type`` (``model.megatron``). ``a2a`` (Ulysses) scatters a TP
    rank's attention heads over the CP ranks, so ``cp`` must divide them; p2p and all_gather exchange
    K/V chunks and take any head count. ``cp_attention``: the layer spec has a context-parallel
    attention (Transformer Engine's on GPU, the exact stand-in of parallel/cp_attention.py for
    Megatron's local spec on CPU); False for Megatron's local spec on a GPU.
    """
    if cp == 1:
        return []
    problems = []
    if shape.is_moe:  # routing replay and the router metrics index tokens of whole (unsharded) sequences
        problems.append(f"parallel.cp={cp} with a mixture of experts ({shape.experts} experts) is not supported yet: "
                        "set parallel.cp=1 (use parallel.ep for the experts and parallel.tp for long sequences)")
    if not cp_attention:
        problems.append(f"parallel.cp={cp} needs a context-parallel attention: Megatron's local layer spec on GPU "
                        "has none (its DotProductAttention refuses CP); use Transformer Engine's layer spec, or "
                        "parallel.cp=1")
    kinds = list(comm_type) if isinstance(comm_type, (list, tuple)) else [comm_type]
    bad = sorted({str(k) for k in kinds if k is not None and k not in CP_COMM_TYPES})
    if bad:
        problems.append(f"model.megatron.cp_comm_type={comm_type!r}: {', '.join(bad)} is not supported; choose "
                        f"among {', '.join(CP_COMM_TYPES)} (a2a+p2p needs hierarchical CP groups, not set up here)")
    per_rank = shape.heads // tp if tp and shape.heads % tp == 0 else None
    if "a2a" in kinds and per_rank is not None and per_rank % cp:
        problems.append(f"model.megatron.cp_comm_type=a2a scatters the {per_rank} attention heads of a TP rank "
                        f"(num_attention_heads={shape.heads} / TP={tp}) over parallel.cp={cp} ranks: choose "
                        f"parallel.cp among {divisors(per_rank)}, or cp_comm_type p2p / all_gather")
    kv_per_rank = shape.kv_heads_per_rank(tp) if tp else None
    if "a2a" in kinds and per_rank is not None and kv_per_rank and kv_per_rank % cp:
        problems.append(f"model.megatron.cp_comm_type=a2a scatters the {kv_per_rank} KV heads of a TP rank "
                        f"(num_key_value_heads={shape.kv_heads}, TP={tp}) over parallel.cp={cp} ranks too: choose "
                        f"parallel.cp among {divisors(kv_per_rank)}, or cp_comm_type p2p / all_gather")
    return problems


def world_problem(world: int, *, tp: int, cp: int, pp: int) -> str | None:
    """Why ``world`` ranks cannot be split into TP x CP x PP model replicas, or None: the check of
    ``init_distributed``, which knows no configured DP size (DP is what the world leaves). The
    launched world against the configured layout, DP included, is ``ParallelConfig.world_size_problem``."""
    model = tp * cp * pp
    if world % model:
        return (f"{world} ranks are not divisible by TP x CP x PP = {tp} x {cp} x {pp} = {model}: change "
                f"parallel.tp/parallel.cp/parallel.pp or launch a multiple of {model} ranks")
    return None


def expert_world_problem(stage_ranks: int, *, ep: int, etp: int) -> str | None:
    """Why the ``stage_ranks`` ranks of a pipeline stage (TP x CP x DP) cannot hold ``ep`` x ``etp``
    expert-parallel groups, or None. Megatron takes the expert-parallel ranks from a stage's ranks
    (no extra ranks: EP does not multiply the world), so EP x ETP must divide them."""
    if stage_ranks % (ep * etp):
        return (f"parallel.ep x parallel.etp = {ep} x {etp} does not divide the {stage_ranks} ranks of a pipeline stage "
                "(TP x CP x DP; expert parallelism takes its ranks from them): choose EP x ETP among "
                f"{divisors(stage_ranks)}")
    return None
