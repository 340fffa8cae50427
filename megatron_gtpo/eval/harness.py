"""The evaluation loop: prompts -> n samples each -> verdicts -> pass@k / maj@k / mean@k.

    for each benchmark: prompts --chunks of ~chunk_samples--> generate(..., n) --> completions
        --RewardScorer (workers, per-sample timeout)--> correct + canonical answer per sample
        --metrics.py--> BenchmarkResult
    EvalReport --> JSON (atomic), printed table, MLflow metrics

``evaluate`` takes a ``generate`` callable with ``RolloutEngine.generate``'s signature (prompts, the
rollout ``Sampling`` record, a seed), so it runs the same with a real engine, a local vLLM adapter or
a scripted fake in unit tests.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Callable

from tqdm import tqdm

from megatron_gtpo.eval.metrics import ProblemSamples, benchmark_metrics
from megatron_gtpo.reward.pool import STATUS_ERROR, STATUS_TIMEOUT, SampleScore
from megatron_gtpo.rollout.config import Sampling
from megatron_gtpo.types import Completion, Prompt
from megatron_gtpo.utils.atomic import write_text_atomic

GenerateFn = Callable[..., list[Completion]]
"""``generate(prompts, sampling, *, seed) -> list[Completion]`` (``RolloutEngine.generate``)."""


@dataclass(frozen=True, kw_only=True)
class EvalPlan:
    """How every benchmark of one evaluation is sampled, chunked and summarised."""

    sampling: Sampling
    """Sampling of each problem (the rollout record, as engines take it)."""
    seed: int = 0
    """Base seed; the chunk starting at problem i uses seed + i (and maj@k's subsets use it)."""
    ks: list[int]
    """k values of pass@k / maj@k / mean@k."""
    chunk_samples: int
    """Samples generated per engine call."""
    maj_resamples: int = 1000
    """Resampled subsets per maj@k estimate when exact enumeration is too large."""
    maj_max_exact: int = 5000
    """Largest number of k-subsets maj@k enumerates exactly."""


@dataclass(kw_only=True)
class BenchmarkResult:
    """The outcome of one benchmark."""

    name: str
    """Benchmark name."""
    num_problems: int
    """Problems evaluated."""
    num_too_long: int
    """Problems skipped because the prompt exceeded max_prompt_tokens."""
    n: int
    """Samples per problem."""
    metrics: dict[str, float]
    """``pass@k``, ``maj@k``, ``mean@k`` in [0, 1]."""
    num_timeouts: int = 0
    """Samples whose checking timed out (counted wrong)."""
    num_errors: int = 0
    """Samples whose checking failed (counted wrong)."""
    no_answer_rate: float = 0.0
    """Share of samples without an extractable final answer."""
    truncated_rate: float = 0.0
    """Share of samples cut at max_tokens."""
    mean_completion_tokens: float = 0.0
    """Mean completion length in tokens."""
    seconds: float = 0.0
    """Wall-clock time (generation + checking)."""


@dataclass(kw_only=True)
class EvalReport:
    """Everything ``megatron-gtpo eval`` reports."""

    model: str
    """The ``--model`` argument."""
    results: list[BenchmarkResult]
    """One entry per benchmark, in the requested order."""
    config: dict = field(default_factory=dict)
    """The resolved evaluation config."""
    seconds: float = 0.0
    """Total wall-clock time."""

    def to_dict(self) -> dict:
        """JSON-ready view: ``benchmarks`` maps each name to its result."""
        return {"model": self.model, "seconds": round(self.seconds, 3), "config": self.config,
                "benchmarks": {r.name: asdict(r) for r in self.results}}


def _chunks(prompts: list[Prompt], n: int, chunk_samples: int) -> list[tuple[int, list[Prompt]]]:
    step = max(1, chunk_samples // n)
    return [(i, prompts[i:i + step]) for i in range(0, len(prompts), step)]


def _check_completions(completions: list[Completion], num_prompts: int, n: int) -> list[list[Completion]]:
    groups: list[list[Completion]] = [[] for _ in range(num_prompts)]
    for c in completions:
        if not 0 <= c.prompt_index < num_prompts:
            raise RuntimeError(f"generate returned prompt_index={c.prompt_index} for {num_prompts} prompts")
        groups[c.prompt_index].append(c)
    bad = [i for i, g in enumerate(groups) if len(g) != n]
    if bad:
        raise RuntimeError(f"generate returned {len(groups[bad[0]])} completions for prompt {bad[0]}, expected n={n}")
    return groups


def _sample_rows(name: str, prompt: Prompt, group: list[Completion], scores: list[SampleScore]) -> list[dict]:
    return [{"benchmark": name, "uid": prompt.uid, "sample": j, "gold": prompt.gold, "answer": s.answer,
             "correct": s.correct, "status": s.status, "num_tokens": len(c.token_ids),
             "finish_reason": c.finish_reason, "text": c.text} for j, (c, s) in enumerate(zip(group, scores))]


def evaluate_benchmark(name: str, prompts: list[Prompt], *, generate: GenerateFn, scorer, plan: EvalPlan,
                       bar: tqdm, num_too_long: int = 0, samples_out: IO[str] | None = None) -> BenchmarkResult:
    """Samples ``plan.sampling.n`` completions per prompt, checks them, and computes the metrics."""
    start, sampling = time.perf_counter(), plan.sampling
    problems: list[ProblemSamples] = []
    counts = {"timeouts": 0, "errors": 0, "no_answer": 0, "truncated": 0, "tokens": 0, "samples": 0}
    for offset, chunk in _chunks(prompts, sampling.n, plan.chunk_samples):
        completions = generate(chunk, sampling, seed=plan.seed + offset)
        groups = _check_completions(completions, len(chunk), sampling.n)
        flat = [c for g in groups for c in g]
        scores = scorer.score([(c.text, chunk[c.prompt_index].gold, chunk[c.prompt_index].task) for c in flat],
                              with_answers=True)
        for i, (prompt, group) in enumerate(zip(chunk, groups)):
            mine = scores[i * sampling.n:(i + 1) * sampling.n]
            problems.append(ProblemSamples(uid=prompt.uid, answers=[s.answer for s in mine],
                                           correct=[s.correct for s in mine]))
            if samples_out is not None:
                for row in _sample_rows(name, prompt, group, mine):
                    samples_out.write(json.dumps(row) + "\n")
        counts["timeouts"] += sum(s.status == STATUS_TIMEOUT for s in scores)
        counts["errors"] += sum(s.status == STATUS_ERROR for s in scores)
        counts["no_answer"] += sum(s.answer is None for s in scores)
        counts["truncated"] += sum(c.truncated for c in flat)
        counts["tokens"] += sum(len(c.token_ids) for c in flat)
        counts["samples"] += len(flat)
        bar.set_postfix(bench=name, acc=f"{sum(sum(p.correct) for p in problems) / counts['samples']:.3f}",
                        refresh=False)
        bar.update(len(flat))
    total = max(1, counts["samples"])
    return BenchmarkResult(
        name=name, num_problems=len(problems), num_too_long=num_too_long, n=sampling.n,
        metrics=benchmark_metrics(problems, plan.ks, max_exact_subsets=plan.maj_max_exact,
                                  num_resamples=plan.maj_resamples, seed=plan.seed) if problems else {},
        num_timeouts=counts["timeouts"], num_errors=counts["errors"], no_answer_rate=counts["no_answer"] / total,
        truncated_rate=counts["truncated"] / total, mean_completion_tokens=counts["tokens"] / total,
        seconds=time.perf_counter() - start)


def format_table(results: list[BenchmarkResult], ks: list[int]) -> str:
    """A fixed-width table of the metrics in percent, one row per benchmark."""
    columns = [f"{m}@{k}" for m in ("pass", "maj", "mean") for k in ks]
    head = f"{'benchmark':<12}{'problems':>9}" + "".join(f"{c:>10}" for c in columns)
    lines = [head, "-" * len(head)]
    for r in results:
        cells = "".join(f"{100 * r.metrics[c]:>10.1f}" if c in r.metrics else f"{'-':>10}" for c in columns)
        lines.append(f"{r.name:<12}{r.num_problems:>9}{cells}")
    return "\n".join(lines)


def write_json_atomic(data: dict, path: str | os.PathLike) -> Path:
    """Writes ``data`` as indented JSON through a temp file and an atomic rename."""
    return write_text_atomic(path, json.dumps(data, indent=2) + "\n")


def mlflow_metrics(results: list[BenchmarkResult]) -> dict[str, float]:
    """MLflow-safe metric names (``eval/<bench>/pass_at_<k>``: MLflow rejects '@')."""
    out = {}
    for r in results:
        for key, value in r.metrics.items():
            out[f"eval/{r.name}/{key.replace('@', '_at_')}"] = value
        out[f"eval/{r.name}/no_answer_rate"] = r.no_answer_rate
        out[f"eval/{r.name}/timeouts"] = float(r.num_timeouts)
    return out


def log_to_mlflow(report: EvalReport, *, tracking_uri: str, run_id: str, experiment: str, step: int,
                  report_path: Path | None = None) -> str:
    """Logs the metrics (and the JSON report as an artifact) into ``run_id``, or into a new run of
    ``experiment``; returns the run id."""
    import mlflow
    from mlflow.entities import Metric

    client = mlflow.MlflowClient(tracking_uri=tracking_uri or None)
    if not run_id:
        exp = client.get_experiment_by_name(experiment)
        exp_id = exp.experiment_id if exp else client.create_experiment(experiment)
        run_id = client.create_run(exp_id, run_name=f"eval-{Path(report.model).name}").info.run_id
        client.log_param(run_id, "eval.model", report.model)
    now = int(time.time() * 1000)
    metrics = [Metric(key, float(v), now, step) for key, v in mlflow_metrics(report.results).items()]
    client.log_batch(run_id, metrics=metrics)
    if report_path is not None:
        client.log_artifact(run_id, str(report_path), artifact_path="eval")
    return run_id
