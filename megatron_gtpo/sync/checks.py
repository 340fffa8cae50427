"""What a weight push must contain for one engine, checked before any byte moves.

A push is planned before it is made: the exporter's :mod:`shard plan <megatron_gtpo.sync.shards>`
lists every tensor's HF name, shape and dtype on every rank without moving data. vLLM's in-place
reload is not transactional (it rewrites each decoder layer as soon as that layer's tensors have
arrived), so the whole plan is checked against the engine's :class:`WeightSpec` first
(:func:`check_plan`: every expected name exactly once with the expected shape, nothing unknown,
floating point only). A wrong architecture or a truncated plan is rejected before vLLM is touched
and the engine keeps its previous version. While the bytes stream, :func:`checked_stream` checks
each tensor against the plan again (cheap), so an exporter that diverges from its plan is caught at
the first wrong tensor; what happens to an engine then is the transport's rule (see sync/base.py).

The spec is read from the engine's own ``config.json`` (a transformers model built on the meta
device: names and shapes without memory), never from the trainer, so a trainer/engine architecture
mismatch is caught.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from megatron_gtpo.convert import mapping as mp

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


def sharded_shapes(shapes: dict[str, tuple[int, ...]], tp: int) -> dict[str, tuple[int, ...]]:
    """Shapes one engine TP rank holds of each HF tensor when every linear layer arrives as its TP
    shard (``local`` delivery): column-parallel tensors cut on dim 0, row-parallel ones on dim 1
    (the kinds of :mod:`megatron_gtpo.convert.mapping`); norms and vocabulary tensors stay full."""
    cut = {suffix: 1 if pm.kind == mp.ROW else 0 for pm in mp.all_layer_maps()
           if pm.kind in (mp.QKV, mp.FC1, mp.COLUMN, mp.ROW) for suffix in pm.hf}
    out = {}
    for name, shape in shapes.items():
        suffix = name.split(".", 3)[-1] if name.startswith("model.layers.") else name
        dim = cut.get(suffix)
        out[name] = shape if dim is None or tp == 1 else tuple(n // tp if i == dim else n for i, n in enumerate(shape))
    return out


def check_plan(spec: WeightSpec, metas: Iterable, *, version: int, tp: int = 1) -> None:
    """Checks a whole push against the engine before any byte moves: every required name exactly
    once with the expected shape (full, or the TP shard with ``tp`` > 1), nothing unknown,
    floating dtypes only. Raises WeightPushError naming every problem."""
    expected = sharded_shapes({**spec.optional_shapes, **spec.shapes}, tp)
    problems: dict[str, list[str]] = {}
    seen: set[str] = set()
    for meta in metas:
        name, shape, dtype = meta.name, tuple(meta.shape), str(meta.dtype).removeprefix("torch.")
        want = expected.get(name)
        kind = ("unknown", name) if want is None else ("duplicate", name) if name in seen else \
            ("shape", f"{name} pushed {shape}, engine expects {want}") if shape != want else \
            ("dtype", f"{name} is {dtype}, expected a floating dtype") if not _floating(dtype) else None
        seen.add(name)
        if kind:
            problems.setdefault(kind[0], []).append(kind[1])
    missing = sorted(set(spec.shapes) - seen)
    if missing:
        problems["missing"] = missing
    if problems:
        raise _error(problems, version=version, source=spec.source)


def checked_stream(stream: Iterable[tuple[str, torch.Tensor]], metas: list, *,
                   dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields the stream's tensors cast to the engine ``dtype``, checking each against the plan
    that was checked up front (same name, shape and order); raises RuntimeError at the first
    divergence or when the stream ends early (the push is then broken half-way)."""
    sent = 0
    for name, tensor in stream:
        want = metas[sent] if sent < len(metas) else None
        if want is None or name != want.name or tuple(tensor.shape) != tuple(want.shape):
            raise RuntimeError(f"weight stream diverged from its plan at tensor {sent}: got {name!r} "
                               f"{tuple(tensor.shape)}, planned {want.name if want else 'nothing'!r} "
                               f"{tuple(want.shape) if want else ''}")
        sent += 1
        yield name, tensor if tensor.dtype == dtype else tensor.to(dtype)
    if sent != len(metas):
        raise RuntimeError(f"weight stream ended after {sent} of {len(metas)} planned tensors")


def _floating(dtype: str) -> bool:
    return getattr(torch, dtype).is_floating_point


def _error(problems: dict[str, list[str]], *, version: int, source: str) -> WeightPushError:
    parts = []
    for kind, items in problems.items():
        listed = ", ".join(items[:_MAX_LISTED]) + (", ..." if len(items) > _MAX_LISTED else "")
        parts.append(f"{len(items)} {kind} ({listed})")
    return WeightPushError(
        f"weight push v{version} does not match the engine ({source}): " + "; ".join(parts)
        + ". Nothing was loaded; the engine keeps its previous weights. "
        "Check that trainer and engine were built from the same HF config.")


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for dim in shape:
        out *= dim
    return out
