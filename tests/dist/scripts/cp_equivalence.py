"""Multi-rank check: context parallelism through the REAL train step equals one process.

Usage: torchrun --nproc_per_node=4 cp_equivalence.py LAYOUT [LAYOUT ...], LAYOUT = ``tp,cp,pp``
(DP = 4 / (tp * cp * pp)). First, on every rank, the single-process reference: the dense fp64
reference of ``_trainstep_common`` (whole batch, plain autograd, dense log-softmax, manual SGD) for
every case. Then per layout, from the same weights:

* building blocks (``_cp_checks``): the CPU stand-in attention against Megatron's local attention
  (fp32), GPTModel's logits on each shard against the CP=1 logits, DDP's scaling over DP x CP,
  one sender per push bucket and one HF-export writer;
* ``forward_stats`` (the learner's no-grad forward, padded and packed): per-token log-probs and
  exact entropies against the dense reference;
* ``step``: ``train_step`` (the learner's step: plan, updates, observer) for GTPO (mu = 1, its
  entropy filter deciding), GTPO at mu = 2 with ``entropy_logits: raw`` and mismatch weights, GRPO
  with a KL term and DAPO, padded and packed: the loss, every gradient (mu = 1), the parameter
  update (every case), GTPO's <H>_i and filter decisions (the step's own pi_old record), against
  the dense reference and against the CP=1 layout's step (the first layout, whose results every
  rank keeps); every logged metric (the test compares them with the CP=1 step's), and where
  GTPO's conflict runs and the completions' ends fall on the CP ranks.

fp64 models (the CP code paths are dtype-agnostic), so that fp32 rounding cannot hide a CP error.
The step keeps two things in fp32 by design, GTPO's <H>_i and the no-grad forward's outputs, and
Megatron's local-spec norms keep fp32 weights: against the dense reference the errors are therefore
fp32-sized (<= 1e-6), against the CP=1 step (the same fp32 parts) fp64-sized (<H>_i bit-identical).
Prints one ``RESULT {json}`` line per check; tests/dist/test_cp.py judges.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from types import SimpleNamespace

import torch
from megatron.core import parallel_state as ps
from megatron.core.utils import get_model_config

from megatron_gtpo import algo
from megatron_gtpo.algo import AlgoConfig
from megatron_gtpo.parallel import control
from megatron_gtpo.parallel.dims import init_distributed
from megatron_gtpo.train import model as M
from megatron_gtpo.train import model_input
from megatron_gtpo.train import step as S
from megatron_gtpo.train.batching import micro_batches
from megatron_gtpo.train.optim import OptimConfig, build_optimizer, wrap_ddp
from tests.dist.scripts import _cp_checks as K
from tests.dist.scripts import _trainstep_common as C
from tests.dist.scripts.trainstep_equivalence import emit, rel_err, synthetic_ref_logp

TEMPERATURE, MBS, BUDGET = 0.8, 4, 64
DTYPE = torch.float64
SGD = {"optimizer": "sgd", "lr": 0.5, "sgd_momentum": 0.0, "weight_decay": 0.0, "clip_grad": 0.0}


def cases(threshold: dict[float, float]) -> list[dict]:
    """GTPO (threshold between the rows' <H>_i), GTPO mu = 2 on raw-logit entropies with truncated
    importance weights, GRPO + KL, DAPO, GSPO mu = 2."""
    return [
        dict(name="gtpo", cfg=AlgoConfig(name="gtpo", entropy_threshold=threshold[TEMPERATURE]), opt=SGD),
        dict(name="gtpo_raw_mu2", opt={**SGD, "lr": 0.005},  # pi_old's record at update 2, mismatch weights held
             cfg=AlgoConfig(name="gtpo", entropy_threshold=threshold[1.0], entropy_logits="raw", mu=2,
                            mismatch_correction="tis")),
        dict(name="grpo_kl", cfg=AlgoConfig(name="grpo", kl_beta=0.04), opt=SGD),
        dict(name="dapo", cfg=AlgoConfig(name="dapo"), opt=SGD),
        # GSPO's log s_i: each CP rank holds part of a completion; the step sums the shares over the
        # CP group before the ratio (train/loss.py), so update 2's sequence ratios are the whole rows'
        dict(name="gspo_mu2", cfg=AlgoConfig(name="gspo", mu=2, clip_eps_low=0.002, clip_eps_high=0.002),
             opt={**SGD, "lr": 0.005}),
    ]


def spec_of(case):
    return case["cfg"].resolve(max_completion_tokens=16)


# ----------------------------------------------------------------------------- reference (one process)


def reference(batch) -> dict:
    """The dense fp64 single-process reference of every case (and the CP=1 logits of each padded
    micro-batch of MBS rows, for the logits check)."""
    dims = init_distributed(tp=1, pp=1, seed=7)
    torch.manual_seed(0)
    model = M.build_model(K.model_config(), dims=dims, dtype=DTYPE)[0]
    with torch.no_grad():  # sharper distributions: <H>_i spread around the entropy threshold
        model.output_layer.weight.mul_(40.0)
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        ids, pos = C.sequence_view(batch)
        logits = model(ids, pos, M.causal_mask(ids.shape[1]))
    mean_h, threshold = {}, {}
    for temperature in (TEMPERATURE, 1.0):
        _, _, clamped, _, mask = C.dense_token_stats(logits, batch, temperature)
        mean_h[temperature] = clamped.sum(1) / mask.sum(1)
        values = mean_h[temperature].sort().values
        threshold[temperature] = float(values[batch.size // 2 - 1: batch.size // 2 + 1].mean())
    logp, entropy, _, _, _ = C.dense_token_stats(logits, batch, TEMPERATURE)
    ref = {"full": full, "threshold": threshold, "logp": logp, "entropy": entropy, "mask": batch.mask,
           "ref_logp": synthetic_ref_logp(batch, logp).double(), "logits": {}, "cases": {}, "cp1": {}}
    for mb in micro_batches(batch, slice(0, batch.size), micro_batch_size=MBS, common_length=False,
                            pad_to_multiple=4):
        with torch.no_grad():
            ref["logits"][tuple(mb.rows.tolist())] = model_input.forward(model, mb)
    for case in cases(threshold):
        h = mean_h[spec_of(case).entropy_temperature(TEMPERATURE)]
        ref["cases"][case["name"]] = reference_updates(model, full, batch, case, mean_h=h, ref_logp=ref["ref_logp"])
    ps.destroy_model_parallel()
    return ref


def reference_updates(model, full, batch, case, *, mean_h, ref_logp) -> dict:
    """mu plain-autograd updates of the whole batch with manual SGD (pi_old = the first update's)."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(full[n])
    spec = spec_of(case)
    losses, grads, old_logp = [], None, None
    for update in range(spec.mu):
        model.zero_grad(set_to_none=True)
        loss, logp = dense_loss(model, batch, spec, mean_h=mean_h, old_logp=old_logp,
                                ref_logp=ref_logp if spec.kl_beta > 0 else None)
        old_logp = logp if spec.mu > 1 and update == 0 else old_logp
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.sub_(case["opt"]["lr"] * grads[n])
        losses.append(float(loss))
    out = {"losses": losses, "grads": grads, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}
    if spec.needs_mean_entropy:
        out.update(mean_h=mean_h, delta=(mean_h <= spec.entropy_threshold).double())
    return out


def dense_loss(model, batch, spec, *, mean_h, old_logp, ref_logp):
    """The whole batch's loss with plain autograd (dense fp64 log-softmax), the algorithm's pure
    functions on the completion view: groups, GTPO's shaping with ``mean_h``, the mismatch weights
    from pi_old (the first update's log-probs), the loss; and the log-probs (detached)."""
    ids, pos = C.sequence_view(batch)
    logits = model(ids, pos, M.causal_mask(ids.shape[1]))
    logp, _, _, tokens, mask = C.dense_token_stats(logits, batch, TEMPERATURE)
    prepared = algo.prepare_batch(spec, token_ids=tokens, mask=mask, rewards=batch.rewards, group_ids=batch.group_ids,
                                  mean_entropy=mean_h if spec.needs_mean_entropy else None)
    pi_old = logp.detach() if old_logp is None else old_logp
    weights, _ = algo.mismatch_weights(spec, pi_old, batch.sampler_logprobs.double(), mask)
    loss, _ = algo.compute_loss(spec, algo.TokenInputs(logp=logp, mask=mask, old_logp=old_logp, ref_logp=ref_logp,
                                                       is_weights=weights), prepared)
    return loss, logp.detach()


# ----------------------------------------------------------------------------- the real train step


def settings_of(spec, ddp, *, packed: bool) -> S.StepSettings:
    """The learner's step settings (its padding multiple from the model's config: 2 x cp)."""
    return S.StepSettings(spec=spec, micro_batch_size=MBS, temperature=TEMPERATURE, chunk_tokens=5,
                          micro_batch_tokens=BUDGET if packed else 0,
                          pad_to_multiple=M.sequence_multiple(get_model_config(ddp[0])))


def capture_pi_old() -> dict:
    """Wraps ``step.finish`` (train_step's last call) to keep the step's completed pi_old record."""
    original, seen = S.finish, {}

    def finish(plan, pi_old, updates, observer):
        seen["pi_old"], seen["plan"] = pi_old, plan
        return original(plan, pi_old, updates, observer)

    S.finish = finish
    return seen


def run_step(ddp, batch, case, dims, ref: dict, *, packed: bool, seen: dict) -> tuple[dict, dict, dict]:
    """One train_step from the reference weights: its errors against the dense reference and (CP
    layouts) against the CP=1 layout's step, its metrics, and what it left (the CP=1 reference)."""
    spec = spec_of(case)
    C.load_full(ddp, ref["full"], tied=False, tp=dims.tp, tp_rank=dims.tp_rank)
    optimizer, scheduler = build_optimizer(ddp, OptimConfig(optimizer=case["opt"]), total_steps=4)
    settings = settings_of(spec, ddp, packed=packed)
    rows, _ = S.rank_micro_batches(batch, settings, dims)
    metrics = S.train_step(SimpleNamespace(chunks=ddp, optimizer=optimizer, scheduler=scheduler), batch, settings,
                           dims, ref_logp=ref["ref_logp"][rows] if spec.kl_beta > 0 else None)
    got = {"loss": metrics["loss"], "params": {g: p.detach().clone() for g, _, p in C.named_local_params(ddp, tied=False)},
           "grads": {g: p.main_grad.detach().clone() for g, _, p in C.named_local_params(ddp, tied=False)}}
    if spec.needs_mean_entropy and dims.is_last_stage:
        host = seen["pi_old"].host_prepared
        got.update(mean_h=host.mean_entropy.double(), delta=host.delta.double())
    dense = ref["cases"][case["name"]]
    out = {"nonfinite": sorted(k for k, v in metrics.items() if not math.isfinite(v)),
           "metrics_digest": hashlib.sha256(repr(sorted(metrics.items())).encode()).hexdigest()[:16],
           **errors(got, {**dense, "loss": sum(dense["losses"]) / len(dense["losses"])}, ddp, ref["full"], dims, spec)}
    if dims.cp > 1:
        cp1 = errors(got, ref["cp1"][case["name"], packed], ddp, ref["full"], dims, spec)
        out.update({f"{name}_cp1": value for name, value in cp1.items()})
    if "delta" in got:
        out.update(filtered=int((got["delta"] == 0).sum()), kept=int((got["delta"] == 1).sum()))
        if case["name"] == "gtpo" and dims.cp > 1:
            out["split"] = K.split_report(lambda r: S.rank_micro_batches(
                batch, settings, dataclasses.replace(dims, cp_rank=r))[1], seen["plan"].host_prepared, batch.mask,
                dims.cp)
    return out, metrics, got


def errors(got: dict, want: dict, ddp, full: dict, dims, spec) -> dict:
    """The step's errors against ``want`` (the dense reference, or the CP=1 step): loss, gradients
    (mu = 1), the parameter change over the step (norm-wise, this rank's TP slices of the TP1
    tensors), GTPO's <H>_i and filter decisions."""
    out = {"loss_err": abs(got["loss"] - want["loss"]) / max(abs(want["loss"]), 1.0)}
    g_diff = g_norm = u_diff = u_norm = 0.0
    for gname, name, param in C.named_local_params(ddp, tied=False):
        piece = dict(tp=dims.tp, tp_rank=dims.tp_rank)
        start = C.local_piece(full[gname], name, param, **piece).double()
        change, change_ref = start - got["params"][gname].double(), start - C.local_piece(
            want["params"][gname], name, param, **piece).double()
        u_diff, u_norm = u_diff + float(((change - change_ref) ** 2).sum()), u_norm + float((change_ref ** 2).sum())
        grad_ref = C.local_piece(want["grads"][gname], name, param, **piece).double()
        g_diff += float(((got["grads"][gname].double() - grad_ref) ** 2).sum())
        g_norm += float((grad_ref ** 2).sum())
    out["update_err"] = (u_diff / max(u_norm, 1e-300)) ** 0.5
    if spec.mu == 1:
        out["grad_err"] = (g_diff / max(g_norm, 1e-300)) ** 0.5
    if "mean_h" in got:
        out.update(mean_h_err=rel_err(got["mean_h"], want["mean_h"]),
                   delta_equal=bool(torch.equal(got["delta"], want["delta"].double())))
    return out


def check_forward_stats(ddp, batch, ref: dict, dims) -> None:
    """The learner's no-grad forward (reference-model log-probs) on this rank's shares: whole
    completions' log-probs and exact entropies on every CP rank, padded and packed."""
    spec = AlgoConfig().resolve(max_completion_tokens=16)
    for packed in (False, True):
        settings = settings_of(spec, ddp, packed=packed)
        rows, mbs = S.rank_micro_batches(batch, settings, dims)
        stats = S.forward_stats(ddp, batch, mbs, S.logprob_settings(settings, dims, S.process_groups(), ddp))
        if stats is None:
            continue
        mask, zero = ref["mask"][rows], torch.zeros((), dtype=torch.float64)
        emit(check="forward_stats", layout=K.layout_name(dims), packed=packed,
             logp_err=rel_err(torch.where(mask, stats.logp.double().cpu(), zero), ref["logp"][rows]),
             entropy_err=rel_err(torch.where(mask, stats.entropy.double().cpu(), zero), ref["entropy"][rows]))


def layout_phase(batch, ref: dict, tp: int, cp: int, pp: int, seen: dict) -> None:
    """Every check of one TP x CP x PP (x DP) layout against the one-process reference."""
    dims = init_distributed(tp=tp, cp=cp, pp=pp, seed=7)
    chunks = M.build_model(K.model_config(), dims=dims, dtype=DTYPE)
    ddp = wrap_ddp(chunks, OptimConfig(ddp={"grad_reduce_in_fp32": False}))  # fp64 gradients
    C.load_full(ddp, ref["full"], tied=False, tp=tp, tp_rank=dims.tp_rank)
    if cp > 1 and pp == 1:
        K.check_attention(chunks[0], dims)
        rows = slice(dims.dp_rank * batch.size // dims.dp, (dims.dp_rank + 1) * batch.size // dims.dp)
        K.check_logits(ddp, micro_batches(batch, rows, micro_batch_size=MBS, common_length=False,
                                          pad_to_multiple=2 * cp), ref["logits"], dims)
    if cp > 1:
        K.check_ddp_scaling(ddp, dims)
        K.check_one_sender(ddp, dims)
    check_forward_stats(ddp, batch, ref, dims)
    names = LAYOUT_CASES.get((tp, cp, pp), [c["name"] for c in cases(ref["threshold"])])
    for case in [c for c in cases(ref["threshold"]) if c["name"] in names]:
        for packed in (False, True):
            out, metrics, got = run_step(ddp, batch, case, dims, ref, packed=packed, seen=seen)
            if cp == 1:  # the CP=1 step: what the CP layouts must equal (every rank holds all of it at TP=PP=1)
                ref["cp1"][case["name"], packed] = got
            emit(check="step", layout=K.layout_name(dims), case=case["name"], packed=packed, **out)
            agreed = control.all_gather_data(out["metrics_digest"])
            if dims.rank == 0:
                emit(check="metrics", layout=K.layout_name(dims), case=case["name"], packed=packed, metrics=metrics,
                     same_on_every_rank=len(set(agreed)) == 1)
    ps.destroy_model_parallel()


LAYOUT_CASES = {(2, 2, 1): ["gtpo", "gtpo_raw_mu2", "dapo"], (1, 2, 2): ["gtpo", "gtpo_raw_mu2", "dapo"]}
"""GRPO's KL term is per token, TP- and PP-independent: checked in the CP x DP layout and at CP=1."""


def main() -> None:
    layouts, batch = C.start_layouts()
    ref = reference(batch)
    seen = capture_pi_old()
    for item in layouts:
        tp, cp, pp = (int(x) for x in item.split(","))
        layout_phase(batch, ref, tp, cp, pp, seen)


if __name__ == "__main__":
    main()
