"""The rollout collector: one step's prompts -> completions -> rewards -> the groups it trains on.

    dataset.next_batch --> prompts --RolloutGroup.generate--> completions (the same on every rank)
    completions --score (rank 0; only rewards and correctness are broadcast)--> ScoredGroups
    ScoredGroups --(DAPO: drop all-equal groups, refill, bounded tries)--> RolloutBatch

Every rank draws the same prompts (identical dataset cursors) and holds the same completions (the
``RolloutGroup`` contract), so rank 0 scores and sends only a float and a flag per completion.
The sampling seed of each try is derived from the step, so a resumed step samples exactly what the
uninterrupted run sampled.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from megatron_gtpo import algo
from megatron_gtpo.parallel.control import broadcast_object
from megatron_gtpo.reward.failures import RewardFunctionFailing
from megatron_gtpo.reward.pool import RewardFunctionCrashed
from megatron_gtpo.reward.score import RewardScorer, group_indices, score_groups
from megatron_gtpo.rollout.group import RolloutGroup
from megatron_gtpo.types import Completion, Prompt, RolloutBatch, ScoredGroup


@dataclass(frozen=True, kw_only=True)
class Sampling:
    """How each prompt's completions are sampled (``RolloutConfig.sampling()``)."""

    n: int
    """Completions per prompt (G)."""
    temperature: float
    """Sampling temperature."""
    top_p: float
    """Nucleus mass."""
    max_tokens: int
    """Most tokens per completion."""
    stop: list[str] | None = None
    """Extra stop strings."""


@dataclass(frozen=True, kw_only=True)
class DynamicSampling:
    """DAPO's dynamic sampling (spec 4.2): keep groups whose metric is not all equal, refill."""

    metric: str
    """accuracy or reward."""
    max_tries: int
    """Most rollout batches generated for one step."""


class RolloutCollector:
    """Produces one step's scored groups on every rank (``collect``) and held-out accuracy (``evaluate``)."""

    def __init__(self, engines: RolloutGroup, dataset, scorer: RewardScorer | None, *, sampling: Sampling,
                 seed: int, dynamic: DynamicSampling | None = None, group_multiple: int = 1):
        self.engines, self.dataset, self.scorer = engines, dataset, scorer
        self.sampling, self.dynamic, self.group_multiple = sampling, dynamic, group_multiple
        self._seed = seed

    def collect(self, step: int, *, prompts_per_step: int) -> RolloutBatch:
        """The groups of training step ``step`` (1-based): ``prompts_per_step`` of them, or fewer
        under dynamic sampling when too few survive within ``max_tries`` (counted), cut to a multiple
        of ``group_multiple`` so that its rows split evenly over DP ranks and micro-batches."""
        kept: list[ScoredGroup] = []
        result = RolloutBatch(groups=kept, tries=0)
        max_tries = self.dynamic.max_tries if self.dynamic else 1
        seed = self._seed * 1_000_003 + (step - 1) * 1_009
        while len(kept) < prompts_per_step and result.tries < max_tries:
            result.tries += 1
            prompts = self.dataset.next_batch(prompts_per_step - len(kept) if self.dynamic else prompts_per_step)
            start = time.perf_counter()
            completions = self.engines.generate(prompts, **self._sampling_kwargs(), seed=seed + result.tries)
            result.rollout_s += time.perf_counter() - start
            start = time.perf_counter()
            groups, stats = self._score(prompts, completions)
            result.reward_s += time.perf_counter() - start
            for name, value in stats.items():
                result.reward_stats[name] = result.reward_stats.get(name, 0.0) + value
            if self.scorer is not None:
                result.reward_errors += self.scorer.new_errors()
            groups = [g for g in groups if g.completions]
            if self.dynamic:
                keep = _dynamic_keep(groups, self.dynamic.metric)
                result.dropped_groups += len(groups) - len(keep)
                groups = keep
            kept.extend(groups)
        usable = min(len(kept), prompts_per_step) // self.group_multiple * self.group_multiple
        result.dropped_groups += min(len(kept), prompts_per_step) - usable
        result.groups = kept[:usable]
        return result

    def evaluate(self, prompts: list[Prompt], *, seed: int) -> dict[str, float]:
        """Greedy accuracy and mean reward on held-out ``prompts`` (one completion each)."""
        completions = self.engines.generate(prompts, n=1, temperature=0.0, top_p=1.0,
                                            max_tokens=self.sampling.max_tokens, stop=self.sampling.stop, seed=seed)
        groups, _ = self._score(prompts, completions)
        correct = [c for g in groups for c in g.correct]
        rewards = [r for g in groups for r in g.rewards]
        return {"eval/accuracy": sum(correct) / max(len(correct), 1),
                "eval/reward_mean": sum(rewards) / max(len(rewards), 1)}

    def _sampling_kwargs(self) -> dict:
        s = self.sampling
        return {"n": s.n, "temperature": s.temperature, "top_p": s.top_p, "max_tokens": s.max_tokens, "stop": s.stop}

    def _score(self, prompts: list[Prompt], completions: list[Completion]):
        """Rank 0 scores; every rank builds the same groups from its own completions and the
        broadcast rewards (a float and a flag per completion, plus the scoring counters)."""
        payload = None
        if self.scorer is not None:
            try:
                scored = score_groups(prompts, completions, scorer=self.scorer)
                payload = ([g.rewards for g in scored.groups], [g.correct for g in scored.groups],
                           scored.stats.metrics(prefix=""))
            except (RewardFunctionCrashed, RewardFunctionFailing) as err:
                payload = err  # every rank stops with the reward function's own message
        payload = broadcast_object(payload, src=0)
        if isinstance(payload, Exception):
            raise payload
        rewards, correct, stats = payload
        groups = [ScoredGroup(prompt=prompts[p], completions=[completions[i] for i in idx], rewards=rewards[p],
                              correct=correct[p])
                  for p, idx in enumerate(group_indices(len(prompts), completions))]
        return groups, stats


def _dynamic_keep(groups: list[ScoredGroup], metric: str) -> list[ScoredGroup]:
    """DAPO's filter (spec 4.2): keep groups whose accuracy (or reward) is not all equal."""
    if not groups:
        return []
    values = [torch.tensor([float(c) for c in g.correct] if metric == "accuracy" else g.rewards) for g in groups]
    group_ids = torch.cat([torch.full((len(v),), i) for i, v in enumerate(values)])
    keep_rows = algo.dapo_group_filter(torch.cat(values), group_ids)
    return [g for i, g in enumerate(groups) if bool(keep_rows[group_ids == i].any())]


def rollout_metrics(batch: RolloutBatch) -> dict[str, float]:
    """reward/*, completion/* and rollout/* counters of one step (names: ``megatron_gtpo.metrics``)."""
    counters = {"rollout/groups": float(len(batch.groups)), "rollout/tries": float(batch.tries),
                "rollout/dropped_groups": float(batch.dropped_groups)}
    if not batch.groups:
        return counters
    rewards = torch.tensor([r for g in batch.groups for r in g.rewards], dtype=torch.float64)
    correct = torch.tensor([float(c) for g in batch.groups for c in g.correct], dtype=torch.float64)
    lengths = torch.tensor([len(c.token_ids) for g in batch.groups for c in g.completions], dtype=torch.float64)
    truncated = torch.tensor([float(c.truncated) for g in batch.groups for c in g.completions], dtype=torch.float64)
    out = {"reward/mean": rewards.mean().item(), "reward/std": rewards.std().item() if len(rewards) > 1 else 0.0,
           "reward/accuracy": correct.mean().item() if len(correct) else float("nan"),
           "completion/length_mean": lengths.mean().item(), "completion/length_max": lengths.max().item(),
           "completion/truncated_frac": truncated.mean().item(), **counters}
    out.update({f"reward/{k}": v for k, v in batch.reward_stats.items() if k != "seconds"})
    return out
