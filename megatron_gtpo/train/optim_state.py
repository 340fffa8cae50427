"""Adam state by the rules of the optimizer Megatron actually built: the one module that reads or
writes it (checkpoint priming and restore, the D3/D4 diagnostics, the trainer offload).

Megatron-Core 0.16.1 picks its Adam when it is imported (``megatron/core/optimizer/__init__.py``):
Transformer Engine's ``FusedAdam`` when TE imports, else apex's ``FusedAdam``, else torch's
``AdamW`` (the CPU fallback). The three keep Adam's state differently, and code written for one
crashes on another (a per-parameter ``"step"`` makes TE's ``state_dict()`` raise ``KeyError:
'step'``, so every resume with TE installed died at restore)::

    optimizer          Adam's step                per-parameter state           state_dict()
    torch Adam/AdamW   state[p]["step"] (0-dim)   step, exp_avg, exp_avg_sq     torch's
    TE FusedAdam       group["step"] (an int)     only the keys of its          looks every key up in
                                                  name_to_dtype_map: exp_avg,   name_to_dtype_map
                                                  exp_avg_sq, master_param
                                                  (master weights on); stored
                                                  scaled in fp16/bf16/fp8 when
                                                  asked: read them unscaled
    apex FusedAdam     group["step"] (an int)     exp_avg, exp_avg_sq           torch's

(TE ``transformer_engine/pytorch/optimizers/fused_adam.py`` v2.11: ``name_to_dtype_map``,
``get_unscaled_state``, ``state_dict``, ``step``; apex ``apex/optimizers/fused_adam.py``: ``step``;
Megatron ``optimizer/distrib_optimizer.py``: ``state_dict``/``load_state_dict`` read the step from
the per-parameter state only on the torch fallback, from the param groups otherwise.)

The optimizer in use is recognised by what defines its behaviour, not by its import path: torch's
Adam classes by type, TE's by ``name_to_dtype_map`` with ``get_unscaled_state``, apex's by
``param_groups_master`` (set in its constructor). Anything else (SGD) keeps no Adam state here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

Tensor = torch.Tensor


@dataclass(frozen=True)
class AdamRules:
    """How one Adam implementation keeps its state."""

    name: str
    """Which optimizer (for messages and the GPU smoke's report)."""
    step_per_param: bool
    """True: ``state[p]["step"]`` (torch); False: ``group["step"]`` (TE, apex)."""
    keys: tuple[str, ...]
    """Per-parameter tensors it may hold besides the step (moments, master copy)."""


TORCH = AdamRules("torch.optim.Adam/AdamW", True, ("exp_avg", "exp_avg_sq"))
TE = AdamRules("transformer_engine FusedAdam", False, ("exp_avg", "exp_avg_sq", "master_param"))
APEX = AdamRules("apex FusedAdam", False, ("exp_avg", "exp_avg_sq"))


def adam_rules(inner) -> AdamRules | None:
    """The rules of ``inner`` (a torch optimizer inside a Megatron one), None when it is not Adam."""
    if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
        return TORCH
    if hasattr(inner, "name_to_dtype_map") and hasattr(inner, "get_unscaled_state"):
        return TE
    if hasattr(inner, "param_groups_master"):
        return APEX
    return None


def _subs(optimizer) -> list:
    """The Megatron optimizers inside ``optimizer`` (a ChainedOptimizer holds several)."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _inner(sub):
    return getattr(sub, "optimizer", None)


def step_of(inner, rules: AdamRules, group: dict) -> int:
    """Adam's 1-based step count of ``group`` (0 before the first step)."""
    if rules.step_per_param:
        steps = [inner.state[p]["step"] for p in group["params"] if "step" in inner.state.get(p, {})]
        return int(steps[0]) if steps else 0
    return int(group.get("step", 0))


def moments(inner, rules: AdamRules, param) -> tuple[Tensor, Tensor]:
    """``(exp_avg, exp_avg_sq)`` of ``param``, unscaled (TE may store them scaled in lower precision)."""
    if rules is TE:
        return inner.get_unscaled_state(param, "exp_avg"), inner.get_unscaled_state(param, "exp_avg_sq")
    state = inner.state[param]
    return state["exp_avg"], state["exp_avg_sq"]


@dataclass(frozen=True)
class AdamGroup:
    """One Adam param group of a Megatron optimizer, with what the diagnostics read."""

    sub: object
    """The Megatron (sub-)optimizer holding it."""
    group: dict
    """The torch param group (lr, betas, eps, params)."""
    params: list
    """Its parameters that have Adam moments (none before the first step, or on an empty DP shard)."""
    step: int
    """Adam's step count of the group."""
    moments: Callable[[object], tuple[Tensor, Tensor]]
    """``param -> (exp_avg, exp_avg_sq)``, unscaled."""


def adam_groups(optimizer) -> Iterator[AdamGroup]:
    """Every Adam param group of a Megatron optimizer (chained or not), read by its own rules."""
    for sub in _subs(optimizer):
        inner = _inner(sub)
        rules = adam_rules(inner) if inner is not None else None
        if rules is None:
            continue
        for group in inner.param_groups:
            params = [p for p in group["params"] if "exp_avg_sq" in inner.state.get(p, {})]
            yield AdamGroup(sub=sub, group=group, params=params, step=step_of(inner, rules, group),
                            moments=lambda p, inner=inner, rules=rules: moments(inner, rules, p))


def prime(optimizer) -> None:
    """Gives a fresh optimizer zeroed Adam state in its own layout (a checkpoint load overwrites it).

    Megatron's DistributedOptimizer reuses existing state on load instead of allocating it on
    ``torch.cuda.current_device()``, and on the torch fallback its ``state_dict()`` asserts one
    per-parameter ``step``, which Megatron's own ``init_state_fn`` does not create. TE's and
    apex's layouts get no per-parameter step: TE's ``state_dict()`` would raise on it.
    """
    for sub in _subs(optimizer):
        inner = _inner(sub)
        rules = adam_rules(inner) if inner is not None else None
        if rules is None or any(len(s) for s in inner.state.values()):
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                _prime_param(sub, inner, rules, p)


def _prime_param(sub, inner, rules: AdamRules, param) -> None:
    if rules is TE:  # what its step() does at first sight of a parameter (moments, master copy)
        remainders = getattr(inner, "store_param_remainders", False) and param.dtype == torch.bfloat16
        inner.initialize_state(param, remainders)
        return
    state = inner.state[param]
    state["exp_avg"] = torch.zeros_like(param, dtype=torch.float32 if rules is APEX else param.dtype)
    state["exp_avg_sq"] = torch.zeros_like(state["exp_avg"])
    if rules.step_per_param:
        state["step"] = torch.tensor(0.0)


def restore_steps(optimizer, loaded: dict) -> None:
    """Sets Adam's step from the saved iteration, the ``step`` Megatron stores in the param groups.

    Torch fallback: Megatron's ``DistributedOptimizer.load_state_dict`` gives every parameter the
    *same* step tensor and then overwrites it from the dp_reshardable buffers, which hold the
    freshly primed value, so the bias correction would restart; each parameter gets its own tensor
    here. TE/apex: every group gets the saved step (Megatron aligns it over groups when saving,
    since FusedAdam does not advance the step of an empty group).
    """
    subs = _subs(optimizer)
    states = [loaded] if len(subs) == 1 else [loaded[key] for key in sorted(loaded)]
    for sub, state in zip(subs, states):
        inner = _inner(sub)
        rules = adam_rules(inner) if inner is not None else None
        groups = state.get("optimizer", {}).get("param_groups", []) if isinstance(state, dict) else []
        steps = {g["step"] for g in groups if g.get("step") is not None}
        if rules is None or len(steps) != 1:
            continue
        step = steps.pop()
        if rules.step_per_param:
            for param_state in inner.state.values():
                if "step" in param_state:
                    param_state["step"] = torch.tensor(float(step))
        else:
            for group in inner.param_groups:
                group["step"] = int(step)


def state_tensors(optimizer) -> Iterator[Tensor]:
    """Every per-parameter state tensor of the optimizer (moments, master copies; never the step):
    by the Adam rules' keys, or every tensor of more than one element for other optimizers (SGD's
    momentum)."""
    for sub in _subs(optimizer):
        inner = _inner(sub) or sub
        rules = adam_rules(inner)
        for state in getattr(inner, "state", {}).values():
            if rules is None:
                yield from (v for v in state.values() if isinstance(v, Tensor) and v.numel() > 1)
            else:
                yield from (state[k] for k in rules.keys if isinstance(state.get(k), Tensor))
