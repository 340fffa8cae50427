"""Reading and writing Hugging Face safetensors checkpoints one tensor at a time.

``HFReader`` validates a checkpoint up front from the safetensors headers alone (index, shard
files, names, shapes) so that a bad input fails before anything is written, then reads single
tensors, opening the shard for each read so that no file stays memory-mapped (peak memory
stays at about one tensor). ``HFWriter`` streams tensors into safetensors shards (the format's
header is prepended when a shard is complete) and writes the index last.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from megatron_gtpo.utils.configuration import ConfigError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# Files that are weights (never copied as "tokenizer/config" side files).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".distcp", ".index.json")


_ST_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL"}
_TORCH_DTYPES = {tag: dtype for dtype, tag in _ST_DTYPES.items()}


def read_safetensors_header(path: Path) -> tuple[int, dict[str, dict]]:
    """``(data start, {name: {"dtype", "shape", "data_offsets"}})`` of a safetensors file, checked
    against the file size (a truncated or garbled file raises ConfigError naming it)."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as handle:
            length = int.from_bytes(handle.read(8), "little")
            if not 2 <= length <= size - 8:
                raise ValueError(f"header length {length} does not fit a {size}-byte file")
            header = json.loads(handle.read(length))
        header.pop("__metadata__", None)
        body = size - 8 - length
        for name, entry in header.items():
            start, end = entry["data_offsets"]
            numel = 1
            for n in entry["shape"]:
                numel *= n
            if entry["dtype"] not in _TORCH_DTYPES:
                raise ValueError(f"tensor {name!r} has unsupported dtype {entry['dtype']}")
            if not 0 <= start <= end <= body or end - start != numel * _TORCH_DTYPES[entry["dtype"]].itemsize:
                raise ValueError(f"tensor {name!r} lies outside the file (offsets {start}..{end}, {body} data bytes)")
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as err:
        raise ConfigError(f"shard {path} is not a readable safetensors file ({err}); re-download it") from None
    return 8 + length, header


class HFReader:
    """Lazy access to the tensors of an HF checkpoint directory (single file or sharded).

    Headers are parsed here (not with the safetensors library) so that a read is one ``readinto``
    into a fresh tensor: no memory map stays resident and nothing is copied twice.
    """

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        self.weight_map = self._read_weight_map()
        self._headers: dict[str, dict] = {}
        self._data_start: dict[str, int] = {}
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
            return {name: SINGLE_NAME for name in read_safetensors_header(single)[1]}
        raise ConfigError(f"{self.dir} holds neither {SINGLE_NAME} nor {INDEX_NAME}; "
                          "pass a Hugging Face checkpoint saved with safetensors")

    def _read_header(self, file: str) -> None:
        path = self.dir / file
        if not path.is_file():
            raise ConfigError(f"shard {path} listed in {self.dir / INDEX_NAME} is missing; "
                              "re-download the checkpoint")
        data_start, header = read_safetensors_header(path)
        for name, entry in header.items():
            if self.weight_map.get(name) == file:
                self._headers[name] = entry
                self._data_start[name] = data_start

    def names(self) -> list[str]:
        """Every tensor name of the checkpoint."""
        return list(self.weight_map)

    def shape(self, name: str) -> list[int]:
        """Shape of tensor ``name`` from the header (no data read)."""
        return list(self._headers[name]["shape"])

    def dtype(self, name: str) -> str:
        """safetensors dtype tag (``F32``, ``BF16`` ...)."""
        return self._headers[name]["dtype"]

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
        """Reads one tensor into freshly allocated memory."""
        entry = self._headers[name]
        tensor = torch.empty(entry["shape"], dtype=_TORCH_DTYPES[entry["dtype"]])
        start, end = entry["data_offsets"]
        with open(self.dir / self.weight_map[name], "rb") as handle:
            handle.seek(self._data_start[name] + start)
            got = handle.readinto(tensor.reshape(-1).view(torch.uint8).numpy()) if end > start else 0
        if got != end - start:
            raise ConfigError(f"{self.dir / self.weight_map[name]}: tensor {name!r} is truncated")
        return tensor


class _ShardFile:
    """One safetensors file written tensor by tensor: data goes to a body file as it arrives and
    the header (which must come first and list every tensor) is prepended in ``finish``."""

    def __init__(self, path: Path):
        self.path = path
        self.body_path = path.with_name(path.name + ".body")
        self.body = open(self.body_path, "wb")
        self.header: dict[str, dict] = {}
        self.size = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        tensor = tensor.detach().cpu().contiguous()
        data = tensor.reshape(-1).view(torch.uint8).numpy()  # raw little-endian bytes, any dtype
        self.header[name] = {"dtype": _ST_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                             "data_offsets": [self.size, self.size + data.nbytes]}
        self.body.write(data.data)
        self.size += data.nbytes

    def finish(self) -> None:
        self.body.close()
        header = json.dumps({"__metadata__": {"format": "pt"}, **self.header}, separators=(",", ":")).encode()
        header += b" " * (-len(header) % 8)  # 8-byte aligned data, as the safetensors library writes it
        with open(self.path, "wb") as out, open(self.body_path, "rb") as body:
            out.write(len(header).to_bytes(8, "little"))
            out.write(header)
            shutil.copyfileobj(body, out, 16 << 20)
        self.body_path.unlink()


class HFWriter:
    """Writes ``(name, tensor)`` pairs into safetensors shards of at most ``shard_bytes`` (a
    larger tensor gets a shard of its own), then the index; a single shard is saved as
    ``model.safetensors`` without an index, as HF does. Memory: one tensor at a time."""

    def __init__(self, directory: str | Path, *, shard_bytes: int = 5 << 30):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.shard_bytes = shard_bytes
        self._shard: _ShardFile | None = None
        self._files: list[tuple[str, list[str]]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Appends one tensor (written to disk at once; only the header waits for the shard's end)."""
        if self._shard is not None and self._shard.size and self._shard.size + tensor.nbytes > self.shard_bytes:
            self._finish_shard()
        if self._shard is None:
            self._shard = _ShardFile(self.dir / f"part-{len(self._files):05d}.safetensors")
        self._shard.write(name, tensor)
        self.total_bytes += tensor.nbytes

    def _finish_shard(self) -> None:
        self._shard.finish()
        self._files.append((self._shard.path.name, list(self._shard.header)))
        self._shard = None

    def close(self) -> None:
        """Finishes the last shard and renames shards to HF's ``model-0000i-of-0000n`` scheme."""
        if self._shard is None and not self._files:
            self._shard = _ShardFile(self.dir / "part-00000.safetensors")
        if self._shard is not None:
            self._finish_shard()
        if len(self._files) == 1:
            (self.dir / self._files[0][0]).rename(self.dir / SINGLE_NAME)
            return
        weight_map = {}
        for i, (name, tensors) in enumerate(self._files):
            final = f"model-{i + 1:05d}-of-{len(self._files):05d}.safetensors"
            (self.dir / name).rename(self.dir / final)
            weight_map.update({t: final for t in tensors})
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        (self.dir / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")


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
