"""The loss adapter makes no host sync per micro-batch (issue 20): its metrics and finiteness flags
stay on the device and are read once per update (the flags) and once per step (the metrics).

Counted with tests/sync_count.py (scalar reads, ``.tolist()``/``.numpy()``, device <-> host copies,
data-dependent shapes, under strict mode's host/device bookkeeping) around ``Update.loss`` on CPU,
single process, for the first and the later updates of every algorithm.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_gtpo.algo import AlgoConfig
from megatron_gtpo.parallel.dims import ParallelDims
from megatron_gtpo.train import metric_sums
from megatron_gtpo.train.logprobs import LogprobSettings
from megatron_gtpo.train.loss import PiOld, Update
from megatron_gtpo.train.observer import StepObserver
from megatron_gtpo.train.plan import Groups, StepSettings, make_plan
from tests.dist.scripts._trainstep_common import VOCAB, make_batch
from tests.sync_count import SyncCounter

TEMPERATURE = 0.8
CASES = {
    "gtpo": {"name": "gtpo"},  # the case: GTPO's first update, <H>_i shaped inside the loss
    "gtpo_raw_mu2_tis_kl": {"name": "gtpo", "entropy_logits": "raw", "mu": 2, "mismatch_correction": "tis",
                            "kl_beta": 0.04},
    "grpo_kl_mis": {"name": "grpo", "mismatch_correction": "mis"},
    "drgrpo": {"name": "drgrpo"},
    "dapo_mu3": {"name": "dapo", "mu": 3, "clip_eps_low": 0.01, "clip_eps_high": 0.01},
}


def plan_of(fields: dict, *, micro_batch_size: int = 4):
    """A one-process step plan of the shared test batch (12 completions, 3 micro-batches)."""
    batch = make_batch(0)
    spec = AlgoConfig(**fields).resolve(max_completion_tokens=16)
    dims = ParallelDims(world=1, tp=1, pp=1, dp=1, vpp=None, rank=0, tp_rank=0, pp_rank=0, dp_rank=0)
    settings = StepSettings(spec=spec, micro_batch_size=micro_batch_size, temperature=TEMPERATURE)
    logprobs = LogprobSettings(tp_group=None, tp_rank=0, vocab_size=VOCAB, temperature=TEMPERATURE, chunk_tokens=7)
    ref = torch.where(batch.mask, batch.sampler_logprobs - 0.2, 0.0) if spec.needs_reference else None
    return make_plan(batch, settings, dims, comm=Groups(tp=None, dp=None, pp=None, last_stage_rank=0),
                     logprobs=logprobs, ref_logp=ref)


def logits_of(plan, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [(3 * torch.randn(*mb.input_ids.shape, VOCAB, generator=g)).requires_grad_() for mb in plan.micro_batches]


def run_update(plan, k: int, pi_old: PiOld, observer, logits) -> tuple[Update, list[int]]:
    """Update ``k``'s loss and backward on every micro-batch; the syncs counted in each loss call."""
    update, syncs = Update(plan, k, pi_old, observer), []
    for mb, z in zip(plan.micro_batches, logits):
        x = z * 1.0  # the loss writes its gradient into the logits' storage: a fresh tensor per call
        with SyncCounter() as counter:
            loss, extra = update.loss(mb, x)
        syncs.append(counter.total)
        assert extra == {} and loss.requires_grad, counter.events
        loss.backward()
    return update, syncs


@pytest.mark.parametrize("case", sorted(CASES))
def test_no_host_sync_in_the_loss_of_any_update(case):
    plan = plan_of(CASES[case])
    observer, pi_old, results = StepObserver(plan), PiOld.before_first_update(plan), []
    for k in range(plan.spec.mu):
        update, syncs = run_update(plan, k, pi_old, observer, logits_of(plan, k))
        assert syncs == [0] * len(plan.micro_batches), (case, k, syncs)
        with SyncCounter() as once:
            assert update.sums.nonfinite() == {}
        assert once.total == 1  # the update's one read of its finiteness counts
        pi_old = update.learned() if k == 0 else pi_old
        results.append(update.sums)
    with SyncCounter() as once:
        metrics = metric_sums.read(results, None)
    assert once.total == 1  # the step's one read of every update's metrics
    assert all(math.isfinite(v) for m in metrics for v in m.values()), metrics
    assert {"loss", "train/ratio_min", "mismatch/logprob_abs_max", "clip/low_frac"} <= set(metrics[0])
    if plan.spec.mu >= 3:
        assert "bias/clip_overshoot_rate" in metrics[2] and "mismatch/kl_k3" not in metrics[1]


def test_a_later_update_on_unchanged_weights_repeats_the_first():
    """At mu > 1 the later updates take pi_old from the first one's record: on the same logits the
    ratio is exactly 1 and the loss and the loss's metrics repeat the first update's."""
    plan = plan_of(CASES["gtpo_raw_mu2_tis_kl"])
    observer, logits = StepObserver(plan), logits_of(plan, 0)
    first, _ = run_update(plan, 0, PiOld.before_first_update(plan), observer, logits)
    pi_old = first.learned()
    assert len(pi_old.logp) == len(pi_old.is_weights) == len(plan.micro_batches) and pi_old.prepared is not None
    second, _ = run_update(plan, 1, pi_old, observer, logits)
    one, two = metric_sums.read([first.sums, second.sums], None)
    assert two["train/ratio_min"] == two["train/ratio_max"] == 1.0
    for name in ("loss", "train/ratio_mean", "train/kl_mean", "clip/low_frac"):
        assert two[name] == pytest.approx(one[name], rel=1e-12, abs=1e-12), name


def test_the_counter_sees_each_kind_of_sync():
    """The counter is not blind: every construct the adapter must avoid counts exactly once."""
    x, mask = torch.randn(4), torch.tensor([True, False, True, True])
    constructs = {"item": lambda: x.sum().item(), "bool": lambda: bool((x > 0).any()), "if": lambda: x[0] > 0 or 1,
                  "float": lambda: float(x.max()), "python max": lambda: max(x[0], x[1]), "tolist": x.tolist,
                  "cpu": x.cpu, "to cpu": lambda: x.to("cpu"), "mask index": lambda: x[mask],
                  "nonzero": mask.nonzero, "host data to device": lambda: torch.tensor(1.0, device=x.device),
                  "host tensor to device": lambda: torch.ones(3).to(x.device)}
    for name, construct in constructs.items():
        with SyncCounter() as counter:
            construct()
        assert counter.total == 1, (name, counter.events)
    with SyncCounter() as counter:  # reading a host tensor is free on a GPU too
        torch.ones(2).sum().item()
        torch.full((), 2.0, device=x.device) * x
    assert counter.total == 0, counter.events


def test_nonfinite_values_are_counted_not_raised_in_the_loss():
    """A NaN forward passes through the loss without a host read; the update's one read names what
    was non-finite (train/step.py raises there, before optimizer.step())."""
    plan = plan_of(CASES["gtpo"])
    logits = logits_of(plan, 0)
    with torch.no_grad():
        # the position predicting row 0's second completion token: its <H>_i and the loss
        logits[1][0, int(plan.micro_batches[1].start[0]), 5] = float("nan")
    update, syncs = run_update(plan, 0, PiOld.before_first_update(plan), StepObserver(plan), logits)
    assert syncs == [0] * len(logits)
    bad = update.sums.nonfinite()
    assert set(bad) == {"loss", "GTPO's <H>_i (mean token entropy of a completion)"}, bad
    assert bad["loss"] == 1 and bad["GTPO's <H>_i (mean token entropy of a completion)"] >= 1
