"""The driver's view of tracking: one ``Reporter`` per rank (rank 0 writes), the per-step metric
dict and the sample-completions table. MLflow itself is behind ``Tracker`` (journal + worker)."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

from megatron_gtpo.parallel.control import broadcast_data
from megatron_gtpo.rollout.staleness import version_spans
from megatron_gtpo.tracking.guards import RegimeGuards
from megatron_gtpo.tracking.tracker import Tracker
from megatron_gtpo.utils.atomic import write_text_atomic
from megatron_gtpo.utils.configuration import write_yaml_atomic
from megatron_gtpo.utils.secret import private_directory

log = logging.getLogger("megatron_gtpo")


class Reporter:
    """Rank 0's view of a run: MLflow metrics and artifacts, one log line per step, sample tables.

    Every rank builds one (the MLflow run id is shared with all ranks, for checkpoints); only rank 0
    writes anything. Metric names are those of ``megatron_gtpo.metrics``.
    """

    def __init__(self, config, *, run_dir: Path, rank: int, total_steps: int, run_id: str | None = None,
                 resume_step: int | None = None):
        """``config``: TrackingConfig. ``run_id``: the restored checkpoint's (None: the journal's).
        ``resume_step``: the step resumed from (0 when --resume found no checkpoint), None for a
        fresh run (which moves an old journal in the run directory aside)."""
        self.config, self.run_dir, self.rank, self.total_steps = config, Path(run_dir), rank, total_steps
        self.tracker: Tracker | None = None
        self.committed = -1
        self.guards = RegimeGuards()
        self._timed: list[float] = []  # step times of this process: the ETA's mean
        if rank == 0:
            was = private_directory(self.run_dir)
            if was is not None:
                log.info("run directory %s made owner-only (mode %04o -> %04o)", self.run_dir, was, was & 0o700)
            self.tracker = Tracker(config, run_dir=self.run_dir, run_id=run_id, resume_step=resume_step)
        # None while the store has not answered (a resume then takes the id from the journal)
        self.run_id: str | None = broadcast_data(self.tracker.run_id if self.tracker else None)
        """The MLflow run id on every rank (None when tracking is off or the store is not up yet)."""

    def start(self, config: dict) -> None:
        """Writes the resolved config to ``<run dir>/config.yaml`` and, once per MLflow run (not on
        resume), logs it as params and as an artifact."""
        if self.tracker is None:
            return
        path = write_yaml_atomic(config, self.run_dir / "config.yaml")
        if self.config.enabled:
            self.tracker.log_params(config)  # once per MLflow run: a resume does not log them again
            self.tracker.log_artifact(path)

    def step(self, step: int, metrics: dict[str, float], rollout) -> None:
        """Logs one step: MLflow metrics, a one-line summary, every N steps sample completions, and
        the step's new reward-function failures (``rollout``: the step's RolloutBatch)."""
        if self.tracker is None:
            return
        self.reward_errors(step, rollout.reward_errors)
        self.tracker.log_metrics(metrics, step)
        get = lambda k: metrics.get(k, float("nan"))  # noqa: E731
        self._timed.append(get("time/step_s"))
        log.info("step %d/%d | reward %.3f acc %.2f | len %.1f trunc %.2f drift %+.1f | H %.3f | conflicts %.2f | "
                 "shift %.2f filtered %.2f | gnorm %.3f | rollout %.1fs reward %.1fs train %.1fs sync %.1fs = %.1fs | "
                 "train %.0f tok/s/GPU MFU %.1f%% | ETA %s", step, self.total_steps, get("reward/mean"), get("reward/accuracy"),
                 get("completion/length_mean"), get("completion/truncated_frac"), get("bias/length_drift"),
                 get("entropy/mean"), get("gtpo/conflict_tokens_per_completion"), get("gtpo/shift_share"),
                 get("gtpo/filtered_frac"), get("optim/grad_norm"), get("time/rollout_s"), get("time/reward_s"),
                 get("time/train_s"), get("time/sync_s"), get("time/step_s"), get("perf/tokens_per_gpu_s"),
                 100 * get("perf/mfu"), eta(self._timed, self.total_steps - step))
        for name, warning in self.guards.check(metrics):
            log.warning("step %d: regime guard %s", step, warning)
            self.tracker.set_tag(f"guard/{name}", f"step {step}: {warning}")
        every = self.config.samples_every
        if every and (step % every == 0 or step == 1):
            self.tracker.log_json(sample_table(rollout.groups, limit=self.config.num_samples),
                                  f"samples/step_{step:06d}.json", step=step)

    def decision(self, key: str, text: str) -> None:
        """A choice the run made by itself (GTPO's auto filter): a log line and the MLflow tag ``key``."""
        if self.tracker is None:
            return
        log.info(text)
        self.tracker.set_tag(key, text)

    def skipped(self, step: int, metrics: dict[str, float], rollout) -> None:
        """A step whose dynamic sampling kept no group: no update, the counters are still logged."""
        if self.tracker is None:
            return
        self.reward_errors(step, rollout.reward_errors)
        self.tracker.log_metrics({**metrics, "rollout/skipped_step": 1.0}, step)
        log.warning("step %d: dynamic sampling kept no group in %d tries (all-equal groups); no update this step",
                    step, int(metrics["rollout/tries"]))

    def dataset(self, stats, *, fresh: bool) -> None:
        """The prompt set: a log line on every start, and ``data/*`` metrics (prompts kept and
        dropped) at step 0 of a fresh run only, so a resumed run's history holds them once."""
        if self.tracker is None:
            return
        log.info(stats.summary())
        if fresh:
            self.tracker.log_metrics(stats.metrics(), 0)

    def reward_errors(self, step: int, errors: list) -> None:
        """Appends new distinct reward-function failures (with tracebacks) to
        ``<run dir>/reward_errors.json`` and stores it as an MLflow artifact."""
        if self.tracker is None or not errors:
            return
        path = self.run_dir / "reward_errors.json"
        known = json.loads(path.read_text()) if path.is_file() else []
        known += [{"step": step, **dataclasses.asdict(e)} for e in errors]
        write_text_atomic(path, json.dumps(known, indent=1, default=str))
        self.tracker.log_artifact(path)

    def evaluation(self, step: int, metrics: dict[str, float], *, num_prompts: int) -> None:
        """Logs a periodic held-out evaluation (metrics and a JSON artifact)."""
        if self.tracker is None:
            return
        self.tracker.log_metrics(metrics, step)
        self.tracker.log_json({"step": step, **metrics, "prompts": num_prompts}, f"eval/step_{step:06d}.json",
                              step=step)
        log.info("eval at step %d: accuracy %.3f on %d held-out prompts", step, metrics["eval/accuracy"], num_prompts)

    def commit(self, step: int) -> None:
        """The checkpoint of ``step`` is committed: records up to it are final (never re-run)."""
        if self.tracker is not None and step > self.committed:
            self.committed = step
            self.tracker.commit(step)

    def finish(self, status: str, reason: str | None = None) -> None:
        """Marks the MLflow run FINISHED / KILLED / FAILED (after sending what it can)."""
        if self.tracker is not None:
            self.tracker.finish(status, reason=reason)


def step_metrics(*parts: dict[str, float], times: dict[str, float], completion_tokens: float,
                 gpus: int = 1, work: tuple[float, float] | None = None,
                 peak_tflops: float | None = None) -> dict[str, float]:
    """One flat dict of a step: the stages' metrics, ``time/<stage>_s``, throughput and ``perf/*``
    (``gpus``: the trainer's ranks, each with its colocated engine; rollout servers' GPUs are not
    counted). ``work``: (tokens, model FLOPs) of the train phase (``tracking.perf.TrainWork``);
    ``peak_tflops``: one trainer device's peak; without them no ``perf/*``."""
    out: dict[str, float] = {}
    for part in parts:
        out.update(part)
    out.update({f"time/{k}_s": v for k, v in times.items()})
    out["throughput/completion_tokens"] = completion_tokens
    out["throughput/tokens_per_s"] = completion_tokens / max(times["step"], 1e-9)
    out["throughput/tokens_per_gpu_s"] = out["throughput/tokens_per_s"] / gpus  # verl's perf/throughput unit
    if work is not None:
        train_s = max(times["train"], 1e-9)
        tokens, flops = work
        out["perf/tokens_per_s"] = tokens / train_s
        out["perf/tokens_per_gpu_s"] = tokens / train_s / gpus
        out["perf/tflops_per_gpu"] = flops / train_s / gpus / 1e12
        if peak_tflops:
            out["perf/mfu"] = out["perf/tflops_per_gpu"] / peak_tflops
    return out


def eta(step_times: list[float], remaining: int) -> str:
    """``h:mm:ss`` left at the mean of the last 10 step times (the first step's warm-up fades out)."""
    recent = [t for t in step_times[-10:] if t == t]  # NaN: a step without a time
    if not recent:
        return "?"
    seconds = round(remaining * sum(recent) / len(recent))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def sample_table(groups, *, limit: int) -> list[dict]:
    """Rows of prompt (text, id) / completion / reward / correct / the weight versions that sampled its
    tokens (``[[version, tokens], ...]``) for the sample-completions artifact."""
    rows = []
    for g in groups:
        for c, r, ok in zip(g.completions, g.rewards, g.correct or [None] * len(g.rewards)):
            rows.append({"prompt": g.prompt.text[-500:], "prompt_id": g.prompt.uid, "completion": c.text, "reward": r,
                         "correct": ok, "tokens": len(c.token_ids), "finish_reason": c.finish_reason,
                         "token_versions": version_spans(c.versions())})
            if len(rows) >= limit:
                return rows
    return rows
