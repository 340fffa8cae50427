"""Issue 16 on gloo ranks (run by tests/dist/test_onepass_step.py): the one-pass train step (GTPO's
<H>_i and pi_old from the first update's own forward) against the pre-pass step
(``tests/prepass.py``: a separate no-grad forward over the batch measures pi_old before the updates).

Usage: torchrun --nproc_per_node=2 onepass_step.py LAYOUT [LAYOUT ...]   (LAYOUT ``tp,pp``, DP the rest)

In each layout and case both paths start from the same weights and optimizer state and take one
``train_step``; per rank, the script reports the largest differences of every metric, of every local
parameter after the step and of every local gradient (``main_grad``, the last update's), whether the
values are bit-identical, how many no-grad pre-passes each path ran (1 and 0: the paths really
differ), and facts that show the checked features are active (entropy filter, shift, ratio, clip).
"""

from __future__ import annotations

import json
import math
import os
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_gtpo.algo import AlgoConfig
from megatron_gtpo.parallel.dims import init_distributed
from megatron_gtpo.train import model as M
from megatron_gtpo.train import step as S
from megatron_gtpo.train.batching import local_rows
from megatron_gtpo.train.optim import OptimConfig, build_optimizer, wrap_ddp
from tests.dist.scripts import _trainstep_common as C
from tests.prepass import pre_pass_step

TEMPERATURE, MBS = 0.8, 2


def emit(**record) -> None:
    line = ("RESULT " + json.dumps({"rank": dist.get_rank(), **record}) + "\n").encode()
    assert len(line) < 4096, "keep RESULT records short (atomic pipe writes)"
    sys.stdout.flush()
    os.write(1, line)


def cases(threshold: dict[float, float]) -> list[dict]:
    """GTPO at mu = 1 (entropy filter between rows, gamma shift, KL), GTPO at mu = 2 with the
    raw-logit entropy statistic (a second no-grad pass at temperature 1) and Adam, DAPO at mu = 2
    with an active clip and mismatch weights (pi_old from the first forward)."""
    sgd = {"optimizer": "sgd", "lr": 0.5, "sgd_momentum": 0.0, "weight_decay": 0.0, "clip_grad": 0.0}
    adam = {"optimizer": "adam", "lr": 1e-5, "weight_decay": 0.0, "clip_grad": 1.0}
    return [
        dict(name="gtpo", cfg=AlgoConfig(name="gtpo", entropy_threshold=threshold[TEMPERATURE], kl_beta=0.04),
             opt=sgd),
        dict(name="gtpo_raw_mu2", opt=adam,
             cfg=AlgoConfig(name="gtpo", entropy_threshold=threshold[1.0], entropy_logits="raw", mu=2,
                            clip_eps_low=0.02, clip_eps_high=0.02)),
        dict(name="dapo_mu2_tis", opt={**sgd, "lr": 0.05},
             cfg=AlgoConfig(name="dapo", mu=2, clip_eps_low=0.02, clip_eps_high=0.02, mismatch_correction="tis")),
    ]


def full_weights(batch) -> tuple[dict, dict[float, float], torch.Tensor]:
    """TP1 weights (the same on every rank), per entropy temperature a threshold between two rows'
    <H>_i, and a 'reference model' log-prob table [B, T] near the policy's (a moderate KL term)."""
    dims = init_distributed(tp=1, pp=1, seed=7)
    torch.manual_seed(0)
    model = M.build_model(C.tiny_config(tied=False), dims=dims)[0]
    with torch.no_grad():  # sharper next-token distributions: entropies spread around the threshold
        model.output_layer.weight.mul_(40.0)
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    for value in full.values():
        dist.broadcast(value, src=0)
    with torch.no_grad():
        ids, pos = C.sequence_view(batch)
        logits = model(ids, pos, M.causal_mask(ids.shape[1]))
    threshold = {}
    for temperature in (TEMPERATURE, 1.0):
        logp, _, clamped, _, mask = C.dense_token_stats(logits, batch, temperature)
        mean_h = (clamped.sum(1) / mask.sum(1)).sort().values
        threshold[temperature] = float(mean_h[len(mean_h) // 2 - 1: len(mean_h) // 2 + 1].mean())
    logp = C.dense_token_stats(logits, batch, TEMPERATURE)[0]
    g = torch.Generator().manual_seed(11)
    ref_logp = torch.where(mask, (logp + 0.3 * torch.randn(logp.shape, generator=g, dtype=logp.dtype)).float(), 0.0)
    ps.destroy_model_parallel()
    return full, threshold, ref_logp


def counting_forward_stats():
    """Wraps ``step.forward_stats`` (what the pre-pass calls) with a call counter."""
    original, calls = S.forward_stats, [0]

    def wrapped(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    S.forward_stats = wrapped
    return calls


def one_step(ddp, batch, full, case, dims, *, pre_pass: bool, calls, ref_logp):
    """Loads ``full``, builds a fresh optimizer and takes one train_step; returns (metrics, params,
    grads, pre-passes run) with the local tensors keyed by global name."""
    C.load_full(ddp, full, tied=False, tp=dims.tp, tp_rank=dims.tp_rank)
    optimizer, scheduler = build_optimizer(ddp, OptimConfig(optimizer=case["opt"]), total_steps=4)
    settings = S.StepSettings(spec=case["cfg"].resolve(max_completion_tokens=16), micro_batch_size=MBS,
                              temperature=TEMPERATURE, chunk_tokens=5)
    before = calls[0]
    step = pre_pass_step if pre_pass else S.train_step
    metrics = step(SimpleNamespace(chunks=ddp, optimizer=optimizer, scheduler=scheduler), batch, settings,
                   dims, ref_logp=ref_logp)
    params = {g: p.detach().clone() for g, _, p in C.named_local_params(ddp, tied=False)}
    grads = {g: p.main_grad.detach().clone() for g, _, p in C.named_local_params(ddp, tied=False)}
    return metrics, params, grads, calls[0] - before


def max_rel(a: dict, b: dict) -> tuple[float, bool]:
    """Largest ``|a - b| / max(|b|, 1)`` over the entries of two name -> tensor/float dicts, and
    whether every entry is bit-identical."""
    worst, same = 0.0, True
    for name in b:
        x, y = torch.as_tensor(a[name], dtype=torch.float64), torch.as_tensor(b[name], dtype=torch.float64)
        same = same and torch.equal(x, y)
        worst = max(worst, float(((x - y).abs() / y.abs().clamp(min=1.0)).max()))
    return worst, same


def layout_phase(batch, full, threshold: dict[float, float], layout: tuple[int, int], calls, ref_logp) -> None:
    tp, pp = layout
    dims = init_distributed(tp=tp, pp=pp, seed=7)
    chunks = M.build_model(C.tiny_config(tied=False), dims=dims)
    ddp = wrap_ddp(chunks, OptimConfig())
    name = f"tp{tp}_pp{pp}_dp{dims.dp}"
    rows = local_rows(batch.size, dp=dims.dp, dp_rank=dims.dp_rank, micro_batch_size=MBS)
    for case in cases(threshold):
        ref = ref_logp[rows] if case["cfg"].resolve(max_completion_tokens=16).needs_reference else None
        m_ref, p_ref, g_ref, n_ref = one_step(ddp, batch, full, case, dims, pre_pass=True, calls=calls, ref_logp=ref)
        m_one, p_one, g_one, n_one = one_step(ddp, batch, full, case, dims, pre_pass=False, calls=calls, ref_logp=ref)
        metric_err, metric_same = max_rel(m_one, m_ref)
        param_err, param_same = max_rel(p_one, p_ref)
        grad_err, grad_same = max_rel(g_one, g_ref)
        moved = max(float((p_ref[g] - C.local_piece(full[g], n, p, tp=tp, tp_rank=dims.tp_rank)).abs().max())
                    for g, n, p in C.named_local_params(ddp, tied=False))
        emit(check="onepass", layout=name, case=case["name"], pre_passes=[n_ref, n_one],
             names_equal=sorted(m_one) == sorted(m_ref), metric_err=metric_err, metric_same=metric_same,
             param_err=param_err, param_same=param_same, grad_err=grad_err, grad_same=grad_same, moved=moved,
             loss=m_one["loss"], filtered=m_one["gtpo/filtered_frac"], entropy=m_one["entropy/mean"],
             ratio_max=m_one["train/ratio_max"], clip=m_one["clip/low_frac"] + m_one["clip/high_frac"],
             nonfinite=[k for k, v in m_one.items() if not math.isfinite(v)])
    nonfinite_phase(ddp, batch, full, cases(threshold)[1], dims, name)  # GTPO at mu = 2, no KL term
    ps.destroy_model_parallel()


def nonfinite_phase(ddp, batch, full, case, dims, name) -> None:
    """NaN output-layer weights (NaN logits, <H>_i and loss on the last stage): every rank raises
    before the optimizer step, so no parameter changes (issue 20's one finiteness flag per update)."""
    nan_full = {k: torch.full_like(v, float("nan")) if "output_layer" in k else v for k, v in full.items()}
    C.load_full(ddp, nan_full, tied=False, tp=dims.tp, tp_rank=dims.tp_rank)
    before = {g: p.detach().clone() for g, _, p in C.named_local_params(ddp, tied=False)}
    optimizer, scheduler = build_optimizer(ddp, OptimConfig(optimizer=case["opt"]), total_steps=4)
    settings = S.StepSettings(spec=case["cfg"].resolve(max_completion_tokens=16), micro_batch_size=MBS,
                              temperature=TEMPERATURE)
    error = ""
    try:
        S.train_step(SimpleNamespace(chunks=ddp, optimizer=optimizer, scheduler=scheduler), batch, settings, dims)
    except FloatingPointError as err:
        error = str(err)
    after = {g: p.detach() for g, _, p in C.named_local_params(ddp, tied=False)}
    unchanged = all(torch.equal(before[g], after[g]) or bool(before[g].isnan().all()) for g in before)
    emit(check="nonfinite", layout=name, error=error[:300], unchanged=unchanged)


def main() -> None:
    layouts = [tuple(int(x) for x in item.split(",")) for item in sys.argv[1:]]
    dist.init_process_group("gloo")
    batch = C.make_batch(0)
    full, threshold, ref_logp = full_weights(batch)
    calls = counting_forward_stats()
    for layout in layouts:
        layout_phase(batch, full, threshold, layout, calls, ref_logp)


if __name__ == "__main__":
    main()
