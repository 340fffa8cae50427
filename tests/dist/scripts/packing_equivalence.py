"""Multi-rank check: the packed train step (``train.micro_batch_tokens``) gives the padded path's
loss, gradients, parameter updates, metrics and no-grad log-probs/entropies in several (TP, PP, DP[,
VPP]) layouts.

Usage: torchrun --nproc_per_node=N packing_equivalence.py LAYOUT [LAYOUT ...]
LAYOUT is ``tp,pp[,vpp]`` (DP = N / (tp*pp)). Every layout loads the same TP1/PP1 weights, then for
each algorithm case runs ``train_step`` once padded (micro-batches of 2 rows) and once packed (a
budget of ~3 rows, so rows of different micro-batches and prompt groups share one packed row), from
the same weights. Prints one ``RESULT {json}`` line per check; tests/dist/test_packing.py judges.
"""

from __future__ import annotations

import collections
import math
from types import SimpleNamespace

import torch
from megatron.core import parallel_state as ps

from megatron_gtpo.algo import AlgoConfig
from megatron_gtpo.parallel import strict
from megatron_gtpo.parallel.dims import init_distributed
from megatron_gtpo.train import model as M
from megatron_gtpo.train.batching import row_tokens
from megatron_gtpo.train.optim import OptimConfig, build_optimizer, wrap_ddp
from megatron_gtpo.train.step import StepSettings, forward_stats, logprob_settings, process_groups, rank_micro_batches, \
    train_step
from tests.dist.scripts import _trainstep_common as C
from tests.dist.scripts.trainstep_equivalence import emit, rel_err, synthetic_ref_logp

TEMPERATURE, MBS, BUDGET = 0.8, 2, 36


def cases(threshold: float, raw_threshold: float) -> list[dict]:
    sgd = {"optimizer": "sgd", "lr": 0.5, "sgd_momentum": 0.0, "weight_decay": 0.0, "clip_grad": 0.0}
    return [
        dict(name="gtpo", cfg=AlgoConfig(name="gtpo", entropy_threshold=threshold), ref=False, opt=sgd),
        dict(name="grpo_kl", cfg=AlgoConfig(name="grpo", kl_beta=0.04), ref=True, opt=sgd),
        dict(name="dapo_mu2", cfg=AlgoConfig(name="dapo", mu=2, clip_eps_low=0.02, clip_eps_high=0.02), ref=False,
             opt={**sgd, "lr": 1e-4, "clip_grad": 1.0}),
        # GTPO at mu = 2 with the filter on raw-logit entropies: update 2 reuses update 1's <H>_i per
        # row, so a packed row placed at the wrong index would change A~ there. SGD, as dapo_mu2:
        # Adam's m / sqrt(v) turns the fp32 rounding of near-zero gradients into +-lr updates, which
        # would hide nothing but make the parameter comparison meaningless.
        dict(name="gtpo_raw_mu2", cfg=AlgoConfig(name="gtpo", mu=2, entropy_threshold=raw_threshold, entropy_logits="raw",
                                                 clip_eps_low=0.02, clip_eps_high=0.02), ref=False,
             opt={**sgd, "lr": 1e-4, "clip_grad": 1.0}),
        # Dr. GRPO's constant normaliser (seq-mean-token-sum-norm): the same L in every micro-batch
        dict(name="drgrpo", cfg=AlgoConfig(name="drgrpo"), ref=False, opt=sgd),
        # GSPO's per-row mean log-ratio: a packed row's tokens must be averaged over its own row only
        dict(name="gspo_mu2", cfg=AlgoConfig(name="gspo", mu=2, clip_eps_low=0.02, clip_eps_high=0.02), ref=False,
             opt={**sgd, "lr": 1e-4, "clip_grad": 1.0}),
    ]


def _median_pair(clamped: torch.Tensor, mask: torch.Tensor) -> float:
    """Between the two middle rows' <H>_i: a threshold that filters about half of the rows."""
    mean_h = (clamped.sum(1) / mask.sum(1)).sort().values
    return float(mean_h[len(mean_h) // 2 - 1: len(mean_h) // 2 + 1].mean())


def _reference(batch) -> tuple[dict, tuple[float, float], torch.Tensor]:
    """TP1/PP1 weights every layout loads, entropy thresholds between two rows' <H>_i (of the
    sampling distribution, and of the raw logits) and a reference-model log-prob table near the
    policy's (GRPO's KL term)."""
    dims = init_distributed(tp=1, pp=1, seed=7)
    torch.manual_seed(0)
    model = M.build_model(C.tiny_config(tied=False), dims=dims)[0]
    with torch.no_grad():  # sharper next-token distributions: entropies spread around the threshold
        model.output_layer.weight.mul_(40.0)
        full = {n: p.detach().clone() for n, p in model.named_parameters()}
        input_ids, position_ids = C.sequence_view(batch)
        logits = model(input_ids, position_ids, M.causal_mask(input_ids.shape[1]))
        logp, _, clamped, _, mask = C.dense_token_stats(logits, batch, TEMPERATURE)
        raw_clamped = C.dense_token_stats(logits, batch, 1.0)[2]
    ps.destroy_model_parallel()
    thresholds = (_median_pair(clamped, mask), _median_pair(raw_clamped, mask))
    return full, thresholds, synthetic_ref_logp(batch, logp)


def _run(ddp, batch, dims, case, *, budget: int, full: dict, ref_logp) -> dict:
    """One train_step from ``full`` on the padded (budget 0) or packed path."""
    C.load_full(ddp, full, tied=False, tp=dims.tp, tp_rank=dims.tp_rank)
    optimizer, scheduler = build_optimizer(ddp, OptimConfig(optimizer=case["opt"]), total_steps=4)
    settings = StepSettings(spec=case["cfg"].resolve(max_completion_tokens=16), micro_batch_size=MBS,
                            temperature=TEMPERATURE, chunk_tokens=5, micro_batch_tokens=budget)
    rows, mbs = rank_micro_batches(batch, settings, dims)
    before = collections.Counter(strict.CHECKED)
    metrics = train_step(SimpleNamespace(chunks=ddp, optimizer=optimizer, scheduler=scheduler), batch, settings, dims,
                         ref_logp=ref_logp[rows] if case["ref"] else None)
    checked = {f"{op}/{kind or 'unclassified'}": n for (op, kind), n in (strict.CHECKED - before).items()}
    named = list(C.named_local_params(ddp, tied=False))
    return {"metrics": metrics, "grads": {g: p.main_grad.detach().clone() for g, _, p in named},
            "params": {g: p.detach().clone() for g, _, p in named}, "mbs": mbs, "strict": checked}


def _errors(got: dict, want: dict) -> tuple[float, float]:
    """Relative errors of this rank's tensors: norm-wise over all of them (||got - want|| / ||want||)
    and the worst single tensor (max |got - want| / max |want|)."""
    diff = math.sqrt(sum(float(((got[k].double() - want[k].double()) ** 2).sum()) for k in want))
    norm = math.sqrt(sum(float((want[k].double() ** 2).sum()) for k in want))
    return diff / max(norm, 1e-30), max(rel_err(got[k], want[k]) for k in want)


def _metric_diff(got: dict, want: dict) -> tuple[list, float, str]:
    """Names present in only one of the two, the largest |difference| / max(|value|, 1e-3) and its name."""
    keys = sorted(set(got) ^ set(want))
    errs = {k: abs(got[k] - want[k]) / max(abs(want[k]), 1e-3) for k in want if k in got and math.isfinite(want[k])}
    worst = max(errs, key=errs.get)
    return keys, errs[worst], worst


def _packing_shape(batch, mbs) -> dict:
    """What the packed micro-batches look like on this rank (to prove the check is not trivial)."""
    rows = [mb.rows.tolist() for mb in mbs]
    return {"count": len(mbs), "rows": rows, "tokens": [int(row_tokens(batch)[mb.rows].sum()) for mb in mbs],
            "lengths": [mb.input_ids.shape[1] for mb in mbs],
            "mixed": any(r != list(range(r[0], r[0] + len(r))) for r in rows)}


def layout_phase(batch, ref: tuple[dict, float, torch.Tensor], layout: tuple[int, int, int | None]) -> None:
    (tp, pp, vpp), (full, threshold, ref_logp) = layout, ref
    dims = init_distributed(tp=tp, pp=pp, vpp=vpp, seed=7)
    chunks = M.build_model(C.tiny_config(tied=False), dims=dims, overrides={"batch_p2p_comm": False} if vpp else None)
    name = f"tp{tp}_pp{pp}_dp{dims.dp}" + (f"_vpp{vpp}" if vpp else "")
    _check_forward_stats(chunks, batch, full, dims, name)
    ddp = wrap_ddp(chunks, OptimConfig())
    for case in cases(*threshold):
        padded, packed = (_run(ddp, batch, dims, case, budget=b, full=full, ref_logp=ref_logp) for b in (0, BUDGET))
        only_one, metric_err, metric_worst = _metric_diff(packed["metrics"], padded["metrics"])
        grad_err, grad_err_max = _errors(packed["grads"], padded["grads"])
        emit(check="train_step", layout=name, case=case["name"], loss=packed["metrics"]["loss"],
             loss_ref=padded["metrics"]["loss"], grad_norm=packed["metrics"]["optim/grad_norm"],
             grad_norm_ref=padded["metrics"]["optim/grad_norm"], grad_err=grad_err, grad_err_max=grad_err_max,
             param_err=_errors(packed["params"], padded["params"])[1], metric_err=metric_err,
             metric_worst=metric_worst, metric_only_one=only_one,
             padded_count=len(padded["mbs"]), packing=_packing_shape(batch, packed["mbs"]),
             last_stage=dims.is_last_stage, filtered_frac=packed["metrics"].get("gtpo/filtered_frac"),
             ratio_max=packed["metrics"].get("train/ratio_max"), strict=packed["strict"] if case["name"] == "gtpo" else None)
    ps.destroy_model_parallel()


def _check_forward_stats(chunks, batch, full, dims, name) -> None:
    """No-grad log-probs and entropies of this rank's rows, packed against padded (last stage)."""
    C.load_full(chunks, full, tied=False, tp=dims.tp, tp_rank=dims.tp_rank)
    out = []
    for budget in (0, BUDGET):
        settings = StepSettings(spec=AlgoConfig().resolve(max_completion_tokens=16), micro_batch_size=MBS,
                                temperature=TEMPERATURE, chunk_tokens=7, micro_batch_tokens=budget)
        rows, mbs = rank_micro_batches(batch, settings, dims)
        out.append(forward_stats(chunks, batch, mbs, logprob_settings(settings, dims, process_groups(), chunks)))
    if out[0] is None:
        return
    padded, packed = out
    emit(check="forward_stats", layout=name, logp_err=rel_err(packed.logp, padded.logp),
         entropy_err=rel_err(packed.entropy, padded.entropy),
         mean_entropy_err=rel_err(packed.mean_entropy, padded.mean_entropy),
         masked_nonzero=float(torch.where(batch.mask[rows], 0.0, packed.logp.abs()).max()))


def main() -> None:
    layouts, batch = C.start_layouts()
    ref = _reference(batch)
    for item in layouts:
        parts = [int(x) for x in item.split(",")]
        layout_phase(batch, ref, (parts[0], parts[1], parts[2] if len(parts) > 2 else None))


if __name__ == "__main__":
    main()
