"""Prompt data: benchmark and user files -> templated, tokenised Prompts with a resumable cursor.

    sources.py  (BENCHMARKS, jsonl/parquet + field mapping) -> Example
    templates.py (paper tags / boxed / mmlu / plain, chat template) -> prompt text
    dataset.py  (tokenise, drop over-long, PromptDataset with seeded epochs) -> Prompt
    arithmetic.py (toy verifiable task for demos and learning tests)
"""

from megatron_gtpo.data.arithmetic import arithmetic_examples, arithmetic_prompts
from megatron_gtpo.data.config import DataConfig, FieldMap
from megatron_gtpo.data.dataset import DatasetStats, PromptDataset, build_dataset, build_prompts, load_examples
from megatron_gtpo.data.sources import (ALIASES, BENCHMARKS, SHIPPED_DATA, Example, canonical_benchmark,
                                        default_data_root, load_benchmark, read_examples)
from megatron_gtpo.data.templates import PAPER_SYSTEM_PROMPT, build_messages

__all__ = ["ALIASES", "BENCHMARKS", "PAPER_SYSTEM_PROMPT", "SHIPPED_DATA", "DataConfig", "DatasetStats", "Example",
           "FieldMap", "PromptDataset", "arithmetic_examples", "arithmetic_prompts", "build_dataset", "build_messages",
           "build_prompts", "canonical_benchmark", "default_data_root", "load_benchmark", "load_examples",
           "read_examples"]
