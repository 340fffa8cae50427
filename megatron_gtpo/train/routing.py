"""Mixture-of-experts policies in the train step: rollout routing replay and the router metrics.

    Completion.routed_experts --batch_routing--> Batch.routed_experts [B, S, L, k] (sequence view)
    Batch + MicroBatch --tokens_of--> MoeTokens (Megatron's flattened token order, on the device)
    model_input.forward --forward_context--> RouterWatch, per MoE layer of the chunk:
        replay: the router's top-k := the engine's experts for every token it fed (Megatron-Core
                0.16.1's RouterReplay, REPLAY_FORWARD: the router's scores are gathered at those
                experts, so the gate's probabilities, and through them the router, get gradients)
        watch:  expert load, dropped assignments, router entropy, agreement with the engine
    RouterWatch.metrics(dp, pp) --> moe/* (summed over micro-batches, DP ranks and pipeline stages)

Megatron's MoE layer flattens its ``[s, b, h]`` input sequence-major (token ``s * b + row``), so a
padded micro-batch's routing is transposed to that order; a packed one is one row. With sequence
parallelism (a mixture at TP > 1 on GPU) a TP rank's router sees its ``[S/tp, b, h]`` slice of the
sequence: in that order the contiguous tokens ``rank * T/tp .. (rank + 1) * T/tp`` (``MoeTokens.share``),
and the statistics are summed over the TP group as well. Positions the
engine never fed (each completion's last sampled token, padding) have no engine routing: replay
fills them with experts ``0 .. k-1`` (those positions feed no loss: the causal mask keeps them from
every scored position) and the agreement skips them.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from megatron_gtpo.parallel.collectives import comm_device
from megatron_gtpo.train.model import unwrap

Tensor = torch.Tensor


def batch_routing(completions) -> Tensor | None:
    """``[B, S, L, k]`` int16 of the completions' routed experts in the sequence view (prompt then
    completion, left-aligned, -1 where the engine fed no token); None when none carries routing."""
    routed = [c.routed_experts for c in completions]
    if all(r is None for r in routed):
        return None
    if any(r is None for r in routed):
        raise ValueError("some completions carry routed experts and some do not: one engine without routing?")
    width = max(len(c.prompt_token_ids) + len(c.token_ids) for c in completions)
    layers, top_k = routed[0].shape[1:]
    out = torch.full((len(routed), width, layers, top_k), -1, dtype=torch.int16)
    for row, rows in enumerate(routed):
        out[row, :len(rows)] = torch.from_numpy(rows)
    return out


@dataclass(frozen=True, kw_only=True)
class MoeTokens:
    """What the MoE layers need to know about one micro-batch's tokens, in Megatron's token order."""

    engine: Tensor | None  # [T, L, k] long, -1 where the engine fed no such token; None: no engine routing
    """The engine's experts of every token, per MoE layer (global layer index)."""
    real: Tensor  # [T] bool
    """Tokens of a sequence (not padding)."""
    completion: Tensor  # [T] bool
    """Completion tokens the engine fed (the agreement's tokens)."""


    def share(self, rank: int, size: int) -> MoeTokens:
        """The tokens TP rank ``rank`` of ``size`` routes under sequence parallelism (module docstring)."""
        if size == 1:
            return self
        count = self.real.shape[0]
        if count % size:
            raise ValueError(f"sequence parallelism splits {count} tokens over {size} TP ranks: not a multiple")
        part = slice(rank * count // size, (rank + 1) * count // size)
        return MoeTokens(engine=None if self.engine is None else self.engine[part], real=self.real[part],
                         completion=self.completion[part])


def tokens_of(routed: Tensor | None, mb, *, prompt_lengths: Tensor, lengths: Tensor, device) -> MoeTokens:
    """The MoeTokens of micro-batch ``mb`` of a Batch with sequence-view routing ``routed`` (or None)
    whose rows have ``prompt_lengths`` and completion ``lengths`` ([B] long)."""
    rows, seq = mb.rows.cpu(), mb.input_ids.shape[1]
    pos = torch.arange(seq)
    if mb.cu_seqlens is None:  # [mb, S] -> sequence-major [S * mb]
        ends, starts = (prompt_lengths + lengths)[rows], prompt_lengths[rows]
        real = (pos[None, :] < ends[:, None]).T.reshape(-1)
        completion = ((pos[None, :] >= starts[:, None]) & (pos[None, :] < ends[:, None] - 1)).T.reshape(-1)
        engine = None if routed is None else _pad_to(routed[rows], seq).transpose(0, 1).reshape(-1, *routed.shape[2:])
    else:  # one packed row of whole sequences
        real, completion, parts = torch.zeros(seq, dtype=torch.bool), torch.zeros(seq, dtype=torch.bool), []
        for offset, row in zip(mb.cu_seqlens[:-1].tolist(), rows.tolist()):
            end = offset + int(prompt_lengths[row] + lengths[row])
            real[offset:end] = True
            completion[offset + int(prompt_lengths[row]):end - 1] = True
            if routed is not None:
                parts.append(routed[row, :end - offset])
        engine = None if routed is None else _pad_to(torch.cat(parts)[None], seq)[0]
    engine = None if engine is None else engine.to(device=device, dtype=torch.long)
    return MoeTokens(engine=engine, real=real.to(device), completion=completion.to(device))


def _pad_to(routed: Tensor, seq: int) -> Tensor:
    """``[n, >= or < seq, L, k]`` -> ``[n, seq, L, k]`` (cut, or padded with -1)."""
    if routed.shape[1] >= seq:
        return routed[:, :seq]
    pad = routed.new_full((routed.shape[0], seq - routed.shape[1], *routed.shape[2:]), -1)
    return torch.cat([routed, pad], dim=1)


class RouterWatch:
    """The routers of one model's chunks: replays the engine's routing (``replay``) and sums the
    router statistics of the micro-batches it is told to ``collect``. Attach it with
    :func:`attach`; :func:`forward_context` (called by ``model_input.forward``) drives it."""

    def __init__(self, chunks, *, replay: bool, layers: int):
        from megatron.core.transformer.moe.router import TopKRouter

        self.replay, self.layers = replay, layers
        self.routers: dict[int, list] = {}  # id(chunk) -> [(global layer, router)]
        self._sp_group = None
        """The TP group when sequence parallelism gives each TP rank's router its slice of the tokens."""
        for chunk in chunks:
            model = unwrap(chunk)
            found = [(m.layer_number - 1, m) for m in model.modules() if isinstance(m, TopKRouter)]
            self.routers[id(model)] = found
            for layer, router in found:
                self._wrap(router, layer)
                if router.config.sequence_parallel and router.tp_group.size() > 1:
                    self._sp_group = router.tp_group
        self.collect = False
        """Sum statistics of the micro-batches run now (the step sets it for the first update)."""
        self._tokens: MoeTokens | None = None
        self._sums: Tensor | None = None  # [L, E + 5] float64: counts per expert, real, entropy, dropped, agree, compared

    def _wrap(self, router, layer: int) -> None:
        if self.replay:
            router.router_replay = _replay_slot()
        routing = router.routing

        def watched(logits, padding_mask=None):
            probs, routing_map = routing(logits, padding_mask=padding_mask)
            if self.collect and self._tokens is not None:
                self._add(layer, logits.detach(), routing_map.detach(), router.topk)
            return probs, routing_map

        router.routing = watched

    @contextlib.contextmanager
    def micro_batch(self, model, tokens: MoeTokens):
        """While one chunk's forward of one micro-batch runs: its routers replay ``tokens.engine``
        (replay) and the statistics see ``tokens``."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        if self._sp_group is not None:
            tokens = tokens.share(self._sp_group.rank(), self._sp_group.size())
        for layer, router in self.routers.get(id(model), []) if self.replay else []:
            if tokens.engine is None:
                raise RuntimeError("routing replay: this micro-batch carries no engine routing")
            chosen = tokens.engine[:, layer]
            filler = torch.arange(chosen.shape[1], device=chosen.device).expand_as(chosen)
            router.router_replay.clear_indices()
            router.router_replay.set_target_indices(torch.where(chosen >= 0, chosen, filler))
            router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        self._tokens = tokens
        try:
            yield
        finally:
            self._tokens = None

    @torch.no_grad()
    def _add(self, layer: int, logits: Tensor, routing_map: Tensor, top_k: int) -> None:
        tokens = self._tokens
        logits = logits.reshape(-1, logits.shape[-1]).float()
        experts = logits.shape[-1]
        if self._sums is None:
            self._sums = torch.zeros((self.layers, experts + 5), dtype=torch.float64, device=logits.device)
        real = tokens.real.to(logits.device)
        chosen = routing_map.reshape(-1, experts) & real[:, None]
        logp = torch.log_softmax(logits, dim=-1)
        entropy = -(logp.exp() * logp).sum(-1)
        row = self._sums[layer]
        row[:experts] += chosen.sum(0).double()
        row[experts] += real.sum().double()
        row[experts + 1] += torch.where(real, entropy, 0.0).sum().double()
        row[experts + 2] += (real.sum() * top_k - chosen.sum()).double()
        if tokens.engine is not None:
            engine = tokens.engine[:, layer]
            known = tokens.completion & (engine >= 0).all(-1)
            engine_map = torch.zeros_like(chosen).scatter_(1, engine.clamp(min=0), True)
            row[experts + 3] += ((engine_map == chosen).all(-1) & known).sum().double()
            row[experts + 4] += known.sum().double()

    def metrics(self, *, groups) -> dict[str, float]:
        """The ``moe/*`` metrics of what was collected, summed over ``groups`` (the DP and PP groups:
        each stage saw its own layers, each DP rank its own tokens; TP ranks route the same tokens,
        except under sequence parallelism: then over the TP group too), then cleared. Called on
        every rank at the same point (collectives)."""
        import torch.distributed as dist

        sums = self._sums
        shape = (self.layers, self._experts_seen())
        sums = torch.zeros(shape, dtype=torch.float64, device=comm_device()) if sums is None else sums
        for group in (*groups, self._sp_group):
            if group is not None and dist.get_world_size(group) > 1:
                dist.all_reduce(sums, group=group)
        self._sums = None
        return moe_metrics(sums.cpu())

    def _experts_seen(self) -> int:
        first = next((r for found in self.routers.values() for _, r in found), None)
        return (first.num_experts if first is not None else 0) + 5


def moe_metrics(sums: Tensor) -> dict[str, float]:
    """``moe/*`` from per-layer sums ``[L, E + 5]`` (see RouterWatch); agreement only where the engine's
    routing was known."""
    experts = sums.shape[1] - 5
    counts, real = sums[:, :experts], sums[:, experts]
    load = counts.max(1).values / (counts.sum(1) / experts).clamp(min=1e-12)
    out = {f"moe/expert_load/L{layer}": float(value) for layer, value in enumerate(load)}
    total = float(real.sum())
    top_k = float(counts.sum() + sums[:, experts + 2].sum()) / max(total, 1.0)
    out.update({"moe/expert_load_max": float(load.max()), "moe/expert_load_mean": float(load.mean()),
                "moe/router_entropy": float(sums[:, experts + 1].sum()) / max(total, 1.0),
                "moe/dropped_frac": float(sums[:, experts + 2].sum()) / max(total * top_k, 1.0)})
    compared = float(sums[:, experts + 4].sum())
    if compared:
        out["moe/routing_agreement"] = float(sums[:, experts + 3].sum()) / compared
    return out


def _replay_slot():
    """A RouterReplay of this router alone: Megatron registers every instance in a global list
    (for its set_replay_data by instantiation order); the watch addresses routers by layer instead,
    so the instance leaves that list (two models in one process would otherwise share it)."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    slot = RouterReplay()
    RouterReplay.global_router_replay_instances.remove(slot)
    return slot


def attach(chunks, *, replay: bool, layers: int) -> RouterWatch:
    """A RouterWatch on ``chunks`` (a mixture-of-experts policy), reachable by :func:`forward_context`."""
    watch = RouterWatch(chunks, replay=replay, layers=layers)
    for chunk in chunks:
        unwrap(chunk).moe_watch = watch
    return watch


def watch_of(chunks) -> RouterWatch | None:
    """The RouterWatch :func:`attach` put on ``chunks``, or None (a dense policy)."""
    return getattr(unwrap(chunks[0]), "moe_watch", None)


def forward_context(model, mb):
    """The context ``model_input.forward`` runs one chunk's forward of ``mb`` in: the chunk's watch
    with the micro-batch's MoE tokens, or nothing (dense model, no watch, no MoE tokens)."""
    watch, tokens = getattr(unwrap(model), "moe_watch", None), getattr(mb, "moe", None)
    if watch is None or tokens is None:
        return contextlib.nullcontext()
    return watch.micro_batch(unwrap(model), tokens)
