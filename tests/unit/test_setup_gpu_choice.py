"""scripts/gpu_choice.sh: which GPU install scripts/setup_gpu.sh picks, from a fake ``nvidia-smi``
and the NGC container's environment marker (the real script function, run by bash)."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.helpers import REPO


def choose(tmp_path, *, driver: str | None = None, **env: str) -> tuple[int, str]:
    bin_dir = tmp_path / f"bin{len(list(tmp_path.iterdir()))}"  # a fresh PATH entry per call
    bin_dir.mkdir()
    if driver is not None:  # what `nvidia-smi --query-gpu=driver_version --format=csv,noheader` prints per GPU
        smi = bin_dir / "nvidia-smi"
        smi.write_text(f"#!/bin/sh\nprintf '{driver}\\n{driver}\\n'\n")
        smi.chmod(0o755)
    base = {k: v for k, v in os.environ.items() if k not in ("NVIDIA_PYTORCH_VERSION", "MGTPO_GPU_INSTALL")}
    proc = subprocess.run(["bash", "-c", f"source {REPO}/scripts/gpu_choice.sh && gpu_install_choice"],
                          env={**base, "PATH": f"{bin_dir}:/usr/bin:/bin", **env}, capture_output=True, text=True)
    return proc.returncode, proc.stdout.strip()


@pytest.mark.parametrize("driver,kind", [("580.82.07", "cu130"), ("590.10", "cu130"), ("570.133.20", "cu12"),
                                         ("535.247.01", "cu12"), ("525.60.13", "cu12")])
def test_the_driver_version_picks_the_wheel_set(tmp_path, driver, kind):
    """Injected: the CUDA 13 threshold at 570 -> a 570 driver gets cu130, this fails."""
    rc, out = choose(tmp_path, driver=driver)
    assert rc == 0 and out.split("\t")[0] == kind and driver in out, out


def test_an_ngc_container_is_used_as_it_is(tmp_path):
    rc, out = choose(tmp_path, driver="550.54.15", NVIDIA_PYTORCH_VERSION="25.04")
    assert rc == 0 and out.startswith("container\tNGC PyTorch container 25.04"), out


def test_intent_overrides_probing_and_bad_input_is_refused(tmp_path):
    assert choose(tmp_path, driver="580.1", MGTPO_GPU_INSTALL="cu12") == (0, "cu12\tMGTPO_GPU_INSTALL=cu12 (chosen by intent)")
    rc, out = choose(tmp_path, MGTPO_GPU_INSTALL="cuda13")
    assert rc == 1 and "not one of container, cu130, cu12" in out
    rc, out = choose(tmp_path, driver="470.256.02")
    assert rc == 1 and "older than CUDA 12's minimum" in out
    rc, out = choose(tmp_path)  # no nvidia-smi at all (a login node)
    assert rc == 1 and "no driver version" in out and "MGTPO_GPU_INSTALL" in out


def test_setup_gpu_says_what_it_picked_and_refuses_what_cannot_work(tmp_path):
    """The real scripts/setup_gpu.sh up to its first install step: a container whose torch is not the
    lock's (vLLM's kernels are built for it) and the CUDA 12 kind without its lock stop with the
    reason, before any venv or download."""
    fake = tmp_path / "python3"
    fake.write_text("#!/bin/sh\necho 2.10.0a0+nv25.04\n")  # answers the script's torch-version probe
    fake.chmod(0o755)
    env = {**os.environ, "MEGATRON_GTPO_GPU_VENV": str(tmp_path / "venv"), "PYTHON": str(fake)}
    run = lambda **extra: subprocess.run(["bash", str(REPO / "scripts/setup_gpu.sh")], env={**env, **extra},  # noqa: E731
                                         capture_output=True, text=True, timeout=60)
    proc = run(NVIDIA_PYTORCH_VERSION="25.04")
    assert proc.returncode == 1 and "install: container (NGC PyTorch container 25.04" in proc.stdout, proc
    assert "this container's torch is 2.10.0a0+nv25.04, but vLLM 0.32.0's compiled kernels are built for torch 2.13.0" \
        in proc.stderr, proc.stderr
    proc = run(MGTPO_GPU_INSTALL="cu12")
    assert proc.returncode == 1 and "requirements/gpu-cu12.lock is not resolved yet" in proc.stderr, proc
    assert not (tmp_path / "venv").exists()
