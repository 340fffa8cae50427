"""Rollout -> reward stage: prompts + completions -> ScoredGroups, plus failure counters.

    list[Prompt], list[Completion] --group by prompt_index--> per-sample (text, gold, task)
        [+ prompt text / dataset row, when the reward function declares them]
        --ScoringPool (workers, per-sample timeout)--> reward, correct
        --+ overlong punishment (token counts, DAPO)--> ScoredBatch(groups, stats)

Build one ``RewardScorer`` per run and reuse it: its worker processes are started once. It logs the
first traceback of each distinct failure (``new_errors()`` hands them to the driver for an
artifact), warns when more than half a batch failed and stops the run when every reward failed for
``reward.max_failed_batches`` batches in a row (see ``failures.py``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from megatron_gtpo.reward.config import RewardConfig
from megatron_gtpo.reward.failures import ErrorLog, FailureMonitor, RewardError, ScoringStats
from megatron_gtpo.reward.functions import OverlongPunishment, context_args, resolve_reward, reward_path
from megatron_gtpo.reward.pool import STATUS_ERROR, STATUS_TIMEOUT, SampleScore, ScoringPool
from megatron_gtpo.types import Completion, Prompt, ScoredGroup


@dataclass(kw_only=True)
class ScoredBatch:
    """What ``score_groups`` returns."""

    groups: list[ScoredGroup]
    """One group per prompt, in prompt order; completions in the order they were given."""
    stats: ScoringStats = field(default_factory=ScoringStats)
    """Failure counters and timing of this call."""


class RewardScorer:
    """Scores completions with the reward configured in ``RewardConfig``; owns the worker pool.

    The reward function is imported once here so that a bad ``reward.fn`` fails at start-up with a
    clear message rather than inside a worker. Use as a context manager or call ``close()``.
    """

    def __init__(self, config: RewardConfig, *, overlong: OverlongPunishment | None = None):
        self.config = config
        self.overlong = overlong
        """DAPO's soft overlong punishment added to every reward, or None."""
        # Fails fast on a typo or an unimportable user reward; its signature is read here, once.
        self.context_args = context_args(resolve_reward(config.fn))
        """What the function declared of ``prompt``/``row`` (functions.CONTEXT_ARGS); () for the plain contract."""
        self.pool = ScoringPool(fn_path=reward_path(config.fn), num_workers=config.num_workers,
                                timeout_s=config.timeout_s, start_method=config.start_method,
                                chunk_size=config.chunk_size, label=config.fn)
        self.errors = ErrorLog(config.fn)
        """Distinct failures so far (``errors.counts``), each logged once with its traceback."""
        self.monitor = FailureMonitor(config.fn, max_failed_batches=config.max_failed_batches)
        """Per-batch alarms, fed by ``score_groups``."""

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        """Spawns the worker processes now (see ``ScoringPool.start``); otherwise the first score does."""
        self.pool.start()

    def close(self) -> None:
        """Stops the worker processes."""
        self.pool.close()

    def score(self, items: list[tuple[str, str, str]], *, with_answers: bool = False, progress: bool = False,
              desc: str = "scoring", prompts: list[Prompt] | None = None) -> list[SampleScore]:
        """Scores ``[(completion_text, gold, task), ...]``; one SampleScore per item, in order.
        ``with_answers`` also returns each canonical extracted answer (for maj@k); ``prompts`` (each
        item's prompt) feed a function that declares ``prompt``/``row``. Raises
        RewardFunctionCrashed when the function kills its worker process twice on one sample."""
        scores = self.pool.score(items, with_answers=with_answers, progress=progress, desc=desc,
                                 contexts=self._contexts(prompts, len(items)))
        self.errors.record(items, scores)
        return scores

    def _contexts(self, prompts: list[Prompt] | None, num_items: int) -> list[dict] | None:
        """Each item's extra keyword arguments; None (send nothing) when the function declared none."""
        if not self.context_args:
            return None
        if prompts is None or len(prompts) != num_items:
            raise ValueError(f"reward.fn={self.config.fn!r} declares {', '.join(self.context_args)}: score() needs "
                             f"prompts= with one Prompt per item ({num_items})")
        return [{name: value for name, value in (("prompt", p.text), ("row", p.row)) if name in self.context_args}
                for p in prompts]

    def new_errors(self) -> list[RewardError]:
        """Distinct reward failures (first occurrence, with traceback) seen since the previous call;
        the driver saves them (``dataclasses.asdict``) as a JSON artifact."""
        return self.errors.new()


def group_indices(num_prompts: int, completions: list[Completion]) -> list[list[int]]:
    """Positions in ``completions`` of each prompt's completions (by ``prompt_index``), in order."""
    groups: list[list[int]] = [[] for _ in range(num_prompts)]
    for i, completion in enumerate(completions):
        if not 0 <= completion.prompt_index < num_prompts:
            raise ValueError(f"completions[{i}].prompt_index={completion.prompt_index} is outside the "
                             f"{num_prompts} prompts given to score_groups; pass the prompts list that "
                             f"was given to generate()")
        groups[completion.prompt_index].append(i)
    return groups


def score_groups(prompts: list[Prompt], completions: list[Completion], *, scorer: RewardScorer | None = None,
                 config: RewardConfig | None = None, progress: bool = False) -> ScoredBatch:
    """Rewards and correctness for every completion, grouped by prompt.

    Pass a long-lived ``scorer`` (training loop) or a ``config`` (a pool is started and stopped for
    this call). Returns one ScoredGroup per prompt (an empty group when a prompt got no
    completion). A timeout or error scores 0 (plus the overlong term) and is counted in ``stats``;
    the scorer's FailureMonitor then warns about, or stops (RewardFunctionFailing), a batch whose
    rewards mostly or all failed. Every reward is multiplied by ``RewardConfig.scale`` (1 by default).
    """
    if (scorer is None) == (config is None):
        raise ValueError("score_groups needs exactly one of scorer= (reused across steps) or config=")
    if scorer is None:
        with RewardScorer(config) as own:  # type: ignore[arg-type]
            return score_groups(prompts, completions, scorer=own, progress=progress)
    start = time.perf_counter()
    index_groups = group_indices(len(prompts), completions)
    items = [(c.text, prompts[c.prompt_index].gold, prompts[c.prompt_index].task) for c in completions]
    scores = scorer.score(items, progress=progress, prompts=[prompts[c.prompt_index] for c in completions])
    stats = ScoringStats(num_samples=len(completions))
    rewards = []
    for completion, score in zip(completions, scores):
        stats.num_timeouts += score.status == STATUS_TIMEOUT
        stats.num_errors += score.status == STATUS_ERROR
        penalty = 0.0
        if scorer.overlong is not None:
            penalty = scorer.overlong(len(completion.token_ids))
            stats.num_overlong += penalty != 0.0
        rewards.append((score.reward + penalty) * scorer.config.scale)
    groups = [ScoredGroup(prompt=prompts[p], completions=[completions[i] for i in idx],
                          rewards=[rewards[i] for i in idx], correct=[scores[i].correct for i in idx])
              for p, idx in enumerate(index_groups)]
    stats.seconds = time.perf_counter() - start
    scorer.monitor.observe(stats)
    return ScoredBatch(groups=groups, stats=stats)
