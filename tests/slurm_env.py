"""Fakes for testing which environment slurm/env.sh picks: a GPU node (an ``nvidia-smi`` on PATH that
lists GPUs) and checkout environments whose interpreter has a CPU-only or a CUDA torch.

The interpreters are this test's own Python (torch 2.13.0+cpu); the "CUDA" one puts a package named
``torch`` first on its path that holds only a ``version.py`` as CUDA builds write it (``cuda = '13.0'``),
which is all env.sh reads (it never imports torch)."""

from __future__ import annotations

import stat
import sys
from pathlib import Path


def executable(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def fake_gpu_node(root: Path, gpus: int = 8) -> Path:
    """A directory holding an ``nvidia-smi`` whose ``-L`` lists ``gpus`` GPUs; put it first on PATH."""
    lines = "".join(f"echo 'GPU {i}: NVIDIA H200 (UUID: GPU-fake-{i})'\n" for i in range(gpus))
    executable(root / "nvidia-smi", f"#!/bin/sh\n{lines}")
    return root


def fake_venv(root: Path, *, cuda: bool, cli: str | None = None) -> Path:
    """``root/bin/python`` (and ``root/bin/megatron-gtpo``: ``cli`` or a no-op): this interpreter,
    with a CUDA build's torch/version.py first on its path when ``cuda``."""
    path = ""
    if cuda:
        fake = root / "fake-site"
        (fake / "torch").mkdir(parents=True, exist_ok=True)
        (fake / "torch" / "__init__.py").write_text("")
        (fake / "torch" / "version.py").write_text(
            "from typing import Optional\n__version__ = '2.13.0'\ncuda: Optional[str] = '13.0'\n")
        path = f'PYTHONPATH="{fake}${{PYTHONPATH:+:$PYTHONPATH}}" '
    executable(root / "bin" / "python", f'#!/bin/sh\n{path}exec "{sys.executable}" "$@"\n')
    executable(root / "bin" / "megatron-gtpo", cli or "#!/bin/sh\nexit 0\n")
    return root
