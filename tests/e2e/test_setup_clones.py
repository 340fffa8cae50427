"""scripts/setup.sh on two copies of this checkout at once: each gets its own .venv on one shared base
environment, and each .venv runs its own copy's code (python and the megatron-gtpo command) from any
directory. Also: an old-style .venv link is replaced without touching its target, a second set-up is
quick, and the wheel carries the benchmark files and the license without setuptools warnings.

The base (requirements/cpu.lock) is the one `make test` set up; if it is missing, the first set-up
here builds it (about 4 minutes of pip).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from tests.helpers import REPO

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SETUP_TIMEOUT = 840  # the base is already built (make test runs setup first): a clone only links it


def copy_checkout(dst: Path, marker: str) -> Path:
    """Copies the checkout's files (tracked and untracked, not ignored) and makes its package announce
    ``marker`` on import, so a run shows whose code it imported."""
    names = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z", "-co", "--exclude-standard"],
                           capture_output=True, text=True, check=True).stdout.split("\0")
    for name in filter(None, names):
        if (REPO / name).is_file():
            (dst / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, dst / name)
    with (dst / "megatron_gtpo" / "__init__.py").open("a") as init:
        init.write(f'\nimport sys as _sys\n_sys.stderr.write("clone marker: {marker}\\n")\n')
    return dst


def clean_env() -> dict[str, str]:
    """This process's environment without what would make a run import another checkout's code."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "MEGATRON_GTPO_VENV")}


def run(cmd: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return run_group(cmd, cwd=cwd, env=clean_env(), timeout=timeout)


@pytest.fixture(scope="module")
def clones(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("clones")
    repos = {m: copy_checkout(root / m / "megatron-gtpo", m) for m in ("a", "b")}
    # b carries a .venv of the old layout: a link to an environment outside the checkout.
    old_env = root / "old-shared-venv"
    old_env.mkdir()
    (old_env / "sentinel").write_text("keep me")
    (repos["b"] / ".venv").symlink_to(old_env)
    procs = {m: subprocess.Popen([str(repo / "scripts" / "setup.sh")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 text=True, env=clean_env(), cwd=root)
             for m, repo in repos.items()}
    for m, proc in procs.items():
        out = proc.communicate(timeout=SETUP_TIMEOUT)[0]
        (root / f"setup-{m}.log").write_text(out)
        assert proc.returncode == 0, f"set-up of clone {m} failed:\n{out[-6000:]}"
        assert "[setup] ready:" in out, out
    assert sorted(p.name for p in old_env.iterdir()) == ["sentinel"]  # the old link's target is untouched
    return repos


def test_each_clone_runs_its_own_code(clones, tmp_path):
    for marker, repo in clones.items():
        venv = repo / ".venv"
        assert venv.is_dir() and not venv.is_symlink()
        proc = run([str(venv / "bin" / "python"), "-c", "import megatron_gtpo; print(megatron_gtpo.__file__)"],
                   cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == str(repo / "megatron_gtpo" / "__init__.py")
        assert proc.stderr.strip().splitlines() == [f"clone marker: {marker}"]
        cli = run([str(venv / "bin" / "megatron-gtpo"), "--help"], cwd=tmp_path)
        assert cli.returncode == 0 and "usage" in cli.stdout.lower(), cli.stderr
        assert cli.stderr.strip().splitlines() == [f"clone marker: {marker}"]
        # The base's commands are re-pointed at this checkout's interpreter.
        assert (venv / "bin" / "torchrun").read_text().splitlines()[0] == f"#!{venv}/bin/python"


def test_clones_share_one_base(clones, tmp_path):
    code = "import importlib.util as u; print(u.find_spec('torch').origin, u.find_spec('megatron.core').origin)"
    found = {m: run([str(repo / ".venv" / "bin" / "python"), "-c", code], cwd=tmp_path).stdout.split()
             for m, repo in clones.items()}
    assert found["a"] == found["b"] and len(found["a"]) == 2
    assert not any(path.startswith(str(repo)) for repo in clones.values() for path in found["a"])


def test_second_setup_is_quick(clones):
    start = time.monotonic()
    proc = run([str(clones["a"] / "scripts" / "setup.sh")], cwd=clones["a"])
    elapsed = time.monotonic() - start
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("[setup] ready:") and proc.stdout.count("\n") == 1, proc.stdout
    assert elapsed < 15, f"a set-up with nothing to do took {elapsed:.1f} s"  # ~0.3 s unloaded


def test_wheel_ships_benchmarks_and_license_without_warnings(clones, tmp_path):
    repo = clones["a"]
    code = f"from setuptools import build_meta; print(build_meta.build_wheel({str(tmp_path)!r}))"
    proc = run([sys.executable, "-c", code], cwd=repo)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Deprecat" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    with zipfile.ZipFile(tmp_path / proc.stdout.split()[-1]) as wheel:
        names = set(wheel.namelist())
        metadata = wheel.read("megatron_gtpo-0.1.0.dist-info/METADATA").decode()
    data = repo / "megatron_gtpo" / "data" / "benchmarks"
    shipped = {p.relative_to(repo).as_posix() for p in data.rglob("*") if p.is_file()}
    assert len(shipped) == 8 and shipped <= names
    assert "megatron_gtpo-0.1.0.dist-info/licenses/LICENSE" in names and "License-Expression: Apache-2.0" in metadata
