"""Reading and writing Hugging Face safetensors checkpoints one tensor at a time.

``HFReader`` validates a checkpoint up front from the safetensors headers alone (index, shard
files, names, shapes) so that a bad input fails before anything is written, then reads single
tensors, opening the shard for each read so that no file stays memory-mapped (peak memory
stays at about one tensor). ``HFWriter`` writes shards as tensors arrive and the index last.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megatron_gtpo.utils.configuration import ConfigError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# Files that are weights (never copied as "tokenizer/config" side files).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".distcp", ".index.json")


class HFReader:
    """Lazy access to the tensors of an HF checkpoint directory (single file or sharded)."""

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        self.weight_map = self._read_weight_map()
        self._headers: dict[str, tuple[str, list[int]]] = {}
        for file in sorted(set(self.weight_map.values())):
            self._read_header(file)
        missing = sorted(set(self.weight_map) - set(self._headers))
        if missing:
            raise ConfigError(f"{self.dir / INDEX_NAME}: tensor {missing[0]!r} is listed for "
                              f"{self.weight_map[missing[0]]} but that file does not contain it; "
                              "the index does not match the shards")

    def _read_weight_map(self) -> dict[str, str]:
        index = self.dir / INDEX_NAME
        if index.is_file():
            try:
                data = json.loads(index.read_text())
                weight_map = data["weight_map"]
                if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                    raise TypeError("weight_map must map tensor names to file names")
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as err:
                raise ConfigError(f"{index} is corrupt ({type(err).__name__}: {err}); "
                                  "re-download the checkpoint or delete the index for a single-file model") from None
            return weight_map
        single = self.dir / SINGLE_NAME
        if single.is_file():
            with safe_open(single, framework="pt") as handle:
                return {name: SINGLE_NAME for name in handle.keys()}
        raise ConfigError(f"{self.dir} holds neither {SINGLE_NAME} nor {INDEX_NAME}; "
                          "pass a Hugging Face checkpoint saved with safetensors")

    def _read_header(self, file: str) -> None:
        path = self.dir / file
        if not path.is_file():
            raise ConfigError(f"shard {path} listed in {self.dir / INDEX_NAME} is missing; "
                              "re-download the checkpoint")
        try:
            with safe_open(path, framework="pt") as handle:
                for name in handle.keys():
                    if self.weight_map.get(name) == file:
                        part = handle.get_slice(name)
                        self._headers[name] = (part.get_dtype(), list(part.get_shape()))
        except Exception as err:  # safetensors' SafetensorError derives from Exception only
            raise ConfigError(f"shard {path} is not a readable safetensors file ({err})") from None

    def names(self) -> list[str]:
        return list(self.weight_map)

    def shape(self, name: str) -> list[int]:
        return self._headers[name][1]

    def dtype(self, name: str) -> str:
        """safetensors dtype tag (``F32``, ``BF16`` ...)."""
        return self._headers[name][0]

    def require(self, names: list[str], expected_shapes: dict[str, list[int]] | None = None) -> None:
        """ConfigError naming the first missing tensor or the first shape that contradicts config.json."""
        for name in names:
            if name not in self.weight_map:
                raise ConfigError(f"{self.dir}: tensor {name!r} is missing from the checkpoint "
                                  "(config.json and the weights disagree)")
        for name, shape in (expected_shapes or {}).items():
            if self.shape(name) != list(shape):
                raise ConfigError(f"{self.dir / self.weight_map[name]}: tensor {name!r} has shape "
                                  f"{self.shape(name)} but config.json implies {list(shape)}")

    def get(self, name: str) -> torch.Tensor:
        """Reads one tensor (a private copy; the file is closed again afterwards)."""
        with safe_open(self.dir / self.weight_map[name], framework="pt") as handle:
            return handle.get_tensor(name).clone()


class HFWriter:
    """Writes ``(name, tensor)`` pairs into safetensors shards of at most ``shard_bytes``, then the
    index; a single shard is saved as ``model.safetensors`` without an index (as HF does)."""

    def __init__(self, directory: str | Path, *, shard_bytes: int = 2 << 30):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.shard_bytes = shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._files: list[tuple[str, list[str]]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if self._pending and self._pending_bytes + tensor.nbytes > self.shard_bytes:
            self._flush()
        self._pending[name] = tensor.detach().cpu().contiguous()
        self._pending_bytes += tensor.nbytes
        self.total_bytes += tensor.nbytes

    def _flush(self) -> None:
        name = f"part-{len(self._files):05d}.safetensors"
        save_file(self._pending, self.dir / name, metadata={"format": "pt"})
        self._files.append((name, list(self._pending)))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> None:
        """Writes the last shard and renames shards to HF's ``model-0000i-of-0000n`` scheme."""
        if self._pending or not self._files:
            self._flush()
        if len(self._files) == 1:
            (self.dir / self._files[0][0]).rename(self.dir / SINGLE_NAME)
            self._publish(self.dir / SINGLE_NAME)
            return
        weight_map = {}
        for i, (name, tensors) in enumerate(self._files):
            final = f"model-{i + 1:05d}-of-{len(self._files):05d}.safetensors"
            (self.dir / name).rename(self.dir / final)
            self._publish(self.dir / final)
            weight_map.update({t: final for t in tensors})
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        (self.dir / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")

    def _publish(self, path: Path) -> None:
        """safetensors creates files as 0600; give them the permissions of any other new file."""
        mask = os.umask(0)
        os.umask(mask)
        path.chmod(0o666 & ~mask)


def copy_side_files(src: str | Path, dst: str | Path, *, exclude: tuple[str, ...] = ()) -> list[str]:
    """Copies config.json, tokenizer and generation files (everything that is not weights)."""
    copied = []
    for path in sorted(Path(src).iterdir()):
        if (path.is_file() and not path.name.endswith(_WEIGHT_SUFFIXES) and not path.name.startswith(".")
                and path.name not in exclude):
            shutil.copy2(path, Path(dst) / path.name)
            copied.append(path.name)
    return copied


def torch_dtype_name(dtype: str | torch.dtype) -> str:
    """``"BF16"``/``torch.bfloat16`` -> ``"bfloat16"`` (for manifests and reports)."""
    if isinstance(dtype, torch.dtype):
        return str(dtype).removeprefix("torch.")
    return {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}.get(dtype, dtype.lower())
