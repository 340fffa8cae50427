"""The benchmark files ship inside the package: found with nothing beside the checkout, overridable by
$MEGATRON_GTPO_DATA, and all of them declared as package data."""

import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import megatron_gtpo
from megatron_gtpo.data import BENCHMARKS, SHIPPED_DATA, default_data_root, load_benchmark
from tests.helpers import REPO
from tests.unit.test_data_sources import ROWS

PACKAGE = Path(megatron_gtpo.__file__).resolve().parent


def test_default_root_is_the_shipped_folder(monkeypatch):
    monkeypatch.delenv("MEGATRON_GTPO_DATA", raising=False)
    assert default_data_root() == SHIPPED_DATA == PACKAGE / "data" / "benchmarks"
    readme = (SHIPPED_DATA / "README.md").read_text()
    for bench in BENCHMARKS.values():
        assert (SHIPPED_DATA / bench.file).is_file() and bench.file in readme  # each file and its provenance
    assert load_benchmark("aime25")[0].gold == "70"


def test_env_variable_points_the_loader_elsewhere(monkeypatch, tmp_path):
    (tmp_path / "gsm8k").mkdir()
    rows = [{"question": "1+1?", "answer": "two\n#### 2"}, {"question": "2+2?", "answer": "#### 4"}]
    (tmp_path / "gsm8k" / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setenv("MEGATRON_GTPO_DATA", str(tmp_path))
    assert default_data_root() == tmp_path
    assert [(e.question, e.gold) for e in load_benchmark("gsm8k")] == [("1+1?", "two\n#### 2"), ("2+2?", "#### 4")]
    assert len(load_benchmark("gsm8k", data_root=SHIPPED_DATA)) == ROWS["gsm8k"]  # an explicit root wins
    with pytest.raises(FileNotFoundError, match=f"{tmp_path}/math500/test.jsonl does not exist.*MEGATRON_GTPO_DATA"):
        load_benchmark("math500")


def test_a_copy_of_the_package_alone_loads_every_benchmark(tmp_path):
    # The package copied to a fresh directory (nothing beside it), imported from a neutral directory.
    site = tmp_path / "site"
    shutil.copytree(PACKAGE, site / "megatron_gtpo", ignore=shutil.ignore_patterns("__pycache__"))
    code = ("import json, megatron_gtpo; from megatron_gtpo.data import BENCHMARKS, load_benchmark; "
            "print(json.dumps([megatron_gtpo.__file__, {n: len(load_benchmark(n)) for n in BENCHMARKS}]))")
    env = {k: v for k, v in os.environ.items() if k != "MEGATRON_GTPO_DATA"} | {"PYTHONPATH": str(site)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    origin, counts = json.loads(proc.stdout.splitlines()[-1])
    assert origin == str(site / "megatron_gtpo" / "__init__.py")
    assert counts == ROWS


def test_every_shipped_file_is_declared_package_data():
    globs = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    declared = {p for pattern in globs["megatron_gtpo.data"] for p in (PACKAGE / "data").glob(pattern)}
    shipped = {p for p in SHIPPED_DATA.rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    assert shipped and declared == shipped
