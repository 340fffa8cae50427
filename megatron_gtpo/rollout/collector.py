"""The rollout collector: one step's prompts -> completions -> rewards -> the groups it trains on.

    dataset.next_batch --> prompts --RolloutGroup.generate--> completions (the same on every rank)
    completions --score (rank 0; only rewards and correctness are broadcast)--> ScoredGroups
    ScoredGroups --(DAPO: drop all-equal groups, refill, bounded tries)--> RolloutBatch

Every rank draws the same prompts (identical dataset cursors) and holds the same completions (the
``RolloutGroup`` contract), so rank 0 scores and sends only a float and a flag per completion.
The sampling seed of each try is derived from the step, so a resumed step samples exactly what the
uninterrupted run sampled.

One-step-off rollouts (``OffPolicy.staleness`` = 1, ``rollout.staleness``): ``collect(k)`` also
submits step k+1's first rollout batch, before step k trains, to the engines that serve the weights
step k starts from. A pool of rollout servers generates it while the trainer trains (the weight push
after step k waits for it: ``rollout.pool.RolloutPool.drain``); engines inside the trainer processes
generate it right away, one version behind, with nothing to overlap. ``collect(k + 1)`` then scores
it. Prompts and seeds per step are those of ``staleness: 0``; only the weights differ. Every
completion's weight version is checked (``rollout/staleness.py``). A checkpoint saves the prompt
cursor from before the batch in flight (:class:`PromptCursor`), so a resume draws the same prompts
again and regenerates that batch with the restored weights (staleness 0 for that one step).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

from megatron_gtpo import algo
from megatron_gtpo.parallel.control import broadcast_data
from megatron_gtpo.reward.failures import RewardFunctionFailing
from megatron_gtpo.reward.pool import RewardFunctionCrashed
from megatron_gtpo.reward.score import RewardScorer, group_indices, score_groups
from megatron_gtpo.rollout.config import Sampling
from megatron_gtpo.rollout.group import Generation, RolloutGroup
from megatron_gtpo.rollout.staleness import PolicyVersions
from megatron_gtpo.types import Completion, Prompt, RolloutBatch, ScoredGroup


@dataclass(frozen=True, kw_only=True)
class DynamicSampling:
    """DAPO's dynamic sampling (spec 4.2): keep groups whose metric is not all equal, refill."""

    metric: str
    """accuracy or reward."""
    max_tries: int
    """Most rollout batches generated for one step."""


@dataclass(frozen=True, kw_only=True)
class OffPolicy:
    """How far rollouts run ahead of training (``rollout.staleness``; module docstring)."""

    staleness: int = 0
    """0: every step generates its batch with the weights it trains from. 1: step k+1's first rollout
    batch is submitted during ``collect(k)``, before step k trains (one-step-off)."""
    last_step: int | None = None
    """The run's last step: nothing is submitted for a later one (None: no end)."""


@dataclass(kw_only=True)
class _Submitted:
    """One rollout batch submitted to the engines and not yet scored."""

    step: int
    prompts: list[Prompt]
    generation: Generation
    version: int
    """Weight version the engines served when it was submitted (its completions' tag)."""
    cursor: dict | None = None
    """The prompt cursor before its prompts were drawn (saved by a checkpoint while it is in flight)."""


class RolloutCollector:
    """Produces one step's scored groups on every rank (``collect``) and held-out accuracy (``evaluate``)."""

    def __init__(self, engines: RolloutGroup, dataset, scorer: RewardScorer | None, *, sampling: Sampling,
                 seed: int, dynamic: DynamicSampling | None = None, group_multiple: int = 1,
                 off_policy: OffPolicy = OffPolicy()):
        self.engines, self.dataset, self.scorer = engines, dataset, scorer
        self.sampling, self.dynamic, self.group_multiple = sampling, dynamic, group_multiple
        self.off_policy = off_policy
        self.versions = PolicyVersions(bound=off_policy.staleness)
        """The weight versions pushed into the engines (``pushed``) and the checks of every batch."""
        self.cursor = PromptCursor(self)
        """What a checkpoint saves and restores of the prompt stream (pass it as the Checkpointer's dataset)."""
        self._seed = seed
        self._ahead: _Submitted | None = None

    def pushed(self, version: int) -> None:
        """The engines serve weight ``version`` now (call after every weight push, on every rank)."""
        self.versions.pushed(version)

    def collect(self, step: int, *, prompts_per_step: int) -> RolloutBatch:
        """The groups of training step ``step`` (1-based): ``prompts_per_step`` of them, or fewer
        under dynamic sampling when too few survive within ``max_tries`` (counted), cut to a multiple
        of ``group_multiple`` so that its rows split evenly over DP ranks and micro-batches. One-step-
        off: the first batch is the one submitted by the previous call, and step ``step + 1``'s is
        submitted before returning (``rollout_s`` counts the generate calls made in this call).
        Raises StalenessError when a completion's version is wrong or too old (``rollout/staleness.py``)."""
        result = RolloutBatch(groups=[], tries=0)
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead.step != step:
            raise RuntimeError(f"collect({step}) called while the rollout batch of step {ahead.step} is in flight")
        self._gather(step, ahead or self._submit(step, prompts_per_step, 1, result), prompts_per_step, result)
        result.staleness = self.versions.check_bound((c for g in result.groups for c in g.completions), step=step)
        last = self.off_policy.last_step
        if self.off_policy.staleness and (last is None or step < last):
            cursor = self.dataset.state_dict()
            self._ahead = self._submit(step + 1, prompts_per_step, 1, result)
            self._ahead.cursor = cursor
        return result

    def _gather(self, step: int, first: _Submitted, prompts_per_step: int, result: RolloutBatch) -> None:
        """Scores ``first`` and, under dynamic sampling, refills (bounded tries) into ``result``."""
        kept = result.groups
        max_tries = self.dynamic.max_tries if self.dynamic else 1
        submitted = first
        while True:
            result.tries += 1
            kept.extend(self._scored(step, submitted, result))
            if len(kept) >= prompts_per_step or result.tries >= max_tries:
                break
            submitted = self._submit(step, prompts_per_step - len(kept), result.tries + 1, result)
        usable = min(len(kept), prompts_per_step) // self.group_multiple * self.group_multiple
        result.dropped_groups += min(len(kept), prompts_per_step) - usable
        result.groups = kept[:usable]

    def _submit(self, step: int, num_prompts: int, attempt: int, result: RolloutBatch) -> _Submitted:
        """Draws the next prompts and submits them; the seed is derived from the step and try."""
        prompts = self.dataset.next_batch(num_prompts)
        seed = self._seed * 1_000_003 + (step - 1) * 1_009 + attempt
        start = time.perf_counter()
        generation = self.engines.submit(prompts, self.sampling, seed=seed)
        result.rollout_s += time.perf_counter() - start
        return _Submitted(step=step, prompts=prompts, generation=generation, version=self.versions.current)

    def _scored(self, step: int, submitted: _Submitted, result: RolloutBatch) -> list[ScoredGroup]:
        """The completions of one submitted batch (tag-checked), scored; dynamic sampling's keep."""
        start = time.perf_counter()
        completions = submitted.generation.wait()
        result.rollout_s += time.perf_counter() - start
        self.versions.check_tags(completions, expected=submitted.version, step=step)
        start = time.perf_counter()
        groups, stats = self._score(submitted.prompts, completions)
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
        return groups

    def evaluate(self, prompts: list[Prompt], *, seed: int) -> dict[str, float]:
        """Greedy accuracy and mean reward on held-out ``prompts`` (one completion each)."""
        greedy = dataclasses.replace(self.sampling, n=1, temperature=0.0, top_p=1.0)
        completions = self.engines.generate(prompts, greedy, seed=seed)
        groups, _ = self._score(prompts, completions)
        correct = [c for g in groups for c in g.correct]
        rewards = [r for g in groups for r in g.rewards]
        return {"eval/accuracy": sum(correct) / max(len(correct), 1),
                "eval/reward_mean": sum(rewards) / max(len(rewards), 1)}

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
        payload = broadcast_data(payload, src=0, records=(RewardFunctionCrashed, RewardFunctionFailing))
        if isinstance(payload, Exception):
            raise payload
        rewards, correct, stats = payload
        groups = [ScoredGroup(prompt=prompts[p], completions=[completions[i] for i in idx], rewards=rewards[p],
                              correct=correct[p])
                  for p, idx in enumerate(group_indices(len(prompts), completions))]
        return groups, stats


class PromptCursor:
    """The prompt stream as a checkpoint sees it (``state_dict`` / ``load_state_dict``). A rollout
    batch in flight is not saved: while there is one, the saved cursor is the one from before its
    prompts were drawn, so a resumed run draws them again and regenerates the batch."""

    def __init__(self, collector: RolloutCollector):
        self._collector = collector

    def state_dict(self) -> dict:
        ahead = self._collector._ahead
        return dict(ahead.cursor) if ahead is not None else self._collector.dataset.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self._collector._ahead = None  # drawn from the cursor being replaced
        self._collector.dataset.load_state_dict(state)


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
    versions = [c.weight_version for g in batch.groups for c in g.completions]
    out.update({"rollout/weight_version_min": float(min(versions)), "rollout/weight_version_max": float(max(versions)),
                "rollout/staleness_max": float(batch.staleness)})
    out.update({f"reward/{k}": v for k, v in batch.reward_stats.items() if k != "seconds"})
    return out
