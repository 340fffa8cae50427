"""Rollout routing replay at Megatron-Core's own router, without a process group: the regression
cases for the replay bugs other stacks met (replay of another layer, of another micro-batch's rows,
of shifted or padded positions, and the layer index after a pipeline stage boundary).

The path is the product's from the completions on: ``collate`` (``batch_routing``), this DP rank's
micro-batches (``plan.rank_micro_batches``: padded, or packed rows of whole sequences), each
micro-batch's ``MoeTokens`` (``tokens_of``) and ``RouterWatch`` driving real ``TopKRouter``s under
REPLAY_FORWARD. The oracle does not come from those helpers: every token id encodes its row and
position (``_token``), so the test reads from the micro-batch's own ``input_ids`` which token the
router sees at each flattened slot (Megatron's MoE layer flattens ``[s, b]`` sequence-major) and
checks the experts it was routed to against that completion's own ``routed_experts`` (what the
engine handed over). Positions the engine never fed (each completion's last token, padding) must
get the filler experts ``0 .. k-1`` (``train/routing.py``).

Proved against (each bug injected once, the three cases run, the bug reverted; "slots": token slots
of both micro-batches over the chunk's layers whose experts differ from the captured ones):
* another layer's routing (``tokens.engine[:, (layer + 1) % self.layers]`` in
  ``RouterWatch.micro_batch``): padded 71 / packed 71 of 128 slots, stage 1 36 of 64, all failed.
* the wrong micro-batch order (each micro-batch given the next one's ``tokens_of`` in
  ``plan.rank_micro_batches``; both have one length, so nothing breaks on a shape): padded 72 /
  packed 80 of 128, stage 1 34 of 64, all failed.
* padded positions in row-major order (no ``.transpose(0, 1)`` in ``tokens_of``'s padded branch):
  padded 77 of 128, stage 1 35 of 64 failed; packed passed (one row: no order to get wrong).
* routing shifted by one token (``out[row, 1:len(rows) + 1]`` in ``batch_routing``): padded /
  packed 84 of 128, stage 1 41 of 64, all failed.
* the local layer index on a later pipeline stage (``enumerate`` over the chunk's routers instead
  of ``layer_number - 1`` in ``RouterWatch.__init__``): stage 1 33 of 64 failed; the PP=1 cases
  passed (stage 0's local and global indices are the same).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megatron_gtpo.algo import AlgoConfig
from megatron_gtpo.parallel.dims import ParallelDims
from megatron_gtpo.train.batching import collate
from megatron_gtpo.train.plan import StepSettings, rank_micro_batches
from megatron_gtpo.train.routing import RouterWatch
from megatron_gtpo.types import Completion, Prompt, ScoredGroup

LAYERS, EXPERTS, TOP_K = 4, 4, 2
PROMPTS, COMPLETIONS = [3, 5, 2, 4, 6, 2, 2, 3], [4, 2, 5, 3, 1, 3, 6, 2]  # 8 rows of unequal lengths
FILLER = set(range(TOP_K))


def _token(row: int, pos: int) -> int:
    """A token id naming its row and sequence position (0 is the pad id)."""
    return 1 + 100 * row + pos


def _groups() -> list[ScoredGroup]:
    """One completion per group (so every row's prompt tokens are its own), each with distinct random
    experts for every token the engine fed (prompt and completion but the last token)."""
    rng = np.random.default_rng(5)
    groups = []
    for row, (p, c) in enumerate(zip(PROMPTS, COMPLETIONS)):
        fed = p + c - 1
        routed = rng.random((fed, LAYERS, EXPERTS)).argsort(-1)[..., :TOP_K].astype(np.int16)
        prompt = [_token(row, s) for s in range(p)]
        comp = Completion(prompt_index=row, prompt_token_ids=prompt, token_ids=[_token(row, p + t) for t in range(c)],
                          logprobs=[0.0] * c, routed_experts=routed)
        groups.append(ScoredGroup(prompt=Prompt(uid=str(row), token_ids=prompt), completions=[comp], rewards=[0.0]))
    return groups


def _config(pp: int = 1):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(num_layers=LAYERS, hidden_size=8, num_attention_heads=1, num_moe_experts=EXPERTS,
                             moe_router_topk=TOP_K, pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32)


def _chunk(pp: int = 1, pp_rank: int = 0) -> torch.nn.Module:
    """One pipeline stage's routers as Megatron numbers them: ``TransformerLayer`` adds its stage's
    ``get_transformer_layer_offset`` to the local 1-based layer number and hands it to the router."""
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    config = _config(pp)
    offset = get_transformer_layer_offset(config, pp_rank=pp_rank)
    groups = SimpleNamespace(tp=None, cp=None, tp_cp=None, tp_dp_cp=None)  # the router only keeps them
    chunk = torch.nn.Module()
    chunk.routers = torch.nn.ModuleList(TopKRouter(config, groups) for _ in range(LAYERS // pp))
    for local, router in enumerate(chunk.routers):
        router.set_layer_number(offset + local + 1)
    return chunk


def _micro_batches(batch, *, packed: bool):
    """DP rank 1 of 2's micro-batches: global rows 4..7 (not the rank's first rows), two micro-batches
    either way. Lengths round up to 8: padding follows the shorter rows, and both micro-batches have
    one length, so routing handed to the wrong one is silent (no shape error) unless checked."""
    spec = AlgoConfig(name="grpo").resolve(max_completion_tokens=8)
    settings = StepSettings(spec=spec, micro_batch_size=2, temperature=1.0, pad_to_multiple=8,
                            micro_batch_tokens=16 if packed else 0, moe=True)
    dims = ParallelDims(world=2, tp=1, pp=1, dp=2, vpp=None, rank=1, tp_rank=0, pp_rank=0, dp_rank=1)
    _, mbs = rank_micro_batches(batch, settings, dims)
    assert len(mbs) == 2 and all((mb.cu_seqlens is not None) == packed for mb in mbs)
    return mbs


def _replayed(watch: RouterWatch, chunk, mb) -> dict[int, list[set[int]]]:
    """{global layer: the experts each flattened token slot was routed to} of one micro-batch."""
    rows, seq = mb.input_ids.shape
    out = {}
    with watch.micro_batch(chunk, mb.moe):
        for router in chunk.routers:
            logits = torch.randn(seq, rows, EXPERTS)  # [s, b, E] as the MoE layer's gate makes them
            _, routing_map = router.routing(logits)
            out[router.layer_number - 1] = [set(torch.nonzero(hit).flatten().tolist()) for hit in routing_map]
    return out


def _expected(groups, mb, layer: int) -> list[set[int]]:
    """The captured experts of the token at each flattened slot, read from the micro-batch's input ids."""
    ids = mb.input_ids.T.reshape(-1).tolist()  # sequence-major, as Megatron's MoE layer flattens [s, b]
    out = []
    for token in ids:
        if token == 0:
            out.append(FILLER)
            continue
        row, pos = divmod(token - 1, 100)
        routed = groups[row].completions[0].routed_experts
        out.append(set(routed[pos, layer].tolist()) if pos < len(routed) else FILLER)
    return out


def _check(groups, watch, chunk, mbs) -> None:
    """Every token slot of every micro-batch and layer routed to its captured experts (all counted
    before the assertion, so a failure says how much of the routing is off)."""
    wrong, slots, where = 0, 0, []
    for mb in mbs:
        for layer, got in _replayed(watch, chunk, mb).items():
            want = _expected(groups, mb, layer)
            assert len(got) == len(want), (layer, mb.rows.tolist(), len(got), len(want))
            bad = sum(g != w for g, w in zip(got, want))
            wrong, slots = wrong + bad, slots + len(want)
            where += [(layer, mb.rows.tolist())] if bad else []
    assert wrong == 0, f"{wrong} of {slots} token slots routed to other experts than captured; (layer, rows): {where}"


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_moe_replay_routes_every_fed_token_to_its_captured_experts(packed):
    torch.manual_seed(0)
    groups = _groups()
    batch = collate(groups, pad_id=0)
    mbs = _micro_batches(batch, packed=packed)
    chunk = _chunk()
    _check(groups, RouterWatch([chunk], replay=True, layers=LAYERS), chunk, mbs)


def test_moe_replay_on_a_later_pipeline_stage_uses_the_global_layer_index():
    """PP=2: stage 1 holds layers 2 and 3; its routers must replay the capture's layers 2 and 3
    (the engine's routing is indexed by global layer), not 0 and 1."""
    torch.manual_seed(0)
    groups = _groups()
    batch = collate(groups, pad_id=0)
    mbs = _micro_batches(batch, packed=False)
    stage = _chunk(pp=2, pp_rank=1)
    assert [r.layer_number - 1 for r in stage.routers] == [2, 3]  # Megatron's own stage offset
    _check(groups, RouterWatch([stage], replay=True, layers=LAYERS), stage, mbs)
