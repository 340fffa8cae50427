"""The per-step stages the driver calls once each: rollout (+ reward), collate, metrics.

    dataset --next_batch--> prompts --rollout.generate--> completions --score (rank 0, broadcast)--> groups
    groups --(DAPO: drop all-equal groups, refill, bounded tries)--> kept groups
    kept groups --collate--> TrainBatch (padded prompt+completion rows, every rank the whole batch)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatron_gtpo import algo
from megatron_gtpo.parallel.control import broadcast_object
from megatron_gtpo.types import ScoredGroup, TrainBatch


@dataclass(kw_only=True)
class RolloutResult:
    """Groups that go into one training step, with what it took to get them."""

    groups: list[ScoredGroup]
    """Kept groups (DAPO's dynamic sampling may have dropped and refilled)."""
    tries: int = 1
    """Rollout batches generated for this step."""
    dropped_groups: int = 0
    """Groups dropped by dynamic sampling (all-equal accuracy/reward)."""
    reward_stats: dict[str, float] = field(default_factory=dict)
    """Scoring counters: timeouts, errors, overlong punishments, seconds."""
    rollout_s: float = 0.0
    """Wall time spent generating."""
    reward_s: float = 0.0
    """Wall time spent scoring."""


def collect_groups(rollout, dataset, scorer, *, prompts_per_step: int, sampling: dict, dynamic_sampling: bool,
                   metric: str, max_tries: int, rank: int, seed: int, group_multiple: int = 1) -> RolloutResult:
    """Generates ``rollout.n`` completions for each of ``prompts_per_step`` prompts and scores them.

    Every rank draws the same prompts (identical dataset cursors) and gets the same completions
    (``RolloutGroup`` contract); only rank 0 scores, and broadcasts the groups. With dynamic
    sampling, groups whose ``metric`` ("accuracy" or "reward") is equal across the group are dropped
    and new prompts are drawn until the batch is full or ``max_tries`` batches were generated;
    the batch is then trimmed to ``prompts_per_step`` groups (or trains on fewer, counted).
    ``seed`` (derived from the step by the caller) makes a resumed step sample what the
    uninterrupted run sampled. A short batch is cut to a multiple of ``group_multiple`` groups so
    that its rows still split evenly over DP ranks and micro-batches (possibly to nothing).
    """
    import time

    kept: list[ScoredGroup] = []
    result = RolloutResult(groups=kept, tries=0)
    while len(kept) < prompts_per_step and result.tries < max_tries:
        result.tries += 1
        prompts = dataset.next_batch(prompts_per_step - len(kept) if dynamic_sampling else prompts_per_step)
        start = time.perf_counter()
        completions = rollout.generate(prompts, **sampling, seed=seed + result.tries)
        result.rollout_s += time.perf_counter() - start
        start = time.perf_counter()
        scored = _score_on_rank0(prompts, completions, scorer, rank=rank)
        result.reward_s += time.perf_counter() - start
        for name, value in scored.stats.metrics(prefix="").items():
            result.reward_stats[name] = result.reward_stats.get(name, 0.0) + value
        groups = [g for g in scored.groups if g.completions]
        if dynamic_sampling:
            keep = _dynamic_keep(groups, metric)
            result.dropped_groups += len(groups) - len(keep)
            groups = keep
        kept.extend(groups)
        if not dynamic_sampling:
            break
    usable = min(len(kept), prompts_per_step) // group_multiple * group_multiple
    result.dropped_groups += min(len(kept), prompts_per_step) - usable
    result.groups = kept[:usable]
    return result


def _score_on_rank0(prompts, completions, scorer, *, rank: int):
    from megatron_gtpo.reward import score_groups

    scored = score_groups(prompts, completions, scorer=scorer) if rank == 0 else None
    return broadcast_object(scored, src=0)


def _dynamic_keep(groups: list[ScoredGroup], metric: str) -> list[ScoredGroup]:
    """DAPO's filter (spec 4.2): keep groups whose accuracy (or reward) is not all equal."""
    if not groups:
        return []
    values = [torch.tensor([float(c) for c in g.correct] if metric == "accuracy" else g.rewards) for g in groups]
    group_ids = torch.cat([torch.full((len(v),), i) for i, v in enumerate(values)])
    keep_rows = algo.dapo_group_filter(torch.cat(values), group_ids)
    return [g for i, g in enumerate(groups) if bool(keep_rows[group_ids == i].any())]


def collate(groups: list[ScoredGroup], *, pad_id: int, std_scale: bool, adv_eps: float) -> TrainBatch:
    """Pads every prompt + completion row to the longest one (right padding) into a TrainBatch.

    ``loss_mask`` covers the completion tokens (EOS included, as TRL and the GTPO code);
    ``sampler_logprobs`` sits on the same positions. ``advantages`` are the unshaped group
    advantages (for logging; the loss recomputes them from ``rewards`` in algo.prepare_batch).
    """
    rows = [(gi, g.prompt.token_ids, c, r) for gi, g in enumerate(groups) for c, r in zip(g.completions, g.rewards)]
    width = max(len(p) + len(c.token_ids) for _, p, c, _ in rows)
    num = len(rows)
    input_ids = torch.full((num, width), pad_id, dtype=torch.long)
    loss_mask = torch.zeros((num, width), dtype=torch.float32)
    sampler = torch.zeros((num, width), dtype=torch.float32)
    start = torch.zeros(num, dtype=torch.long)
    for b, (_, prompt, comp, _) in enumerate(rows):
        p, c = len(prompt), len(comp.token_ids)
        input_ids[b, :p] = torch.tensor(prompt, dtype=torch.long)
        if c:
            input_ids[b, p:p + c] = torch.tensor(comp.token_ids, dtype=torch.long)
            loss_mask[b, p:p + c] = 1.0
            sampler[b, p:p + c] = torch.tensor(comp.logprobs, dtype=torch.float32)
        start[b] = p
    group_ids = torch.tensor([gi for gi, *_ in rows], dtype=torch.long)
    rewards = torch.tensor([r for *_, r in rows], dtype=torch.float32)
    advantages = algo.group_advantages(rewards, group_ids, std_scale=std_scale, eps=adv_eps)
    return TrainBatch(input_ids=input_ids, loss_mask=loss_mask,
                      position_ids=torch.arange(width).expand(num, width).clone(), group_ids=group_ids,
                      rewards=rewards, advantages=advantages, sampler_logprobs=sampler, pad_id=pad_id,
                      completion_start=start)


def rollout_metrics(result: RolloutResult) -> dict[str, float]:
    """reward/*, completion/* and dynamic-sampling counters of one step."""
    counters = {"rollout/groups": float(len(result.groups)), "rollout/tries": float(result.tries),
                "rollout/dropped_groups": float(result.dropped_groups)}
    if not result.groups:
        return counters
    rewards = torch.tensor([r for g in result.groups for r in g.rewards], dtype=torch.float64)
    correct = torch.tensor([float(c) for g in result.groups for c in g.correct], dtype=torch.float64)
    lengths = torch.tensor([len(c.token_ids) for g in result.groups for c in g.completions], dtype=torch.float64)
    truncated = torch.tensor([float(c.truncated) for g in result.groups for c in g.completions], dtype=torch.float64)
    out = {"reward/mean": rewards.mean().item(), "reward/std": rewards.std().item() if len(rewards) > 1 else 0.0,
           "reward/accuracy": correct.mean().item() if len(correct) else float("nan"),
           "completion/length_mean": lengths.mean().item(), "completion/length_max": lengths.max().item(),
           "completion/truncated_frac": truncated.mean().item(), **counters}
    out.update({f"reward/{k}": v for k, v in result.reward_stats.items() if k != "seconds"})
    return out


def sample_table(groups: list[ScoredGroup], *, limit: int) -> list[dict]:
    """Rows of prompt / completion / reward / correct for the sample-completions artifact."""
    rows = []
    for g in groups:
        for c, r, ok in zip(g.completions, g.rewards, g.correct or [None] * len(g.rewards)):
            rows.append({"prompt": g.prompt.text[-500:], "completion": c.text, "reward": r, "correct": ok,
                         "tokens": len(c.token_ids), "finish_reason": c.finish_reason})
            if len(rows) >= limit:
                return rows
    return rows
