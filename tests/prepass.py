"""The pre-pass train step: the reference the one-pass step is tested (tests/dist/test_onepass_step.py)
and benchmarked (bench/step_time.py) against. Not part of the package: no algorithm needs it.

Before issue 16 the step ran a separate no-grad forward over this rank's rows to measure pi_old
(GTPO's <H>_i, the log-probs at mu > 1) before its first update. Here that forward measures a
:class:`PiOld` which the production ``update`` receives as already known, so the updates run the
production code; only where pi_old comes from differs (the first update learns nothing).
"""

from __future__ import annotations

import dataclasses

from megatron_gtpo import algo
from megatron_gtpo.parallel import collectives
from megatron_gtpo.train import step as S
from megatron_gtpo.train.loss import PiOld
from megatron_gtpo.train.observer import StepObserver
from megatron_gtpo.train.plan import StepPlan, to_device


def measured_pi_old(model_chunks, plan: StepPlan) -> PiOld:
    """pi_old from a no-grad forward of this rank's micro-batches (``S.forward_stats``, looked up at
    call time so a test can count the calls), as the former pre-pass did; nothing is measured when
    the algorithm needs neither <H>_i nor pi_old's log-probs."""
    spec, pi_old = plan.spec, PiOld.before_first_update(plan)
    if not (spec.needs_old_logp or spec.needs_mean_entropy):
        return pi_old
    stats = S.forward_stats(model_chunks, plan.batch, plan.micro_batches, plan.logprobs,
                            entropy_prob_floor=spec.entropy_prob_floor,
                            entropy_temperature=spec.entropy_temperature(plan.logprobs.temperature))
    if stats is None:  # not the last pipeline stage
        return pi_old
    device = collectives.comm_device()
    if spec.needs_mean_entropy:
        mean_entropy = collectives.all_gather_rows(stats.mean_entropy.to(device), plan.comm.dp).cpu()
        host = algo.shape_batch(spec, plan.host_prepared, mean_entropy)
        pi_old = dataclasses.replace(pi_old, prepared=to_device(host, device), host_prepared=host)
    if spec.needs_old_logp:
        logp = stats.logp.to(device)
        pi_old = dataclasses.replace(pi_old, logp=tuple(plan.local(logp, mb) for mb in plan.micro_batches))
    return pi_old


def pre_pass_step(policy, batch, settings, dims, *, ref_logp=None) -> dict[str, float]:
    """``S.train_step`` with pi_old measured by a separate no-grad forward before the updates."""
    plan = S.plan_step(policy.chunks, batch, settings, dims, ref_logp=ref_logp)
    S.check_schedule(policy.chunks, len(plan.micro_batches), dims)
    observer, pi_old, updates = StepObserver(plan), measured_pi_old(policy.chunks, plan), []
    for k in range(plan.spec.mu):
        pi_old, result = S.update(policy, plan, k, pi_old, observer)
        updates.append(result)
    return S.finish(plan, pi_old, updates, observer)
