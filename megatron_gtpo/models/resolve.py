"""The one model resolver: what ``model.path`` / ``--model`` names, as a directory.

    "smollm2" | "tiny" | "tiny-char" | "tiny-moe-char"  --built once, cached-->  HF directory
    an HF directory (config.json + safetensors)                 HF directory (as is)
    a hub id "Qwen/Qwen2.5-3B-Instruct"  --HF cache, else fetched (models/hub.py)-->  snapshot directory
    a Megatron checkpoint (converted or a training step)        as is for the trainer; for vLLM
                                                                  ``as_hf_dir`` converts it with the
                                                                  converter's own function

Used by the learner, evaluation, the dry-run and preflight.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from megatron_gtpo.models.hub import hub_snapshot, is_hub_id
from megatron_gtpo.models.smollm2 import ensure_smollm2
from megatron_gtpo.models.tiny import ensure_tiny, ensure_tiny_char, ensure_tiny_moe_char
from megatron_gtpo.utils.configuration import ConfigError
from megatron_gtpo.convert.offline import megatron_to_hf

BUILT_IN = {"smollm2": ensure_smollm2, "tiny": ensure_tiny, "tiny-char": ensure_tiny_char,
            "tiny-moe-char": ensure_tiny_moe_char}
"""Built-in model names -> functions that build (once) and return their HF directory."""

_MEGATRON_MARKERS = ("megatron_gtpo.json", ".metadata", "model/.metadata")


def resolve_model(path: str, cache_dir: str | os.PathLike | None = None, *,
                  hub_files: tuple[str, ...] | None = None) -> Path:
    """The directory ``path`` names: a built-in model (built and cached on first use), an existing
    directory (HF model or Megatron checkpoint) or a Hugging Face hub id (``org/name``: the cached
    snapshot, fetched if missing, of ``hub_files`` only when given: models/hub.py).
    FileNotFoundError names the value and the choices."""
    if path in BUILT_IN:
        return BUILT_IN[path](cache_dir)
    directory = Path(path).expanduser()
    if directory.is_dir():
        return directory
    if is_hub_id(path):
        return hub_snapshot(path, hub_files)
    raise FileNotFoundError(f"model.path={path!r}: no such directory; give an HF model directory, a Hugging Face "
                            f"hub id (org/name), a Megatron checkpoint from `megatron-gtpo convert`, or one of "
                            f"{', '.join(BUILT_IN)}")


def is_megatron_checkpoint(path: Path) -> bool:
    """True for a converted Megatron checkpoint or a training step directory."""
    return any((path / marker).is_file() for marker in _MEGATRON_MARKERS)


@contextlib.contextmanager
def as_hf_dir(model: str, *, hf_config: str = "") -> Iterator[Path]:
    """Yields an HF model directory for ``model``. A Megatron checkpoint is converted into a
    temporary HF directory (removed on exit); ``hf_config`` supplies config.json + tokenizer for a
    training checkpoint that lacks them."""
    path = resolve_model(model) if model in BUILT_IN or Path(model).expanduser().is_dir() or is_hub_id(model) \
        else None
    if path is None or not (is_megatron_checkpoint(path) or (path / "config.json").is_file()):
        raise ConfigError(f"model={model!r} is neither an HF model directory (config.json + weights) nor a "
                          f"Megatron checkpoint ({' or '.join(_MEGATRON_MARKERS)}); pass a directory or one of "
                          f"{', '.join(BUILT_IN)}")
    if not is_megatron_checkpoint(path):
        yield path
        return
    tmp = Path(tempfile.mkdtemp(prefix="megatron-gtpo-hf-"))
    try:
        megatron_to_hf(path, tmp / "hf", config_dir=Path(hf_config) if hf_config else path)
        yield tmp / "hf"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
