"""Reading prompt sources: the benchmark files shipped in ``megatron_gtpo/data/benchmarks``, user
jsonl/parquet files and Hugging Face ``datasets`` (local files and directories, or the datasets cache).

    benchmark name --BENCHMARKS--> file + column schema --read_rows--> list[Example]
    user file + FieldMap ----------------------------------^
    datasets.load_dataset(...) + FieldMap -----------------^

An ``Example`` is a row before templating and tokenisation: question, gold in the checker's format,
task, optional choices. A missing column or file is reported with the file, the row and the fix.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from megatron_gtpo.reward.verify import TASKS
from megatron_gtpo.utils.configuration import require


@dataclass(kw_only=True)
class FieldMap:
    """Which column of a user jsonl/parquet file holds what."""

    question: str = "question"
    """Column with the problem text."""
    gold: str = "answer"
    """Column with the reference answer (GSM8K '#### N' solution, LaTeX, number, letter or index)."""
    choices: str = ""
    """Column with a list of answer options (multiple choice; rendered as A., B., ...); '' for none."""
    task: str = ""
    """Column naming each row's checker task; '' uses ``DataConfig.task`` for every row."""
    uid: str = ""
    """Column with a stable row id; '' uses ``<file stem>:<row number>``."""

    def __post_init__(self) -> None:
        require(bool(self.question), "question", self.question, "a column name")
        require(bool(self.gold), "gold", self.gold, "a column name")


@dataclass(frozen=True, kw_only=True)
class Benchmark:
    """A built-in dataset: where its file lives and how its columns map to an Example."""

    file: str
    """Path relative to the data root."""
    task: str
    """Checker task of every row."""
    fields: FieldMap
    """Column mapping of the file."""


BENCHMARKS: dict[str, Benchmark] = {
    "gsm8k_train": Benchmark(file="gsm8k/train.jsonl", task="gsm8k", fields=FieldMap()),
    "gsm8k": Benchmark(file="gsm8k/test.jsonl", task="gsm8k", fields=FieldMap()),
    "math500": Benchmark(file="math500/test.jsonl", task="math", fields=FieldMap(question="problem")),
    "aime24": Benchmark(file="aime24/test.jsonl", task="aime", fields=FieldMap(question="problem", uid="id")),
    "aime25": Benchmark(file="aime25/test.jsonl", task="aime", fields=FieldMap(question="problem")),
    "amc23": Benchmark(file="amc23/test.jsonl", task="amc", fields=FieldMap(question="problem", uid="id")),
    "mmlu_stem": Benchmark(file="mmlu_stem/test.jsonl", task="mmlu", fields=FieldMap(choices="choices")),
}
"""Built-in datasets by name (files, sources and licenses: megatron_gtpo/data/benchmarks/README.md)."""

ALIASES = {"mmlu": "mmlu_stem", "math": "math500", "aime2024": "aime24", "aime2025": "aime25", "amc": "amc23"}
"""Other accepted spellings of benchmark names (``--benchmarks mmlu``)."""


@dataclass(frozen=True, kw_only=True)
class Example:
    """One dataset row, before the prompt template and the tokenizer."""

    uid: str
    """Stable id: ``<source>:<row id>``."""
    question: str
    """Problem text."""
    gold: str
    """Reference in the checker's format (GSM8K solution with '#### N', LaTeX, number, letter)."""
    task: str
    """Checker task."""
    choices: tuple[str, ...] = field(default_factory=tuple)
    """Answer options of a multiple-choice row (rendered A., B., ...), empty otherwise."""
    row: dict = field(default_factory=dict, compare=False)
    """All columns of the row as read (for reward functions that declare ``row``)."""


SHIPPED_DATA = Path(__file__).resolve().parent / "benchmarks"
"""The benchmark files the project ships as package data (one folder per benchmark)."""


def default_data_root() -> Path:
    """$MEGATRON_GTPO_DATA when set, else the shipped folder ``SHIPPED_DATA``."""
    env = os.environ.get("MEGATRON_GTPO_DATA")
    if env:
        return Path(env)
    return SHIPPED_DATA


def canonical_benchmark(name: str) -> str:
    """Resolves an alias; raises ValueError listing the known names for an unknown one."""
    name = ALIASES.get(name.strip().lower(), name.strip().lower())
    if name not in BENCHMARKS:
        known = sorted(set(BENCHMARKS) | set(ALIASES))
        raise ValueError(f"unknown benchmark {name!r}; known: {', '.join(known)}")
    return name


def _read_records(path: Path) -> list[dict]:
    if not path.is_file():
        raise FileNotFoundError(f"data file {path} does not exist; check data.paths / data.data_root (benchmarks "
                                f"are looked up under data_root, else $MEGATRON_GTPO_DATA, else {SHIPPED_DATA})")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    records = []
    with path.open(encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{line_no} is not valid JSON ({err}); expected one object per line") from None
    return records


def _column(record: dict, column: str, path: Path, row: int, option: str):
    if column not in record:
        raise ValueError(f"{path} row {row} has no column {column!r} (columns: {', '.join(map(str, record))}); "
                       f"set data.fields.{option} to the column that holds it")
    return record[column]


def _gold_text(value, task: str) -> str:
    # AMC golds are floats (27.0); write integral values as integers so they read like answers.
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if task == "mmlu" and isinstance(value, int) and not isinstance(value, bool):
        return "ABCDEFGHIJKLMNOPQRSTUVWXYZ"[value]
    return str(value).strip()


def _example(record: dict, *, fields: FieldMap, task: str, source: str, path: Path, row: int) -> Example:
    row_task = str(_column(record, fields.task, path, row, "task")) if fields.task else task
    if row_task not in TASKS:
        raise ValueError(f"{path} row {row}: task {row_task!r} is not one of {', '.join(TASKS)}")
    # Options may be absent on some rows of a mixed file (free-form rows next to multiple choice).
    choices = (record.get(fields.choices) if fields.choices else None) or ()
    if isinstance(choices, str) or not isinstance(choices, (list, tuple)):
        raise ValueError(f"{path} row {row}: column {fields.choices!r} must hold a list of options")
    uid = _column(record, fields.uid, path, row, "uid") if fields.uid else row
    return Example(uid=f"{source}:{uid}", question=str(_column(record, fields.question, path, row, "question")),
                   gold=_gold_text(_column(record, fields.gold, path, row, "gold"), row_task), task=row_task,
                   choices=tuple(str(c) for c in choices), row=record)


def read_examples(path: str | os.PathLike, *, fields: FieldMap, task: str, source: str | None = None,
                  limit: int = 0) -> list[Example]:
    """Reads a jsonl/parquet file into Examples using the column mapping ``fields``; ``limit`` > 0
    keeps the first rows only."""
    path = Path(path)
    records = _read_records(path)
    if limit:
        records = records[:limit]
    source = source or path.stem
    return [_example(r, fields=fields, task=task, source=source, path=path, row=i) for i, r in enumerate(records)]


HF_FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
"""``datasets``' packaged builder for a local data file, by suffix."""


def _load_hf(spec: str, split: str):
    try:
        import datasets
    except ImportError:
        raise ImportError(f"data.hf_datasets={spec!r} needs Hugging Face `datasets` (requirements/cpu.lock has it; "
                          f"elsewhere: pip install 'megatron-gtpo[data]'), or list the file in data.paths") from None
    path = Path(spec)
    if path.is_file():
        if path.suffix not in HF_FILE_BUILDERS:
            raise ValueError(f"data.hf_datasets: {spec} is a file datasets cannot read by its suffix; use a "
                             f"{', '.join(HF_FILE_BUILDERS)} file, a dataset directory or a hub id")
        # data_files under the split's own name, so data.hf_split names the split of a single file too
        return datasets.load_dataset(HF_FILE_BUILDERS[path.suffix], data_files={split: str(path)}, split=split)
    snapshot = _hub_snapshot(spec)
    try:  # a directory of data files, or a hub id: the hub cache first, else datasets' own lookup
        return datasets.load_dataset(str(snapshot) if snapshot else spec, split=split)
    except (FileNotFoundError, ValueError, ConnectionError) as err:
        raise ValueError(f"data.hf_datasets: could not load {spec!r} split {split!r} ({type(err).__name__}: "
                         f"{err}); give a local file or directory, or a hub id in the cache (`hf download "
                         f"{spec} --repo-type dataset` on a machine with network), and data.hf_split") from None


def _hub_snapshot(spec: str) -> Path | None:
    """The hub cache's snapshot of dataset repo ``spec`` (what ``hf download --repo-type dataset`` writes),
    or None. datasets itself finds a hub id offline only in its own cache of an earlier online load."""
    if Path(spec).exists() or spec.count("/") != 1:
        return None
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(spec, repo_type="dataset", local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError):
        return None


def read_hf_dataset(spec: str, *, split: str, fields: FieldMap, task: str, limit: int = 0) -> list[Example]:
    """Examples of one ``datasets.load_dataset`` source: a local data file (jsonl/json/parquet/csv), a
    directory of them or a hub id, split ``split``, mapped through ``fields`` as a user file is."""
    table = _load_hf(spec, split)
    if limit:
        table = table.select(range(min(limit, len(table))))
    source = Path(spec).stem if Path(spec).is_file() else spec.rstrip("/").rsplit("/", 1)[-1]
    where = Path(f"{spec} ({split})")  # how errors name the source
    return [_example(r, fields=fields, task=task, source=source, path=where, row=i) for i, r in enumerate(table)]


def load_benchmark(name: str, *, data_root: str | os.PathLike | None = None, limit: int = 0) -> list[Example]:
    """The Examples of built-in benchmark ``name`` (aliases accepted)."""
    name = canonical_benchmark(name)
    bench = BENCHMARKS[name]
    root = Path(data_root) if data_root else default_data_root()
    return read_examples(root / bench.file, fields=bench.fields, task=bench.task, source=name, limit=limit)
