"""The rollout collector: one step's prompts -> completions -> rewards -> the groups it trains on.

    dataset.next_batch --> prompts --RolloutGroup.generate--> completions (the same on every rank)
    completions --score (rank 0; only rewards and correctness are broadcast)--> ScoredGroups
    ScoredGroups --(DAPO: drop all-equal groups, refill, bounded tries)--> RolloutBatch

Every rank draws the same prompts (identical dataset cursors) and holds the same completions (the
``RolloutGroup`` contract), so rank 0 scores and sends only a float and a flag per completion.
The sampling seed of each try is derived from the step, so a resumed step samples exactly what the
uninterrupted run sampled.

Off-policy rollouts (``OffPolicy.staleness`` = k, ``rollout.staleness``): ``collect(s)`` keeps the
first rollout batches of steps s+1..s+k submitted (step s+k's is submitted during ``collect(s)``,
after step s's groups are gathered and before step s trains) to the engines that serve the weights
step s starts from. A pool of rollout servers generates them while the trainer trains and pushes
(``rollout.pool.RolloutPool``); engines inside the trainer processes generate them right away, with
nothing to overlap. ``collect(s + j)`` then scores its batch. Prompts and seeds per step are those
of ``staleness: 0`` (a step's first batch is drawn at its turn in the data order, refills after the
batches in flight); only the weights differ. Every token's weight version is checked
(``rollout/staleness.py``).

Nothing lost, nothing repeated (:class:`PromptCursor`): a checkpoint saves the prompt stream's
cursor and, for every batch in flight, its step and the cursor it was drawn from. A resumed run
draws those batches again from their cursors and regenerates them, same seeds, with the restored
weights, in step order, then continues the stream where it stood: every step trains exactly the
prompts the uninterrupted run trains at that step, each prompt once. What the engines had already
generated for the batches in flight is not saved (it is regenerated, fresher).
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
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
    """0: every step generates its batch with the weights it trains from. k: the first rollout
    batches of the next k steps are in flight while a step trains."""
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
    """The prompt cursor its prompts were drawn from (a step's first batch; saved by a checkpoint
    while it is in flight)."""


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
        self._ahead: deque[_Submitted] = deque()
        """Submitted first batches of later steps, in step order."""
        self._pending: deque[dict] = deque()
        """Batches that were in flight at the checkpoint a run resumed from, not submitted again yet:
        ``{"step", "cursor", "prompts"}`` in step order (:class:`PromptCursor`)."""

    def pushed(self, version: int) -> None:
        """The engines serve weight ``version`` now (call after every weight push, on every rank)."""
        self.versions.pushed(version)

    def collect(self, step: int, *, prompts_per_step: int) -> RolloutBatch:
        """The groups of training step ``step`` (1-based): ``prompts_per_step`` of them, or fewer
        under dynamic sampling when too few survive within ``max_tries`` (counted), cut to a multiple
        of ``group_multiple`` so that its rows split evenly over DP ranks and micro-batches. Off-
        policy: the first batch is the one submitted by an earlier call, and the batches of steps up
        to ``step + staleness`` are submitted before returning (``rollout_s`` counts the generate
        calls made in this call). Raises StalenessError when a token's version is wrong or too old
        (``rollout/staleness.py``)."""
        result = RolloutBatch(groups=[], tries=0)
        if self._ahead and self._ahead[0].step != step:
            raise RuntimeError(f"collect({step}) called while the rollout batch of step {self._ahead[0].step} is "
                               "the next in flight")
        first = self._ahead.popleft() if self._ahead else self._submit_first(step, prompts_per_step, result)
        self._gather(step, first, prompts_per_step, result)
        completions = [c for g in result.groups for c in g.completions]
        result.staleness, result.staleness_mean = self.versions.check_bound(completions, step=step)
        self._top_up(step, prompts_per_step, result)
        return result

    def _top_up(self, step: int, prompts_per_step: int, result: RolloutBatch) -> None:
        """Submits the first batches of steps up to ``step + staleness`` (not past the last step)."""
        last = self.off_policy.last_step
        upto = step + self.off_policy.staleness if last is None else min(step + self.off_policy.staleness, last)
        for later in range((self._ahead[-1].step if self._ahead else step) + 1, upto + 1):
            self._ahead.append(self._submit_first(later, prompts_per_step, result))

    def _submit_first(self, step: int, prompts_per_step: int, result: RolloutBatch) -> _Submitted:
        """Step ``step``'s first batch: drawn from the prompt stream, or, for a batch that was in flight
        at the checkpoint this run resumed from, drawn again from its recorded cursor (the stream
        stays where it is)."""
        if self._pending and self._pending[0]["step"] < step:
            raise RuntimeError(f"the batch of step {self._pending[0]['step']} in flight at the checkpoint was "
                               f"never trained; collect({step}) comes after it")
        if not (self._pending and self._pending[0]["step"] == step):
            cursor = self.dataset.state_dict()
            return dataclasses.replace(self._submit(step, prompts_per_step, 1, result), cursor=cursor)
        record, stream = self._pending.popleft(), self.dataset.state_dict()
        self.dataset.load_state_dict(record["cursor"])
        try:
            submitted = self._submit(step, int(record["prompts"]), 1, result)
        finally:
            self.dataset.load_state_dict(stream)
        return dataclasses.replace(submitted, cursor=record["cursor"])

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
    """The prompt stream as a checkpoint sees it (``state_dict`` / ``load_state_dict``). With no
    batch in flight it is the dataset's cursor; with some, ``{"stream": cursor, "in_flight":
    [{"step", "cursor", "prompts"}, ...]}``: a resumed run draws those batches again from their
    cursors (module docstring). A checkpoint of a run without batches in flight (or of an older
    version, which saved the cursor before its one batch in flight) loads as a plain cursor."""

    def __init__(self, collector: RolloutCollector):
        self._collector = collector

    def state_dict(self) -> dict:
        collector = self._collector
        in_flight = [{"step": a.step, "cursor": dict(a.cursor), "prompts": len(a.prompts)} for a in collector._ahead]
        in_flight += [dict(record) for record in collector._pending]
        stream = collector.dataset.state_dict()
        return {"stream": stream, "in_flight": in_flight} if in_flight else stream

    def load_state_dict(self, state: dict) -> None:
        collector = self._collector
        collector._ahead.clear()  # drawn from the cursor being replaced
        records = state.get("in_flight") if "stream" in state else None
        for record in records or ():
            if not isinstance(record, dict) or set(record) != {"step", "cursor", "prompts"}:
                raise ValueError(f"checkpoint's prompt cursor: malformed in-flight batch record {record!r:.200}")
            collector.dataset.load_state_dict(record["cursor"])  # refused here, not at the first step
        collector._pending = deque(sorted(records or (), key=lambda r: r["step"]))
        collector.dataset.load_state_dict(state["stream"] if records is not None else state)


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
    counts = [c.version_counts() for g in batch.groups for c in g.completions]
    versions = {v for per in counts for v in per} or {c.weight_version for g in batch.groups for c in g.completions}
    out.update({"rollout/weight_version_min": float(min(versions)), "rollout/weight_version_max": float(max(versions)),
                "rollout/staleness_max": float(batch.staleness), "rollout/staleness_mean": batch.staleness_mean,
                "rollout/partial_frac": sum(len(per) > 1 for per in counts) / len(counts)})
    out.update({f"reward/{k}": v for k, v in batch.reward_stats.items() if k != "seconds"})
    return out
