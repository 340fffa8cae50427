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


def batch_split_problem(sequences: int, *, dp: int, micro_batch_size: int) -> str | None:
    """Why a global batch of ``sequences`` rows cannot be cut into DP ranks x equal micro-batches
    (Megatron's schedules need equally sized micro-batches), or None."""
    if sequences % (dp * micro_batch_size):
        return (f"global batch of {sequences} sequences (train.prompts_per_step x rollout.n) is not divisible by "
                f"parallel.dp x train.micro_batch_size = {dp} x {micro_batch_size} = {dp * micro_batch_size}: "
                "change the prompts per step, the group size or the micro-batch size")
    return None


def pipeline_problem(microbatches: int, *, pp: int, vpp: int | None) -> str | None:
    """The interleaved schedule needs the micro-batches per DP rank to be a multiple of PP (Megatron's
    schedules reject it otherwise), or None."""
    if vpp is not None and pp > 1 and (microbatches < pp or microbatches % pp):
        return (f"the interleaved schedule (VPP={vpp}) needs the micro-batches per DP rank ({microbatches}) to be "
                f"a multiple of PP={pp}: change train.micro_batch_size or the rollout batch size")
    return None
