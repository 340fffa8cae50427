"""2-rank check (TP=2, sequence parallelism on): Megatron's TopKRouter on each TP rank's SP slice of
the tokens, with the project's RouterWatch replaying the engine's routing and collecting moe/*.

What a GPU run at TP > 1 does (Megatron requires sequence parallelism for a mixture at TP > 1): the
MoE layer's input is ``[S/tp, b, h]``, rank r's slice of the sequence (``scatter_to_sequence_parallel_
region``). Here the real router (weights replicated over TP, as Megatron keeps them) runs on that
slice; the rest of the model is left out because Megatron's local layer spec cannot run sequence
parallelism on CPU (its torch norms assert; see the spec's megatron_cpu.md), so the slice is cut as
the scatter cuts it. Checked per rank: the routing the replay produced equals the engine's experts
of exactly the tokens this rank holds, for a padded micro-batch ([S, b] sequence-major) and a packed
one (one row); and the moe/* metrics, summed over the TP group, equal the whole sequence's computed
in one process. Prints one ``RESULT {json}`` line per check.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state as ps
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.moe.router import TopKRouter

from megatron_gtpo.parallel.dims import init_distributed
from megatron_gtpo.train.routing import MoeTokens, attach, moe_metrics
from tests.dist.scripts.trainstep_equivalence import emit

EXPERTS, TOP_K, HIDDEN = 8, 2, 16


class Chunk(torch.nn.Module):
    """What RouterWatch looks for in a model chunk: a TopKRouter of layer 1."""

    def __init__(self, router):
        super().__init__()
        self.router = router
        router.layer_number = 1


def build_router(tp: int) -> TopKRouter:
    config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=2, num_moe_experts=EXPERTS,
                               moe_router_topk=TOP_K, moe_router_score_function="softmax", moe_aux_loss_coeff=0.0,
                               tensor_model_parallel_size=tp, sequence_parallel=True, use_cpu_initialization=True,
                               moe_token_dispatcher_type="alltoall", add_bias_linear=False)
    router = TopKRouter(config, pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    torch.manual_seed(5)  # the same weights on every TP rank, as Megatron keeps a router's
    with torch.no_grad():
        router.weight.copy_(torch.randn_like(router.weight))
    return router


def case(name: str, seq: int, rows: int, gen: torch.Generator) -> tuple[torch.Tensor, MoeTokens]:
    """Hidden states [S, b, h] and the MoE tokens in sequence-major order (token s * b + row)."""
    hidden = torch.randn(seq, rows, HIDDEN, generator=gen)
    count = seq * rows
    engine = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(count)])[:, None]
    engine[torch.rand(count, generator=gen) < 0.2] = -1  # tokens the engine never fed
    real = torch.rand(count, generator=gen) > 0.1
    completion = real & (torch.rand(count, generator=gen) > 0.3)
    return hidden, MoeTokens(engine=engine, real=real, completion=completion)


def reference(router: TopKRouter, hidden: torch.Tensor, tokens: MoeTokens) -> dict[str, float]:
    """moe/* of the whole sequence in one process: replayed experts (filler 0..k-1 where unknown)."""
    logits = hidden.reshape(-1, HIDDEN).float() @ router.weight.float().T
    chosen = tokens.engine[:, 0]
    chosen = torch.where(chosen >= 0, chosen, torch.arange(TOP_K).expand_as(chosen))
    routing = torch.zeros(len(chosen), EXPERTS, dtype=torch.bool).scatter_(1, chosen, True) & tokens.real[:, None]
    logp = torch.log_softmax(logits, -1)
    entropy = -(logp.exp() * logp).sum(-1)
    known = tokens.completion & (tokens.engine[:, 0] >= 0).all(-1)
    sums = torch.zeros(1, EXPERTS + 5, dtype=torch.float64)
    sums[0, :EXPERTS] = routing.sum(0).double()
    sums[0, EXPERTS] = tokens.real.sum()
    sums[0, EXPERTS + 1] = torch.where(tokens.real, entropy, 0.0).sum().double()
    sums[0, EXPERTS + 3] = sums[0, EXPERTS + 4] = known.sum()
    return moe_metrics(sums)


def main() -> None:
    dims = init_distributed(tp=2, seed=3)
    router = build_router(dims.tp)
    chunk = Chunk(router)
    watch = attach([chunk], replay=True, layers=1)
    gen = torch.Generator().manual_seed(11)
    for name, seq, rows in (("padded", 12, 3), ("packed", 20, 1)):
        hidden, tokens = case(name, seq, rows, gen)
        local = hidden.chunk(dims.tp, dim=0)[dims.tp_rank]  # the SP slice: [S/tp, b, h]
        watch.collect = True
        with watch.micro_batch(chunk, tokens):
            _, routing_map = router(local)
        watch.collect = False
        mine = tokens.share(dims.tp_rank, dims.tp)
        expected = torch.where(mine.engine[:, 0] >= 0, mine.engine[:, 0], torch.arange(TOP_K).expand(len(mine.real), TOP_K))
        got = routing_map.reshape(-1, EXPERTS)
        want = torch.zeros_like(got).scatter_(1, expected, True)
        metrics = watch.metrics(groups=(ps.get_data_parallel_group(), ps.get_pipeline_model_parallel_group()))
        ref = reference(router, hidden, tokens)
        emit(check="sp_router", case=name, tp_rank=dims.tp_rank, tokens=int(got.shape[0]),
             total=seq * rows, replayed_exact=bool(torch.equal(got, want)),
             metric_err=max(abs(metrics[k] - ref[k]) / max(abs(ref[k]), 1e-12) for k in ref),
             keys=sorted(set(metrics) ^ set(ref)), agreement=metrics.get("moe/routing_agreement"))


if __name__ == "__main__":
    main()
