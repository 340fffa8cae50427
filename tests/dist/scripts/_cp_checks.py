"""Building-block checks of tests/dist/scripts/cp_equivalence.py (one CP layout each): the CPU
stand-in attention against Megatron's local attention, GPTModel's shard logits against the CP=1
logits, DDP's gradient scaling over DP x CP, where GTPO's conflict runs and completion ends fall on
the CP ranks, and that exactly one copy of the weights sends a push (one CP rank, DP replica 0)."""

from __future__ import annotations

import copy

import torch
from megatron.core import parallel_state as ps
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.utils import get_model_config

from megatron_gtpo.parallel import control
from megatron_gtpo.parallel.collectives import comm_device
from megatron_gtpo.models.shape import shape_from_hf_config
from megatron_gtpo.parallel.cp_attention import standin_class
from megatron_gtpo.parallel.layout import CP_COMM_TYPES, context_parallel_problems, cp_packing_problem
from megatron_gtpo.parallel.cp_index import cp_attention_mask, gathered_index, load_balanced_index, \
    thd_partitioned_index
from megatron_gtpo.train import model as M
from megatron_gtpo.train import model_input
from megatron_gtpo.train.cp_shard import forward as cp_forward
from megatron_gtpo.train.cp_shard import shard_micro_batch
from tests.dist.scripts import _trainstep_common as C
from tests.dist.scripts.trainstep_equivalence import emit, rel_err


def layout_name(dims) -> str:
    return f"tp{dims.tp}_cp{dims.cp}_pp{dims.pp}_dp{dims.dp}"


def accepted_attention_cases(tp: int, cp: int) -> list[tuple[str | None, bool]]:
    """Every (cp_comm_type, packed) the run's validation accepts for this model and layout
    (``context_parallel_problems`` and ``cp_packing_problem``, the rules ``megatron-gtpo train`` and
    the dry-run apply); None = Megatron's default, p2p."""
    shape = shape_from_hf_config(model_config(), name="model")
    return [(kind, packed) for kind in (None, *CP_COMM_TYPES) for packed in (False, True)
            if not context_parallel_problems(shape, tp=tp, cp=cp, comm_type=kind)
            and cp_packing_problem(kind, cp=cp, packed=packed) is None]


def check_attention(chunk, dims) -> None:
    """Stand-in vs Megatron's local attention at CP=1, fp32, for every cp_comm_type x packing the
    validation accepts (the stand-in refuses what Transformer Engine refuses: all_gather x packed)."""
    for kind, packed in accepted_attention_cases(dims.tp, dims.cp):
        _check_attention(chunk, dims, kind, packed)


def _check_attention(chunk, dims, kind, packed: bool) -> None:
    cfg = get_model_config(chunk)
    cfg1 = copy.copy(cfg)
    cfg1.context_parallel_size = 1
    ref_attn = DotProductAttention(cfg1, 1, AttnMaskType.causal, "self")
    cp_attn = standin_class()(cfg, 1, AttnMaskType.causal, "self", cp_comm_type=kind)
    heads, groups, hn = cfg.num_attention_heads // dims.tp, cfg.num_query_groups // dims.tp, cfg.kv_channels
    case = ("packed", 24, 1, torch.tensor([0, 8, 12, 24])) if packed else ("padded", 16, 2, None)
    for name, seq, batch_size, cu in (case,):
        g = torch.Generator().manual_seed(3 + dims.tp_rank)
        q, k, v = (torch.randn(seq, batch_size, n, hn, generator=g) for n in (heads, groups, groups))
        grad_out = torch.randn(seq, batch_size, heads * hn, generator=g)
        if cu is None:
            index, mask_ref, mask_cp = load_balanced_index(seq, dims.cp, dims.cp_rank), M.causal_mask(seq), None
        else:
            index = thd_partitioned_index(cu, dims.cp, dims.cp_rank)
            keys = gathered_index([thd_partitioned_index(cu, dims.cp, r) for r in range(dims.cp)])
            mask_ref, mask_cp = model_input.block_causal_mask(cu, seq), cp_attention_mask(index, keys, cu)
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        local = [t[index].clone().requires_grad_() for t in (q, k, v)]
        out_ref = ref_attn(*full, mask_ref)
        out_ref.backward(grad_out)
        out_cp = cp_attn(*local, mask_cp)
        out_cp.backward(grad_out[index])
        emit(check="attention", case=name, comm_type=kind, cp=dims.cp, tp=dims.tp,
             out_err=rel_err(out_cp, out_ref[index]),
             grad_err=max(rel_err(a.grad, b.grad[index]) for a, b in zip(local, full)))


def check_logits(chunks, mbs, ref_logits: dict, dims) -> None:
    """Each padded micro-batch's shard logits against the CP=1 logits at its global positions
    (``mbs``: CPU micro-batches of this rank's rows; ``ref_logits``: rows -> CP=1 logits)."""
    worst = 0.0
    for mb in mbs:
        shard = shard_micro_batch(mb, cp=dims.cp, rank=dims.cp_rank, pad_id=C.PAD)
        with torch.no_grad():
            logits = cp_forward(chunks[0], shard)
        vocab = logits.shape[-1]
        want = ref_logits[tuple(mb.rows.tolist())][:, shard.seq_index, dims.tp_rank * vocab:(dims.tp_rank + 1) * vocab]
        worst = max(worst, rel_err(logits, want))
    emit(check="logits", layout=layout_name(dims), logits_err=worst)


def check_ddp_scaling(ddp, dims) -> None:
    """Megatron's DDP scales gradients by 1 / |DP x CP| (megatron_loss_scale relies on it)."""
    emit(check="ddp", layout=layout_name(dims), scaling=[b.gradient_scaling_factor for b in ddp[0].buffers],
         dp_cp=dims.dp * dims.cp, dp_cp_group=ps.get_data_parallel_world_size(with_context_parallel=True))


def check_one_sender(ddp, dims) -> None:
    """The separate pool's push and the HF export: exactly one rank sends each bucket (TP rank 0 of
    DP replica 0 and CP rank 0 of the owner stage) and only global rank 0 writes an export."""
    from megatron_gtpo.sync.export import Exporter
    from tests.sync_helpers import export_hf_weights

    exporter = Exporter(ddp, hf_config=model_config(), dims=dims)
    buckets = exporter.buckets(1 << 16)
    sends = []
    for bucket in buckets:
        buffer = torch.empty(bucket.nbytes, dtype=torch.uint8, device=comm_device()) if dims.tp_rank == 0 else None
        sends.append(bool(exporter.pack(bucket, buffer)))
    exported = sum(len(b) for b in export_hf_weights(ddp, hf_config=model_config(), dims=dims, dst_ranks="first"))
    senders = control.all_gather_data((dims.rank, sends, exported))
    if dims.rank == 0:
        per_bucket = [sum(s[i] for _, s, _ in senders) for i in range(len(buckets))]
        emit(check="senders", layout=layout_name(dims), per_bucket=per_bucket,
             exporters=[rank for rank, _, n in senders if n], exported=exported)


def model_config() -> dict:
    """The train-step tests' tiny GQA model with 2 layers (PP=2: one per stage)."""
    return {**C.tiny_config(tied=False), "num_hidden_layers": 2}


def split_report(shards_of, prepared, mask, cp: int) -> dict:
    """Where GTPO's conflict tokens and the completions' last tokens fall over the CP ranks (from
    every rank's held map, pure functions of the micro-batch; ``shards_of(r)``: CP rank r's shards):
    rows whose conflict tokens span two ranks, rows with a conflict token on another rank than the
    completion's end, and whether the held maps partition every completion exactly."""
    spans = other_end = rows_with_conflicts = 0
    exact = True
    per_rank = [shards_of(r) for r in range(cp)]
    for shards in zip(*per_rank):
        held = torch.stack([s.held.cpu() for s in shards])
        rows = shards[0].rows.cpu()
        m = mask[rows, :shards[0].width]
        exact &= bool((held.long().sum(0) == m.long()).all())
        owner = held.long().argmax(0)  # [mb, width]: the rank holding each token
        conflict = (prepared.token_weights[rows, :shards[0].width] != 1) & m
        for b in range(len(rows)):
            if not bool(conflict[b].any()):
                continue
            rows_with_conflicts += 1
            owners = set(owner[b][conflict[b]].tolist())
            spans += len(owners) > 1
            other_end += bool(owners - {int(owner[b, int(m[b].sum()) - 1])})
    return {"exact_partition": exact, "rows_with_conflicts": rows_with_conflicts, "conflicts_span_ranks": spans,
            "conflict_off_end_rank": other_end}
