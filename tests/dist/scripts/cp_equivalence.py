"""Multi-rank check: the context-parallel building blocks give the one-process numbers.

Usage: torchrun --nproc_per_node=N cp_equivalence.py LAYOUT [LAYOUT ...], LAYOUT = ``tp,cp``
(DP = N / (tp * cp)). First a CP=1 reference on every rank (the whole batch, plain autograd, no
DDP, the same code path at cp = 1; and the dense fp64 reference loss of ``_trainstep_common``). Then
per layout, from the same weights:

* ``attention``: the CPU stand-in (parallel/cp_attention.py) against Megatron's local
  DotProductAttention at CP=1, padded (load-balanced causal mask) and packed (per-sequence THD
  split, block-diagonal mask): outputs and the gradients of q, k, v (k/v: reduce-scattered back);
* ``logits``: GPTModel (local spec, stand-in attention; fp64, see DTYPE) on each padded
  micro-batch's shard against the CP=1 logits at the same global positions (vocabulary-sharded
  under TP);
* ``step``: for GTPO (entropy filter active), GRPO with KL and DAPO, padded and packed, Megatron's
  schedule + DDP over DP x CP with ``cp_loss.megatron_loss_scale``: loss, DDP-reduced gradients,
  per-token log-probs, GTPO's <H>_i and its filter decisions against the CP=1 run, plus where the
  conflict runs and completion ends fall (the test requires rows whose conflict tokens and end sit
  on different CP ranks).

Prints one ``RESULT {json}`` line per check; tests/dist/test_cp.py judges.
"""

from __future__ import annotations

import copy
import dataclasses

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.utils import get_model_config

from megatron_gtpo import algo
from megatron_gtpo.algo import AlgoConfig, TokenInputs
from megatron_gtpo.parallel.cp_attention import standin_class
from megatron_gtpo.parallel.cp_index import cp_attention_mask, gathered_index, load_balanced_index, \
    thd_partitioned_index
from megatron_gtpo.parallel.collectives import comm_device
from megatron_gtpo.parallel.dims import init_distributed
from megatron_gtpo.train import model as M
from megatron_gtpo.train import model_input
from megatron_gtpo.train.batching import global_normalisers, local_rows, micro_batch_count, micro_batches, \
    packed_micro_batches
from megatron_gtpo.train.cp_loss import completion_view, cp_groups, megatron_loss_scale, mean_entropy, shard_loss, \
    shard_token_stats
from megatron_gtpo.train.cp_shard import forward as cp_forward
from megatron_gtpo.train.cp_shard import shard_micro_batch
from megatron_gtpo.train.loss import LogprobSettings
from megatron_gtpo.train.optim import OptimConfig, build_optimizer, wrap_ddp, zero_grads
from tests.dist.scripts import _trainstep_common as C
from tests.dist.scripts.trainstep_equivalence import emit, rel_err, synthetic_ref_logp

TEMPERATURE, MBS, BUDGET = 0.8, 4, 64
DTYPE = torch.float64
"""The model's dtype in the logits and step checks: fp64 leaves no rounding to hide a CP error behind
(the CP code paths are dtype-agnostic); the attention check runs in fp32."""


def model_config() -> dict:
    """The train-step tests' tiny GQA model with 2 layers (every check here is per layer)."""
    return {**C.tiny_config(tied=False), "num_hidden_layers": 2}


def cases(threshold: float) -> list[dict]:
    """GTPO with an entropy threshold between the rows' <H>_i, GRPO with a KL term, DAPO (mu = 1)."""
    configs = {"gtpo": AlgoConfig(name="gtpo", entropy_threshold=threshold),
               "grpo_kl": AlgoConfig(name="grpo", kl_beta=0.04), "dapo": AlgoConfig(name="dapo")}
    return [dict(name=name, spec=cfg.resolve(max_completion_tokens=16)) for name, cfg in configs.items()]


def rank_mbs(batch, rows: slice, *, packed: bool, multiple: int, dp: int):
    """Padded micro-batches of MBS rows (lengths a multiple of ``multiple``) or packed ones."""
    device = comm_device()
    if not packed:
        return micro_batches(batch, rows, micro_batch_size=MBS, common_length=False, pad_to_multiple=multiple,
                             device=device)
    count = micro_batch_count(batch, dp=dp, token_budget=BUDGET)
    return packed_micro_batches(batch, rows, token_budget=BUDGET, count=count, common_length=False, device=device)


class Loss:
    """The loss of one micro-batch shard, as phase B's StepPlan will call the pieces; records the
    completion-view log-probs, <H>_i and loss shares it saw."""

    def __init__(self, batch, case, lp, *, cp_group, scale: float, ref_logp):
        self.batch, self.spec, self.lp, self.cp_group, self.scale = batch, case["spec"], lp, cp_group, scale
        self.prepared = algo.prepare_groups(self.spec, token_ids=batch.token_ids, mask=batch.mask,
                                            rewards=batch.rewards, group_ids=batch.group_ids)
        self.ref_logp = ref_logp if self.spec.kl_beta > 0 else None
        self.num_tokens, self.num_seqs = global_normalisers(batch)
        self.logp = torch.zeros(batch.mask.shape, dtype=torch.float64)
        self.mean_h = torch.zeros(batch.size, dtype=torch.float64)
        self.delta = torch.full((batch.size,), -1.0)
        self.total = torch.zeros((), dtype=torch.float64, device=comm_device())
        self.magnitude = torch.zeros((), dtype=torch.float64, device=comm_device())

    def __call__(self, shard, logits):
        rows, width = shard.mb.rows, shard.mb.width
        prepared, mask = self.prepared.rows(rows, width=width), self.batch.mask[rows, :width]
        floor = self.spec.entropy_prob_floor if prepared.needs_entropy else 0.0
        logp, ent = shard_token_stats(self.lp, logits, shard, entropy_prob_floor=floor, inplace_backward=True)
        held = shard.held
        if prepared.needs_entropy:
            h = mean_entropy(ent, held, mask, self.cp_group)
            prepared = algo.shape_rows(self.spec, prepared, h)
            self.mean_h[rows], self.delta[rows] = h.double().cpu(), prepared.delta.float().cpu()
        ref = None if self.ref_logp is None else self.ref_logp[rows, :width]
        tokens = TokenInputs(logp=logp, mask=mask, ref_logp=ref)
        loss, _ = shard_loss(self.spec, tokens, prepared, held, num_tokens=self.num_tokens, num_seqs=self.num_seqs)
        with torch.no_grad():  # the loss's magnitude (|A|: no cancellation), the scale its rounding is judged on
            size = dataclasses.replace(prepared, advantages=prepared.advantages.abs())
            self.magnitude -= shard_loss(self.spec, tokens, size, held, num_tokens=self.num_tokens,
                                         num_seqs=self.num_seqs)[0].double()
        self.logp[rows.cpu(), :width] = completion_view(logp, held, self.cp_group).double().cpu()
        self.total += loss.detach().double()
        return loss * self.scale, {}


# ----------------------------------------------------------------------------- reference (CP = 1)


def reference(batch) -> dict:
    dims = init_distributed(tp=1, pp=1, seed=7)
    torch.manual_seed(0)
    model = M.build_model(model_config(), dims=dims, dtype=DTYPE)[0]
    with torch.no_grad():  # sharper distributions: <H>_i spread around the entropy threshold
        model.output_layer.weight.mul_(40.0)
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        _, dense_logp, dense_h, _ = C.reference_loss(model, batch, spec=cases(0.7)[0]["spec"], temperature=TEMPERATURE)
    threshold = float(dense_h.sort().values[batch.size // 2 - 1: batch.size // 2 + 1].mean())
    ref = {"full": full, "threshold": threshold, "ref_logp": synthetic_ref_logp(batch, dense_logp), "logits": {}}
    lp = LogprobSettings(tp_group=None, tp_rank=0, vocab_size=C.VOCAB, temperature=TEMPERATURE, chunk_tokens=5)
    for mb in rank_mbs(batch, slice(0, batch.size), packed=False, multiple=4, dp=1):
        with torch.no_grad():
            ref["logits"][tuple(mb.rows.tolist())] = model_input.forward(model, mb)
    for case in cases(threshold):
        dense, dense_logp, dense_h, _ = C.reference_loss(model, batch, spec=case["spec"], temperature=TEMPERATURE,
                                                         ref_logp=ref["ref_logp"])
        for packed in (False, True):
            model.zero_grad()
            loss = Loss(batch, case, lp, cp_group=None, scale=1.0, ref_logp=ref["ref_logp"])
            for mb in rank_mbs(batch, slice(0, batch.size), packed=packed, multiple=4, dp=1):
                shard = shard_micro_batch(mb, cp=1, rank=0, pad_id=C.PAD)
                loss(shard, model_input.forward(model, shard.mb))[0].backward()
            ref[case["name"], packed] = {"loss": float(loss.total), "dense": float(dense), "logp": loss.logp,
                                         "mean_h": loss.mean_h, "delta": loss.delta,
                                         "dense_logp": dense_logp, "dense_h": dense_h,
                                         "grads": {n: p.grad.detach().clone() for n, p in model.named_parameters()}}
    ps.destroy_model_parallel()
    return ref


# ----------------------------------------------------------------------------- checks under CP


def check_attention(chunk, dims) -> None:
    """Stand-in vs Megatron's local attention at CP=1 (padded and packed)."""
    cfg = get_model_config(chunk)
    cfg1 = copy.copy(cfg)
    cfg1.context_parallel_size = 1
    ref_attn = DotProductAttention(cfg1, 1, AttnMaskType.causal, "self")
    cp_attn = standin_class()(cfg, 1, AttnMaskType.causal, "self")
    heads, groups, hn = cfg.num_attention_heads // dims.tp, cfg.num_query_groups // dims.tp, cfg.kv_channels
    for name, seq, batch_size, cu in (("padded", 16, 2, None), ("packed", 24, 1, torch.tensor([0, 8, 12, 24]))):
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
        emit(check="attention", case=name, cp=dims.cp, tp=dims.tp, out_err=rel_err(out_cp, out_ref[index]),
             grad_err=max(rel_err(a.grad, b.grad[index]) for a, b in zip(local, full)),
             keys_seen=int((~mask_cp).sum()) if mask_cp is not None else None)


def check_logits(chunks, batch, ref, dims, rows) -> None:
    """Each padded micro-batch's shard logits against the CP=1 logits at its global positions."""
    worst, vocab = 0.0, None
    for mb in rank_mbs(batch, rows, packed=False, multiple=4, dp=dims.dp):
        shard = shard_micro_batch(mb, cp=dims.cp, rank=dims.cp_rank, pad_id=C.PAD)
        with torch.no_grad():
            logits = cp_forward(chunks[0], shard)
        vocab = logits.shape[-1]
        want = ref["logits"][tuple(mb.rows.tolist())][:, shard.index, dims.tp_rank * vocab:(dims.tp_rank + 1) * vocab]
        worst = max(worst, rel_err(logits, want))
    emit(check="logits", layout=layout_name(dims), logits_err=worst, local_vocab=vocab)


def layout_name(dims) -> str:
    return f"tp{dims.tp}_cp{dims.cp}_dp{dims.dp}"


def run_step(ddp, optimizer, batch, case, dims, *, packed: bool, ref: dict) -> dict:
    """One forward/backward of this rank's rows through Megatron's schedule, DDP over DP x CP."""
    rows = local_rows(batch.size, dp=dims.dp, dp_rank=dims.dp_rank, micro_batch_size=1 if packed else MBS)
    mbs = rank_mbs(batch, rows, packed=packed, multiple=M.sequence_multiple(get_model_config(ddp[0])), dp=dims.dp)
    shards = [shard_micro_batch(mb, cp=dims.cp, rank=dims.cp_rank, pad_id=C.PAD) for mb in mbs]
    cp_group, dp_cp_group = cp_groups()
    lp = LogprobSettings(tp_group=ps.get_tensor_model_parallel_group(), tp_rank=dims.tp_rank, vocab_size=C.VOCAB,
                         temperature=TEMPERATURE, chunk_tokens=5)
    scale = megatron_loss_scale(num_microbatches=len(mbs), dp_size=dims.dp, cp_size=dims.cp)
    loss = Loss(batch, case, lp, cp_group=cp_group, scale=scale, ref_logp=ref["ref_logp"])
    C.load_full(ddp, ref["full"], tied=False, tp=dims.tp, tp_rank=dims.tp_rank)
    zero_grads(ddp, optimizer)

    def forward_step(data_iterator, model):
        shard = next(data_iterator)
        return cp_forward(model, shard), lambda logits: loss(shard, logits)

    get_forward_backward_func()(forward_step_func=forward_step, data_iterator=[iter(shards)], model=ddp,
                                num_microbatches=len(shards), seq_length=shards[0].seq_len,
                                micro_batch_size=shards[0].input_ids.shape[0], forward_only=False)
    total = torch.stack([loss.total, loss.magnitude])
    dist.all_reduce(total, group=dp_cp_group)
    owned = torch.zeros(batch.size, dtype=torch.bool)
    owned[rows] = True
    return {"loss": float(total[0]), "magnitude": float(total[1]), "logp": loss.logp, "mean_h": loss.mean_h,
            "delta": loss.delta, "owned": owned,
            "grads": {g: p.main_grad.detach().clone() for g, _, p in C.named_local_params(ddp, tied=False)},
            "split": split_report(mbs, loss.prepared, batch.mask, dims.cp)}


def split_report(mbs, prepared, mask, cp: int) -> dict:
    """Where GTPO's conflict tokens and the completions' last tokens fall over the CP ranks (from
    every rank's held map, pure functions of the micro-batch): rows whose conflict tokens span two
    ranks, rows with a conflict token on another rank than the completion's end, and whether the
    held maps partition every completion exactly."""
    spans = other_end = rows_with_conflicts = 0
    exact = True
    for mb in mbs:
        held = torch.stack([shard_micro_batch(mb, cp=cp, rank=r, pad_id=C.PAD).held.cpu() for r in range(cp)])
        m = mask[mb.rows.cpu(), :mb.width]
        exact &= bool((held.sum(0) == m.long()).all())
        owner = held.long().argmax(0)  # [mb, width]: the rank holding each token
        if prepared.token_weights is None:
            continue
        conflict = (prepared.token_weights[mb.rows.cpu(), :mb.width] != 1) & m
        for b in range(len(mb.rows)):
            if not bool(conflict[b].any()):
                continue
            rows_with_conflicts += 1
            owners = set(owner[b][conflict[b]].tolist())
            end = int(owner[b, int(m[b].sum()) - 1])
            spans += len(owners) > 1
            other_end += bool(owners - {end})
    return {"exact_partition": exact, "rows_with_conflicts": rows_with_conflicts, "conflicts_span_ranks": spans,
            "conflict_off_end_rank": other_end}


def compare(got: dict, want: dict, chunks, dims) -> dict:
    """Errors of a CP step against the one-process CP=1 run (rows this DP rank owns; gradients:
    this rank's TP slices of the TP1 ones)."""
    rows = got["owned"]
    diff = norm = 0.0
    for gname, name, param in C.named_local_params(chunks, tied=False):
        ref_grad = C.local_piece(want["grads"][gname], name, param, tp=dims.tp, tp_rank=dims.tp_rank)
        diff += float(((got["grads"][gname].double().cpu() - ref_grad.double().cpu()) ** 2).sum())
        norm += float((ref_grad.double() ** 2).sum())
    delta = got["delta"][rows]
    return {"loss": got["loss"], "loss_ref": want["loss"], "magnitude": got["magnitude"],
            "grad_err": (diff / max(norm, 1e-30)) ** 0.5,
            "logp_err": rel_err(got["logp"][rows], want["logp"][rows]),
            "mean_h_err": rel_err(got["mean_h"][rows], want["mean_h"][rows]) if bool((delta >= 0).any()) else 0.0,
            "delta_equal": bool((delta == want["delta"][rows]).all()), "filtered": int((delta == 0).sum()),
            "kept": int((delta == 1).sum())}


def layout_phase(batch, ref: dict, tp: int, cp: int) -> None:
    """Every check of one TP x CP (x DP) layout against the CP=1 run of the whole batch."""
    dims = init_distributed(tp=tp, cp=cp, seed=7)
    chunks = M.build_model(model_config(), dims=dims, dtype=DTYPE)
    check_attention(chunks[0], dims)
    ddp = wrap_ddp(chunks, OptimConfig(ddp={"grad_reduce_in_fp32": False}))  # fp64 gradients
    sgd = {"optimizer": "sgd", "lr": 0.0, "sgd_momentum": 0.0, "weight_decay": 0.0, "clip_grad": 0.0}
    optimizer, _ = build_optimizer(ddp, OptimConfig(optimizer=sgd), total_steps=1)
    # Megatron's DDP scales gradients by 1 / |DP x CP| (megatron_loss_scale relies on it)
    emit(check="ddp", layout=layout_name(dims), scaling=[b.gradient_scaling_factor for b in ddp[0].buffers],
         dp_cp=dims.dp * dims.cp, dp_cp_group=ps.get_data_parallel_world_size(with_context_parallel=True))
    C.load_full(ddp, ref["full"], tied=False, tp=tp, tp_rank=dims.tp_rank)
    check_logits(ddp, batch, ref, dims, local_rows(batch.size, dp=dims.dp, dp_rank=dims.dp_rank, micro_batch_size=MBS))
    # GRPO's KL term is per token and TP-independent: checked in the TP=1 layout only (time budget)
    for case in [c for c in cases(ref["threshold"]) if tp == 1 or c["name"] != "grpo_kl"]:
        for packed in (False, True):
            got = run_step(ddp, optimizer, batch, case, dims, packed=packed, ref=ref)
            emit(check="step", layout=layout_name(dims), case=case["name"], packed=packed, split=got["split"],
                 **compare(got, ref[case["name"], packed], ddp, dims))
    ps.destroy_model_parallel()


def main() -> None:
    layouts, batch = C.start_layouts()
    ref = reference(batch)
    for case in cases(ref["threshold"]):
        for packed in (False, True):
            r = ref[case["name"], packed]
            emit(check="reference", case=case["name"], packed=packed, loss=r["loss"], dense=r["dense"],
                 logp_err=rel_err(r["logp"], r["dense_logp"]), mean_h_err=rel_err(r["mean_h"], r["dense_h"])
                 if case["spec"].needs_mean_entropy else 0.0)
    for item in layouts:
        tp, cp = (int(x) for x in item.split(","))
        layout_phase(batch, ref, tp, cp)


if __name__ == "__main__":
    main()
