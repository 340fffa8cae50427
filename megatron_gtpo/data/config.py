"""Configuration of prompt datasets (the ``data:`` block of a recipe)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from megatron_gtpo.data.sources import BENCHMARKS, FieldMap
from megatron_gtpo.reward.verify import TASKS
from megatron_gtpo.utils.configuration import require, require_choice

TEMPLATES = ("auto", "reasoning_tags", "boxed", "boxed_1shot", "mmlu", "plain")
"""Prompt templates (see ``megatron_gtpo.data.templates``)."""

Template = Literal["auto", "reasoning_tags", "boxed", "boxed_1shot", "mmlu", "plain"]


@dataclass(kw_only=True)
class DataConfig:
    """Where prompts come from and how they are rendered, filtered and ordered."""

    benchmarks: list[str] = field(default_factory=lambda: ["gsm8k_train"])
    """Built-in datasets by name (``megatron_gtpo.data.BENCHMARKS``: gsm8k_train, gsm8k, math500,
    aime24, aime25, amc23, mmlu_stem); read from ``data_root``."""

    paths: list[str] = field(default_factory=list)
    """User files (``.jsonl``, ``.json`` lines or ``.parquet``) read with the ``fields`` mapping."""

    hf_datasets: list[str] = field(default_factory=list)
    """Sources read by Hugging Face ``datasets.load_dataset``: a local data file (``.jsonl``, ``.json``,
    ``.parquet``, ``.csv``), a directory of such files, or a dataset hub id (the hub cache first, as
    ``hf download ID --repo-type dataset`` fills it; else downloaded). Columns mapped by ``fields``."""

    hf_split: str = "train"
    """Split of every ``hf_datasets`` source (a single local file is that split)."""

    fields: FieldMap = field(default_factory=FieldMap)
    """Column mapping for ``paths`` and ``hf_datasets``."""

    task: str = "gsm8k"
    """Checker task of rows from ``paths`` and ``hf_datasets`` (gsm8k, math, aime, amc, mmlu) unless
    ``fields.task`` is set."""

    template: Template = "reasoning_tags"
    """Prompt template: ``reasoning_tags`` (the GTPO paper's system prompt asking for
    <reasoning>/<answer> tags), ``boxed`` (step by step, answer in \\boxed{}), ``boxed_1shot``
    (``boxed`` after one worked example that ends in a filled box), ``mmlu`` (multiple
    choice, letter in \\boxed{}), ``plain`` (the question alone), or ``auto`` (``mmlu`` for rows with
    choices, else ``boxed``)."""

    system_prompt: str = ""
    """Replaces the template's system prompt when non-empty."""

    use_chat_template: bool = True
    """Render prompts with the tokenizer's chat template (add_generation_prompt); false sends the
    plain text ("Question: ...\\nAnswer:")."""

    max_prompt_tokens: int = 4000
    """Prompts longer than this (after the chat template) are dropped and counted."""

    shuffle: bool = True
    """Visit prompts in a seeded random order, reshuffled every epoch."""

    seed: int = 0
    """Shuffle seed (the order of epoch e depends only on seed and e)."""

    limit: int = 0
    """Keep only the first N rows of each source (before shuffling); 0 keeps all."""

    data_root: str = ""
    """Directory holding the benchmark folders (your own copies); '' uses $MEGATRON_GTPO_DATA, else the
    files shipped in megatron_gtpo/data/benchmarks."""

    def __post_init__(self) -> None:
        require(bool(self.benchmarks or self.paths or self.hf_datasets), "benchmarks", self.benchmarks,
                "at least one benchmark name, one file in paths or one source in hf_datasets")
        for spec in self.hf_datasets:
            require(isinstance(spec, str) and bool(spec.strip()), "hf_datasets", spec,
                    "a local data file or directory, or a dataset hub id")
        require(bool(self.hf_split.strip()), "hf_split", self.hf_split, "a split name such as train")
        for name in self.benchmarks:
            require_choice(name, sorted(BENCHMARKS), "benchmarks")
        for path in self.paths:
            require(path.endswith((".jsonl", ".json", ".parquet")), "paths", path,
                    "a .jsonl, .json (one object per line) or .parquet file")
        require(self.task in TASKS, "task", self.task, f"one of {', '.join(TASKS)}")
        require(self.template in TEMPLATES, "template", self.template, f"one of {', '.join(TEMPLATES)}")
        require(self.max_prompt_tokens >= 1, "max_prompt_tokens", self.max_prompt_tokens, "an integer >= 1")
        require(self.limit >= 0, "limit", self.limit, "0 (all rows) or a positive row count")
