"""Input checks shared by the algorithm functions.

Every public function in ``algo/`` validates its tensors here so that bad input fails with an error
that names the argument and the fix, instead of producing a silent NaN loss several steps later.
The checks are cheap (a few reductions over [B, T]) next to the model forward pass, but the ones that
look at values (a prefix mask, finiteness) read a device value back on a GPU: a host sync. The
functions the train step calls once per micro-batch therefore take ``check=False`` there (their
inputs were checked once per step at the batch boundary, ``losses.validate_loss_inputs``, and
what a forward produces is covered by the step's one device-side finiteness flag,
``train/loss.py``); shape and dtype checks read no value and always run.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def as_mask(mask: Tensor, *, name: str = "mask") -> Tensor:
    """Returns ``mask`` as bool [B, T] after checking that every row is a prefix of ones (1..1 0..0).

    Completions are right-padded: the loss mask covers the completion tokens up to and including
    the first EOS, then padding. A zero-length row (all zeros) is allowed.
    """
    if not isinstance(mask, Tensor) or mask.dim() != 2:
        raise ValueError(f"{name} must be a 2-D tensor [B, T], got {_describe(mask)}")
    if mask.dtype != torch.bool:
        if ((mask != 0) & (mask != 1)).any():
            raise ValueError(f"{name} must hold only 0 and 1 (or be bool); got values "
                             f"{torch.unique(mask)[:8].tolist()}")
        mask = mask != 0
    if mask.shape[1] > 1:
        bad = mask[:, 1:] & ~mask[:, :-1]
        if bad.any():
            row = int(bad.any(dim=1).nonzero()[0])
            raise ValueError(
                f"{name} row {row} is not a prefix of ones (1..1 0..0): "
                f"{mask[row].int().tolist()[:32]}{'...' if mask.shape[1] > 32 else ''}; "
                "completions must be right-padded and the mask must cover tokens 0..len-1")
    return mask


def check_shape(tensor: Tensor, shape: tuple[int, ...], *, name: str, what: str) -> None:
    """Raises ValueError unless ``tensor`` has exactly ``shape``; ``what`` explains the shape."""
    if not isinstance(tensor, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor {what}, got {type(tensor).__name__}")
    if tuple(tensor.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(tensor.shape)} but must be {tuple(shape)} {what}")


def check_integer(tensor: Tensor, *, name: str) -> None:
    """Raises ValueError unless ``tensor`` has an integer dtype (token ids, group ids, lengths)."""
    if tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool:
        raise ValueError(f"{name} must have an integer dtype (e.g. torch.long), got {tensor.dtype}")


def check_finite(tensor: Tensor, *, name: str, mask: Tensor | None = None) -> None:
    """Raises ValueError if ``tensor`` (restricted to ``mask`` when given) holds NaN or +-inf."""
    if not tensor.is_floating_point():
        return
    values = tensor.detach()
    bad = ~torch.isfinite(values)
    if mask is not None:
        bad = bad & mask
    if bad.any():
        where = bad.nonzero()[0].tolist()
        raise ValueError(f"{name} holds a non-finite value ({values[tuple(where)].item()}) at index "
                         f"{where}; fix the producer (reward function / model forward) or drop the sample")


def check_float(tensor: Tensor, *, name: str) -> None:
    """Raises ValueError unless ``tensor`` is a floating-point tensor (log-probs, entropies)."""
    if not isinstance(tensor, Tensor) or not tensor.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {_describe(tensor)}")


def _describe(obj: object) -> str:
    if isinstance(obj, Tensor):
        return f"tensor of shape {tuple(obj.shape)} and dtype {obj.dtype}"
    return type(obj).__name__
