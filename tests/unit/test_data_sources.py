"""Dataset loaders: the real benchmark files, user jsonl/parquet files with a field mapping, and
the errors a user sees for bad files or configs."""

import json

import pytest

from megatron_gtpo.data import (BENCHMARKS, SHIPPED_DATA, DataConfig, FieldMap, canonical_benchmark, load_benchmark,
                                read_examples)
from megatron_gtpo.utils.configuration import ConfigError, build

ROWS = {"gsm8k_train": 7473, "gsm8k": 1319, "math500": 500, "aime24": 30, "aime25": 30, "amc23": 40,
        "mmlu_stem": 3018}  # from megatron_gtpo/data/benchmarks/README.md


@pytest.mark.parametrize("name", sorted(ROWS))
def test_benchmark_row_counts_and_schema(name):
    examples = load_benchmark(name, data_root=SHIPPED_DATA)
    assert len(examples) == ROWS[name]
    assert len({e.uid for e in examples}) == len(examples)
    assert all(e.question.strip() and e.gold and e.task == BENCHMARKS[name].task for e in examples)


def test_benchmark_fields_are_read_as_documented():
    gsm = load_benchmark("gsm8k", data_root=SHIPPED_DATA)[0]
    assert gsm.question.startswith("Janet") and gsm.gold.endswith("#### 18") and gsm.uid == "gsm8k:0"
    math = load_benchmark("math500", data_root=SHIPPED_DATA)[0]
    assert math.question.startswith("Convert the point") and math.gold == "\\left( 3, \\frac{\\pi}{2} \\right)"
    assert load_benchmark("aime24", data_root=SHIPPED_DATA)[0].uid == "aime24:60"  # its own id column
    assert load_benchmark("aime25", data_root=SHIPPED_DATA)[0].gold == "70"
    amc = load_benchmark("amc23", data_root=SHIPPED_DATA, limit=2)
    assert [e.gold for e in amc] == ["27", "36"]  # stored as floats 27.0, 36.0
    mmlu = load_benchmark("mmlu", data_root=SHIPPED_DATA, limit=1)[0]
    assert mmlu.gold == "C" and len(mmlu.choices) == 4 and mmlu.uid == "mmlu_stem:0"


def test_aliases_and_unknown_names():
    assert canonical_benchmark("MMLU") == "mmlu_stem" and canonical_benchmark("amc") == "amc23"
    with pytest.raises(ValueError, match="unknown benchmark 'gsm9k'.*gsm8k"):
        canonical_benchmark("gsm9k")


def test_user_jsonl_with_field_mapping(tmp_path):
    path = tmp_path / "mine.jsonl"
    rows = [{"q": "2+2?", "sol": 4, "kind": "aime", "id": "a"},
            {"q": "pick", "sol": 1, "kind": "mmlu", "id": "b", "opts": ["x", "y"]}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    fields = FieldMap(question="q", gold="sol", task="kind", uid="id")
    first = read_examples(path, fields=fields, task="gsm8k", limit=1)
    assert len(first) == 1 and first[0].gold == "4" and first[0].task == "aime" and first[0].uid == "mine:a"
    mc = read_examples(path, fields=FieldMap(question="q", gold="sol", task="kind", choices="opts"), task="gsm8k")
    assert mc[1].gold == "B" and mc[1].choices == ("x", "y")  # an integer MMLU gold is a 0-based index
    assert mc[0].choices == ()  # rows without options in a mixed file are free-form


def test_user_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "mine.parquet"
    pq.write_table(pa.table({"problem": ["1/2 + 1/2?"], "answer": ["1"]}), path)
    (example,) = read_examples(path, fields=FieldMap(question="problem"), task="math")
    assert (example.question, example.gold, example.task, example.uid) == ("1/2 + 1/2?", "1", "math", "mine:0")


def test_bad_user_files_are_explained(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"problem": "x", "answer": "1"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl row 0 has no column 'question'.*data.fields.question"):
        read_examples(path, fields=FieldMap(), task="math")
    path.write_text('{"question": "x", "answer": "1"}\n{not json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2 is not valid JSON"):
        read_examples(path, fields=FieldMap(), task="math")
    with pytest.raises(FileNotFoundError, match="data.paths"):
        read_examples(tmp_path / "missing.jsonl", fields=FieldMap(), task="math")
    path.write_text(json.dumps({"question": "x", "answer": "1", "t": "chem"}) + "\n")
    with pytest.raises(ValueError, match="task 'chem'"):
        read_examples(path, fields=FieldMap(task="t"), task="math")


@pytest.mark.parametrize("data,message", [
    ({"benchmarks": ["gsm9k"]}, r"data\.benchmarks='gsm9k'"),
    ({"benchmarks": [], "paths": []}, r"data\.benchmarks"),
    ({"paths": ["x.csv"]}, r"data\.paths='x.csv'"),
    ({"task": "chem"}, r"data\.task='chem'"),
    ({"max_prompt_tokens": 0}, r"data\.max_prompt_tokens"),
    ({"template": "fancy"}, r"data\.template"),
    ({"fields": {"question": ""}}, r"data\.fields\.question"),
    ({"shufle": True}, r"unknown key data\.shufle"),
])
def test_data_config_rejects_bad_values(data, message):
    with pytest.raises(ConfigError, match=message):
        build(DataConfig, data, "data")


def test_data_config_default_is_the_paper_training_set():
    cfg = DataConfig()
    assert cfg.benchmarks == ["gsm8k_train"] and cfg.template == "reasoning_tags"
