"""Training prompts read by Hugging Face ``datasets`` (``data.hf_datasets``): local jsonl and parquet
files and a directory of data files, mapped by ``data.fields`` as user files are; never the network
(the hub is switched offline and the datasets cache is the test's own)."""

from __future__ import annotations

import json

import datasets
import pytest

from megatron_gtpo.data import DataConfig, FieldMap
from megatron_gtpo.data.dataset import load_examples
from megatron_gtpo.utils.configuration import ConfigError

ROWS = [{"problem": "What is 2 + 3?", "solution": "5", "level": 1},
        {"problem": "What is 7 * 6?", "solution": "42", "level": 2},
        {"problem": "What is 9 - 4?", "solution": "5", "level": 1}]
FIELDS = FieldMap(question="problem", gold="solution")


@pytest.fixture(autouse=True)
def offline_cache(tmp_path, monkeypatch):
    """The datasets cache in tmp_path and the hub offline (datasets reads both into its config at import)."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-datasets")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)


def _jsonl(path, rows=ROWS):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_local_jsonl_file_becomes_prompts_with_its_rows(tmp_path):
    """Injected bug: load_examples without its hf_datasets loop -> no examples, fails."""
    config = DataConfig(benchmarks=[], hf_datasets=[str(_jsonl(tmp_path / "mine.jsonl"))], fields=FIELDS,
                        task="math")
    examples = load_examples(config)
    assert [(e.uid, e.question, e.gold, e.task) for e in examples] == [
        ("mine:0", "What is 2 + 3?", "5", "math"), ("mine:1", "What is 7 * 6?", "42", "math"),
        ("mine:2", "What is 9 - 4?", "5", "math")]
    assert examples[1].row == ROWS[1]  # every column reaches a reward that declares `row`


def test_a_parquet_file_read_as_the_named_split_with_a_limit(tmp_path):
    """A single file is the split data.hf_split names. Injected bug: data_files without the split's
    name (datasets then calls it `train`) -> hf_split=test raises, fails."""
    path = tmp_path / "probs.parquet"
    datasets.Dataset.from_list(ROWS).to_parquet(str(path))
    config = DataConfig(benchmarks=[], hf_datasets=[str(path)], hf_split="test", fields=FIELDS, limit=2)
    assert [e.gold for e in load_examples(config)] == ["5", "42"]


def test_a_directory_of_data_files_and_the_benchmarks_beside_it(tmp_path):
    folder = tmp_path / "my_set"
    _jsonl(folder / "train.jsonl")
    _jsonl(folder / "test.jsonl", ROWS[:1])
    config = DataConfig(benchmarks=["aime24"], hf_datasets=[str(folder)], fields=FIELDS, task="math")
    examples = load_examples(config)
    assert len(examples) == 30 + 3 and examples[-1].uid == "my_set:2"


def test_a_dataset_hub_id_from_the_hub_cache(tmp_path, monkeypatch):
    """A dataset repo in the hub cache (the layout `hf download --repo-type dataset` writes), read offline.
    Injected bug: `_hub_snapshot` returning None (datasets' own offline lookup only) -> "could not load", fails."""
    from tests.hub_cache import add_to_hub_cache, offline_hub

    home = offline_hub(tmp_path / "hf", monkeypatch)
    add_to_hub_cache(home, "someone/tiny-math", {"data/train.jsonl": _jsonl(tmp_path / "src.jsonl")},
                     repo_type="dataset")
    config = DataConfig(benchmarks=[], hf_datasets=["someone/tiny-math"], fields=FIELDS)
    assert [e.uid for e in load_examples(config)] == ["tiny-math:0", "tiny-math:1", "tiny-math:2"]


def test_bad_sources_name_the_field_and_the_fix(tmp_path):
    with pytest.raises(ValueError, match=r"data.hf_datasets: could not load 'nobody/no-such-set'.*hf download"):
        load_examples(DataConfig(benchmarks=[], hf_datasets=["nobody/no-such-set"]))
    with pytest.raises(ValueError, match=r"has no column 'question'.*data.fields.question"):
        load_examples(DataConfig(benchmarks=[], hf_datasets=[str(_jsonl(tmp_path / "x.jsonl"))]))
    with pytest.raises(ConfigError, match="hf_datasets"):
        DataConfig(benchmarks=[], hf_datasets=[""])
