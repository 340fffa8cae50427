"""slurm/env.sh's choice of environment, sourced the way the batch scripts source it (bash, the
variables SLURM sets): GPU jobs use .venv-gpu (scripts/setup_gpu.sh) when it exists, and a CPU-only
torch on a node whose nvidia-smi lists GPUs is refused with the variable and the fix named.
(The same refusal through a real sbatch: tests/e2e/test_slurm_scripts.py.)"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.helpers import REPO
from tests.slurm_env import fake_gpu_node, fake_venv


def source_env(repo: Path, *, gpu_node: Path | None, **env: str) -> subprocess.CompletedProcess:
    """Sources slurm/env.sh with MGTPO_REPO=``repo``; prints the interpreter and command it chose."""
    script = f'source "{REPO}/slurm/env.sh"; echo "PY=$MGTPO_PYTHON"; echo "CLI=$MGTPO_CLI"'
    path = f"{gpu_node}:{os.environ['PATH']}" if gpu_node else os.environ["PATH"]
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "MGTPO", "GPUS_PER_NODE"))}
    full = {**base, "PATH": path, "SLURM_JOB_ID": "7", "SLURM_JOB_NAME": "t", "SLURM_GPUS_ON_NODE": "8",
            "MGTPO_REPO": str(repo), "RUNS_DIR": str(repo / "runs"), **env}
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=full, timeout=60)


@pytest.fixture
def repo(tmp_path) -> Path:
    """A checkout with only the CPU environment (make setup): torch+cpu."""
    fake_venv(tmp_path / "repo" / ".venv", cuda=False)
    return tmp_path / "repo"


def test_cpu_torch_on_a_gpu_node_is_refused(repo, tmp_path):
    proc = source_env(repo, gpu_node=fake_gpu_node(tmp_path / "bin"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert (f"MGTPO_PYTHON={repo}/.venv/bin/python has a CPU-only torch (2.13.0+cpu), but this node has 8 GPU(s) "
            "and the job asks for 8: it would train on the CPU. Run scripts/setup_gpu.sh") in proc.stderr
    assert "PY=" not in proc.stdout
    # an interpreter set by hand is checked the same way
    proc = source_env(repo, gpu_node=fake_gpu_node(tmp_path / "bin"), MGTPO_PYTHON=str(repo / ".venv/bin/python"),
                      MGTPO_CLI=str(repo / ".venv/bin/megatron-gtpo"))
    assert proc.returncode == 2 and "has a CPU-only torch" in proc.stderr


def test_gpu_jobs_use_the_gpu_environment_when_it_exists(repo, tmp_path):
    fake_venv(repo / ".venv-gpu", cuda=True)
    proc = source_env(repo, gpu_node=fake_gpu_node(tmp_path / "bin"))
    assert proc.returncode == 0, proc.stderr
    assert f"PY={repo}/.venv-gpu/bin/python" in proc.stdout and f"CLI={repo}/.venv-gpu/bin/megatron-gtpo" in proc.stdout


def test_cpu_jobs_keep_the_cpu_environment(repo, tmp_path):
    fake_venv(repo / ".venv-gpu", cuda=True)
    proc = source_env(repo, gpu_node=fake_gpu_node(tmp_path / "bin"), GPUS_PER_NODE="0")
    assert proc.returncode == 0, proc.stderr
    assert f"PY={repo}/.venv/bin/python" in proc.stdout  # the official vLLM of .venv-gpu needs a GPU


def test_without_visible_gpus_nothing_is_checked(repo):
    """No nvidia-smi (the local test cluster's fake GPUs, or a node without the driver): nothing to compare with."""
    proc = source_env(repo, gpu_node=None)
    assert proc.returncode == 0, proc.stderr
    assert f"PY={repo}/.venv/bin/python" in proc.stdout
