"""tests/shards.py and tests/warm.py: how scripts/test.sh splits the suite and forks its commands."""

from __future__ import annotations

import json
import os
import sys
import time
from types import SimpleNamespace

import pytest

from tests import shards
from tests.helpers import child_env, kill_tree, run_group
from tests.warm import WARM


def _item(nodeid: str, *fixtures: tuple[str, str, str]):
    """A collected test with ``(name, scope, baseid)`` fixtures, as pytest's items carry them."""
    defs = {name: [SimpleNamespace(scope=scope, baseid=baseid)] for name, scope, baseid in fixtures}
    return SimpleNamespace(nodeid=nodeid, _fixtureinfo=SimpleNamespace(name2fixturedefs=defs))


SHARED = ("run_canon", "session", "tests/e2e")
ITEMS = [
    _item("tests/e2e/test_a.py::t1", SHARED), _item("tests/e2e/test_b.py::t1", SHARED),
    _item("tests/e2e/test_c.py::t1", ("tmp_path", "function", "")),
    _item("tests/e2e/test_slurm_x.py::t1"), _item("tests/e2e/test_slurm_y.py::t1"),
    _item("tests/unit/test_u.py::t1", ("monkeypatch", "function", "")),
]
COSTS = {"tests/e2e/test_a.py": 50, "tests/e2e/test_b.py": 50, "tests/e2e/test_c.py": 90,
         "tests/e2e/test_slurm_x.py": 30, "tests/e2e/test_slurm_y.py": 30, "tests/unit/test_u.py": 1}


def test_files_sharing_a_run_or_the_slurm_layer_stay_in_one_shard():
    """Catches a split that builds a shared session run twice (once per shard) or starts two
    local SLURM clusters at once."""
    where = shards.assign(ITEMS, 2, COSTS)
    assert where["tests/e2e/test_a.py"] == where["tests/e2e/test_b.py"]
    assert where["tests/e2e/test_slurm_x.py"] == where["tests/e2e/test_slurm_y.py"]
    assert set(where.values()) == {0, 1}


def test_groups_are_balanced_by_cost_and_the_split_is_deterministic():
    """Catches an unbalanced split (one shard holding every slow group) or one that changes
    between the two shard processes (a test run twice or never)."""
    where = shards.assign(ITEMS, 2, COSTS)
    load = [sum(c for f, c in COSTS.items() if where[f] == s) for s in (0, 1)]
    assert sorted(load) == [101, 150]  # {a, b} + unit | c + slurm: the best split of these groups
    assert shards.assign(list(reversed(ITEMS)), 2, COSTS) == where
    every = [f for f in COSTS if where[f] in (0, 1)]
    assert sorted(every) == sorted(COSTS)


def test_shard_argument_errors_name_the_form():
    with pytest.raises(ValueError, match="expected K/N"):
        shards.parse("2")
    with pytest.raises(ValueError, match="between 1 and N"):
        shards.parse("3/2")


def test_the_report_names_a_missing_shard(tmp_path, capsys):
    assert shards.main(["report", str(tmp_path / "junit-2.xml")]) == 1
    assert "a shard did not finish" in capsys.readouterr().err


def test_warm_runs_only_module_commands_with_import_time_settings_unchanged(monkeypatch):
    """Catches a warm fork served with a setting that its libraries read at import (it would
    silently not apply), or a command that is not one of the project's modules."""
    monkeypatch.setattr(WARM, "env", {**child_env(), "HF_HUB_OFFLINE": "1"})  # as the server's
    monkeypatch.setattr(WARM, "broken", False)
    env = dict(WARM.env)
    assert WARM.eligible([sys.executable, "-m", "megatron_gtpo.cli", "train"], env) is None
    assert "not python -m" in WARM.eligible(["megatron-gtpo", "train"], env)
    assert "not python -m" in WARM.eligible([sys.executable, "-m", "tests.e2e.mlflow_server"], env)
    assert "HF_HUB_OFFLINE" in WARM.eligible([sys.executable, "-m", "megatron_gtpo.cli"], {**env, "HF_HUB_OFFLINE": "0"})
    for runtime in ("MGTPO_LAUNCHER", "VLLM_ENABLE_V1_MULTIPROCESSING", "TORCHELASTIC_RUN_ID", "OMP_NUM_THREADS"):
        assert WARM.eligible([sys.executable, "-m", "megatron_gtpo.cli"], {**env, runtime: "x"}) is None, runtime


def test_a_warm_command_matches_a_fresh_one(tmp_path):
    """Catches a warm child that loses the request's arguments, environment, working directory,
    output or exit code."""
    script = tmp_path / "probe.py"
    script.write_text("import json, os, sys\n"
                      "print('OUT ' + json.dumps([sys.argv[1:], os.environ.get('PROBE'), os.getcwd()]))\n"
                      "print('to stderr', file=sys.stderr)\nsys.exit(3)\n")
    cmd = [sys.executable, "-m", "megatron_gtpo.parallel.launch", "--nproc=1", "--preload=", str(script), "a", "b"]
    got = {}
    for warm in (False, True):
        proc = run_group(cmd, timeout=300, env=child_env(PROBE="x", MGTPO_LAUNCHER="fork"), cwd=tmp_path, warm=warm)
        line = [json.loads(ln[4:]) for ln in proc.stdout.splitlines() if ln.startswith("OUT ")]
        got[warm] = (proc.returncode, line, "to stderr" in proc.stderr, "rank 0 failed (exit code 3)" in proc.stderr)
    assert got[True] == got[False] == (1, [[["a", "b"], "x", str(tmp_path)]], True, True)
    assert WARM.proc is not None and WARM.proc.poll() is None, "the warm server did not serve it"


def test_a_background_warm_run_is_signalled_and_reaped_as_a_popen(tmp_path):
    """runs.start's warm path. Catches a background child whose stdout and stderr overwrite each
    other in the shared log (two descriptors on one file), that a signal does not reach, whose
    SIGKILL is reported as another code, or a second warm request sent while it runs (the server
    serves one child at a time: that request would wait for the first to end)."""
    script = tmp_path / "bg.py"
    script.write_text("import sys, time\nprint('out 1', flush=True)\nprint('err 2', file=sys.stderr, flush=True)\n"
                      "print('out 3', flush=True)\ntime.sleep(600)\n")
    cmd = [sys.executable, "-m", "megatron_gtpo.parallel.launch", "--nproc=1", "--preload=", str(script)]
    log, env = tmp_path / "bg.log", child_env(MGTPO_LAUNCHER="fork")
    proc = WARM.start(cmd, env=env, cwd=tmp_path, log=log)
    assert proc is not None, WARM.fresh
    try:
        deadline = time.monotonic() + 120
        while "out 3" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        assert "background run" in WARM.eligible(cmd, env)
        kill_tree(proc.pid)
        assert proc.wait(timeout=60) == -9 and proc.poll() == -9
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
            proc.wait()
    assert [ln for ln in log.read_text().splitlines() if ln[:4] in ("out ", "err ")] == ["out 1", "err 2", "out 3"]
    assert WARM.eligible(cmd, env) is None


def test_library_paths_an_engine_writes_are_restored_for_later_runs(monkeypatch):
    """Catches the pytest process passing on what importing vLLM (OpenCV's LD_LIBRARY_PATH) or an
    in-process engine (LD_PRELOAD of tcmalloc) wrote into os.environ: every later launched run would
    get that allocator and library path, and start fresh instead of warm."""
    from tests import conftest

    for key in conftest.ENGINE_WRITES:
        monkeypatch.setitem(conftest._SESSION_ENV, key, None if key == "LD_PRELOAD" else "/the/user/lib")
        monkeypatch.setenv(key, "/written/by/an/engine")
    conftest._restore_engine_writes()
    assert "LD_PRELOAD" not in os.environ and os.environ["LD_LIBRARY_PATH"] == "/the/user/lib"
    assert "LD_PRELOAD" not in child_env() and child_env()["LD_LIBRARY_PATH"] == "/the/user/lib"


def _record(tmp_path, name: str, collected: list[str], ran: list[str]) -> str:
    path = tmp_path / name
    shards.write_record(str(path), shard=None, collected=collected, ran=ran)
    return str(path)


def test_check_names_lost_twice_and_differently_collected_tests(tmp_path):
    """The shards' check (scripts/test.sh, after the report) on records with each fault: a test no
    shard ran, a test two shards ran, a shard that collected another set of tests."""
    ids = ["tests/unit/a.py::t1", "tests/unit/a.py::t2", "tests/e2e/b.py::t"]
    good = [_record(tmp_path, "1.json", ids, ids[:2]), _record(tmp_path, "2.json", ids, ids[2:])]
    assert shards.check(good) == []
    lost = [good[0], _record(tmp_path, "2l.json", ids, [])]
    assert shards.check(lost) == ["1 test(s) collected but run by no shard: tests/e2e/b.py::t"]
    twice = [good[0], _record(tmp_path, "2t.json", ids, ids[1:])]
    assert shards.check(twice) == ["1 test(s) run by more than one shard: tests/unit/a.py::t2"]
    other = [good[0], _record(tmp_path, "2o.json", ids[:2], ids[2:])]
    assert any("collected 1 test(s) differently" in p for p in shards.check(other))


def test_real_shards_run_each_collected_test_exactly_once(tmp_path):
    """Two real ``pytest --shard=K/2 --shard-record`` processes on a small tree, then
    ``python -m tests.shards check`` on their records, as scripts/test.sh does.

    Injected: tests/conftest.py keeping ``<= k - 1`` instead of ``== k - 1`` (shard 2 also runs
    shard 1's files): check exits 1 naming the tests run twice, and this fails."""
    (tmp_path / "conftest.py").write_text("from tests.conftest import *  # noqa: F401,F403  the real hooks\n")
    for name in ("a", "b", "c"):
        (tmp_path / "tests" / "unit").mkdir(parents=True, exist_ok=True)
        (tmp_path / "tests" / "unit" / f"test_{name}.py").write_text("def test_1(): pass\n\ndef test_2(): pass\n")
    env = child_env(MGTPO_TEST_GUARDS="0")
    records = []
    for k in (1, 2):
        records.append(str(tmp_path / f"shard-{k}.json"))
        proc = run_group([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
                          "-c", "/dev/null", f"--shard={k}/2", f"--shard-record={records[-1]}", "tests"],
                         timeout=120, env=env, cwd=tmp_path)
        assert proc.returncode in (0, 5), proc.stdout + proc.stderr  # 5: a shard with no tests
    proc = run_group([sys.executable, "-m", "tests.shards", "check", *records], timeout=60, env=child_env(),
                     cwd=shards.COSTS_FILE.parents[2])
    assert proc.returncode == 0 and "each of the 6 collected tests exactly once" in proc.stdout, proc.stdout
