"""The train step's loss under context parallelism, single process (issue 23 phase B): the plan's
CP shards go through the real ``Update.loss`` without a host sync per micro-batch, and the two CP
ranks' losses and gradients add up to the CP=1 step's (tests/dist/test_cp.py runs the whole step on
real CP groups, where GTPO's <H>_i is gathered over the group).

The "logits" are a function of each position's token and global position only (two tables), so
a shard's logits are exactly the CP=1 logits at the positions it holds, padded or packed.
"""

from __future__ import annotations

import pytest
import torch

from megatron_gtpo.algo import AlgoConfig
from megatron_gtpo.parallel.dims import ParallelDims
from megatron_gtpo.train.cp_shard import CPShard
from megatron_gtpo.train.logprobs import LogprobSettings
from megatron_gtpo.train.loss import PiOld, Update
from megatron_gtpo.train.observer import StepObserver
from megatron_gtpo.train.plan import Groups, StepSettings, make_plan
from tests.dist.scripts._trainstep_common import VOCAB, make_batch
from tests.sync_count import SyncCounter

TEMPERATURE = 0.8
CASES = {
    "gtpo": {"name": "gtpo"},
    "gtpo_raw_mu2_tis_kl": {"name": "gtpo", "entropy_logits": "raw", "mu": 2, "mismatch_correction": "tis",
                            "kl_beta": 0.04},
    "grpo_kl_mis": {"name": "grpo", "kl_beta": 0.04, "mismatch_correction": "mis"},
    "dapo": {"name": "dapo"},
}


def plan_of(fields: dict, *, cp: int, cp_rank: int, packed: bool):
    batch = make_batch(0)
    spec = AlgoConfig(**fields).resolve(max_completion_tokens=16)
    dims = ParallelDims(world=cp, tp=1, pp=1, dp=1, vpp=None, rank=cp_rank, tp_rank=0, pp_rank=0, dp_rank=0, cp=cp,
                        cp_rank=cp_rank)
    settings = StepSettings(spec=spec, micro_batch_size=4, temperature=TEMPERATURE,
                            micro_batch_tokens=48 if packed else 0)
    logprobs = LogprobSettings(tp_group=None, tp_rank=0, vocab_size=VOCAB, temperature=TEMPERATURE, chunk_tokens=7)
    ref = torch.where(batch.mask, batch.sampler_logprobs - 0.2, 0.0) if spec.needs_reference else None
    return make_plan(batch, settings, dims, comm=Groups(tp=None, dp=None, pp=None, last_stage_rank=0),
                     logprobs=logprobs, ref_logp=ref)


class Logits(torch.nn.Module):
    """Logits at a position = f(its token, its global position): the same in every layout."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.tokens = torch.nn.Parameter(3 * torch.randn(VOCAB, VOCAB, generator=g, dtype=torch.float64))
        self.positions = torch.nn.Parameter(torch.randn(64, VOCAB, generator=g, dtype=torch.float64))

    def forward(self, mb):
        return self.tokens[mb.input_ids] + self.positions[mb.position_ids]


def first_update(plan, model) -> tuple[Update, list[int]]:
    update, syncs = Update(plan, 0, PiOld.before_first_update(plan), StepObserver(plan)), []
    for mb in plan.micro_batches:
        logits = model(mb)
        with SyncCounter() as counter:
            loss, _ = update.loss(mb, logits)
        syncs.append(counter.total)
        loss.backward()
    return update, syncs


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("case", ["gtpo", "gtpo_raw_mu2_tis_kl", "grpo_kl_mis"])
def test_cp_loss_makes_no_host_sync_per_micro_batch(case, packed):
    plan = plan_of(CASES[case], cp=2, cp_rank=1, packed=packed)
    assert all(isinstance(mb, CPShard) for mb in plan.micro_batches)
    assert plan.metric_weight == 1 / (2 * len(plan.micro_batches))
    observer, pi_old, model = StepObserver(plan), PiOld.before_first_update(plan), Logits()
    for k in range(plan.spec.mu):
        update = Update(plan, k, pi_old, observer)
        for mb in plan.micro_batches:
            logits = model(mb)
            with SyncCounter() as counter:
                loss, _ = update.loss(mb, logits)
            assert counter.total == 0, (case, k, counter.events)
            loss.backward()
        pi_old = update.learned() if k == 0 else pi_old


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("case", ["grpo_kl_mis", "dapo"])
def test_cp_rank_losses_add_up_to_the_cp1_loss(case, packed):
    """Sum over the two CP ranks of the step's loss shares and their gradients = the CP=1 step's
    (GRPO: seq-mean-token-mean, whose 1/|o_i| must be the whole completion's), and the summed
    per-token metric pairs give the CP=1 means (the per-completion ``entropy/mean`` needs the CP
    group's all-reduce: tests/dist/test_cp.py)."""
    results = []
    for cp, ranks in ((1, [0]), (2, [0, 1])):
        model, total, pairs = Logits(), 0.0, {}
        for rank in ranks:
            update, _ = first_update(plan_of(CASES[case], cp=cp, cp_rank=rank, packed=packed), model)
            total += float(update.sums.pairs["loss"][0])  # the sum of this rank's micro-batch losses
            for name, pair in update.sums.pairs.items():
                pairs[name] = pairs.get(name, 0) + pair
        grads = torch.cat([p.grad.flatten() for p in model.parameters()])
        results.append((total, grads, {n: float(p[0] / p[1]) for n, p in pairs.items()}))
    (loss1, grad1, m1), (loss2, grad2, m2) = results
    assert loss2 == pytest.approx(loss1, rel=1e-12, abs=1e-15)
    assert torch.allclose(grad2, grad1, rtol=1e-10, atol=1e-13)
    assert m1.keys() == m2.keys() and ("train/kl_mean" in m1) == (case == "grpo_kl_mis")
    assert m2["loss"] == pytest.approx(loss1, rel=1e-12)  # the loss pair's weights are 1 / (mbs x CP)
    for name in set(m1) - {"entropy/mean"}:  # per completion: gathered over the CP group (no group here)
        assert m2[name] == pytest.approx(m1[name], rel=1e-9, abs=1e-12), name
