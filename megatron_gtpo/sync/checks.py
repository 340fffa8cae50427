"""What a weight push must contain for one engine, and the check that runs before vLLM is touched.

A push is a stream of buckets of ``(HF name, full tensor)`` pairs (the streaming exporter's output).
vLLM's in-place reload is not transactional: it rewrites each decoder layer as soon as that layer's
tensors have arrived, and an exception half-way leaves some layers new, some old and the rest on the
meta device. So nothing reaches vLLM until the *whole* push has been checked against the engine's
:class:`WeightSpec`: every expected name present exactly once with the expected shape, nothing
unknown, floating point only. :class:`PushChecker` does that incrementally, so a wrong architecture
fails on its first bucket (before any byte moves to a separate engine) and a truncated stream fails
at the end, both before vLLM sees a tensor.

The spec is read from the engine's own ``config.json`` (a transformers model built on the meta
device: names and shapes without memory), never from the trainer, so a trainer/engine architecture
mismatch is caught.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

Bucket = list[tuple[str, torch.Tensor]]
"""One exporter bucket: HF parameter names with full (unsharded) tensors."""

_MAX_LISTED = 4  # names quoted per error kind; the counts are always complete


class WeightPushError(RuntimeError):
    """A push was rejected before it reached vLLM; the engine still serves its previous version."""


@dataclass(frozen=True, kw_only=True)
class WeightSpec:
    """The HF-format parameters an engine's model loads: names, full shapes, engine dtype."""

    shapes: dict[str, tuple[int, ...]]
    """Required name -> full shape (every parameter the engine needs on each push)."""
    optional: frozenset[str] = frozenset()
    """Names accepted but not required (``lm_head.weight`` when embeddings are tied: vLLM ignores it)."""
    optional_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """Shapes of the optional names."""
    dtype: torch.dtype = torch.float32
    """The engine's weight dtype; floating pushes of other dtypes are cast to it before transfer."""
    source: str = ""
    """Where the spec came from (architecture and model directory), for error messages."""

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, *, dtype: torch.dtype) -> WeightSpec:
        """Spec of the transformers model described by ``model_dir/config.json``."""
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(str(model_dir))
        with torch.device("meta"):  # shapes only: no memory, no init cost
            model = AutoModelForCausalLM.from_config(config)
        required = {name: tuple(p.shape) for name, p in model.named_parameters()}
        # Tied weights appear once in named_parameters but twice in the state dict; exporters may
        # or may not emit the alias, and vLLM skips it, so it is accepted without being required.
        extra = {name: tuple(t.shape) for name, t in model.state_dict().items()
                 if name not in required and name.endswith(".weight")}
        arch = (getattr(config, "architectures", None) or [type(model).__name__])[0]
        return cls(shapes=required, optional=frozenset(extra), optional_shapes=extra, dtype=dtype,
                   source=f"{arch} from {model_dir}")

    @property
    def num_bytes(self) -> int:
        """Bytes of one full push in the engine dtype (required tensors only)."""
        item = torch.empty((), dtype=self.dtype).element_size()
        return sum(_numel(shape) for shape in self.shapes.values()) * item

    def expected_shape(self, name: str) -> tuple[int, ...] | None:
        return self.shapes.get(name, self.optional_shapes.get(name))


@dataclass
class PushChecker:
    """Checks one push bucket by bucket, casting tensors to the engine dtype on the way.

    ``prepare(bucket)`` returns the bucket in engine dtype or raises :class:`WeightPushError` naming
    every problem in it; ``finish()`` raises if names are missing. Neither touches the engine.
    """

    spec: WeightSpec
    version: int
    seen: set[str] = field(default_factory=set)
    num_tensors: int = 0
    num_bytes: int = 0

    def prepare(self, bucket: Iterable[tuple[str, torch.Tensor]]) -> Bucket:
        problems: dict[str, list[str]] = {}
        out: Bucket = []
        for name, tensor in bucket:
            problem = self._problem(name, tensor)
            if problem:
                problems.setdefault(problem[0], []).append(problem[1])
                continue
            self.seen.add(name)
            out.append((name, tensor.to(self.spec.dtype) if tensor.dtype != self.spec.dtype else tensor))
        if problems:
            raise self._error(problems)
        self.num_tensors += len(out)
        self.num_bytes += sum(t.numel() * t.element_size() for _, t in out)
        return out

    def finish(self) -> None:
        missing = sorted(set(self.spec.shapes) - self.seen)
        if missing:
            raise self._error({"missing": missing})

    def _problem(self, name: str, tensor: torch.Tensor) -> tuple[str, str] | None:
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            return "malformed", f"{name!r}: expected (str, Tensor), got {type(tensor).__name__}"
        shape = self.spec.expected_shape(name)
        if shape is None:
            return "unknown", name
        if name in self.seen:
            return "duplicate", name
        if tuple(tensor.shape) != shape:
            return "shape", f"{name} pushed {tuple(tensor.shape)}, engine expects {shape}"
        if not tensor.is_floating_point():
            return "dtype", f"{name} is {tensor.dtype}, expected a floating dtype"
        return None

    def _error(self, problems: dict[str, list[str]]) -> WeightPushError:
        parts = []
        for kind, items in problems.items():
            listed = ", ".join(items[:_MAX_LISTED]) + (", ..." if len(items) > _MAX_LISTED else "")
            parts.append(f"{len(items)} {kind} ({listed})")
        return WeightPushError(
            f"weight push v{self.version} does not match the engine ({self.spec.source}): "
            + "; ".join(parts) + ". Nothing was loaded; the engine keeps its previous weights. "
            "Check that trainer and engine were built from the same HF config.")


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for dim in shape:
        out *= dim
    return out
