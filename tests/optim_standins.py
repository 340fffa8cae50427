"""CPU stand-ins for Transformer Engine's and apex's ``FusedAdam``, and the switch that makes
Megatron-Core build them as it builds the real ones when TE or apex imports.

Neither package runs without CUDA, yet on every GPU cluster Megatron-Core 0.16.1 hands its
optimizers TE's ``FusedAdam`` (``megatron/core/optimizer/__init__.py`` imports it first, then
apex's, then falls back to torch's AdamW), and that optimizer keeps its state in another layout
than the torch fallback the CPU suite otherwise meets. These stand-ins keep that layout and its
failure modes so the contract tests (tests/unit/test_optim_state.py) can run prime -> save -> load
-> diagnostics through the real Megatron optimizer and dist-checkpointing on CPU.

:class:`TEFusedAdam` mirrors ``transformer_engine/pytorch/optimizers/fused_adam.py`` of TE v2.11
(tag v2.11, commit c188b533cc37; the file's last change d52ed471b1f2), read with this project's
source tools:

* ``name_to_dtype_map`` = {exp_avg, exp_avg_sq, master_param} (``__init__``): the only state
  names it knows; ``get_unscaled_state`` and ``_initialize_state`` look the name up there, so any
  other per-parameter key raises ``KeyError`` (what crashed every resume: a per-parameter "step");
* ``state_dict()`` unscales every key of every parameter's state through ``get_unscaled_state``;
  ``load_state_dict()`` calls torch's, then re-sets every key through ``set_scaled_state``;
* ``initialize_state(param, store_param_remainders)`` makes zeroed moments (and a master copy with
  ``master_weights``); ``step()`` creates them lazily for a parameter with empty state, keeps the
  step count as an int in ``group["step"]`` (skipping empty groups) and applies the kernel's math
  (``common/multi_tensor/adam.cu``: L2 mode adds ``wd * p`` to the gradient, AdamW mode adds it to
  the update; bias-corrected moments; ``p -= lr * update``).

Only fp32 state is mirrored (TE's default ``exp_avg_dtype``/``exp_avg_sq_dtype``/
``master_weight_dtype``): the scaled fp16/bf16/fp8 storage, capturable mode, FP8 parameters and
the CUDA-only overflow buffer are left out, and asking for them raises.

:class:`ApexFusedAdam` mirrors ``apex/optimizers/fused_adam.py`` of NVIDIA/apex (commit 16fadfe71c0d,
the file's last change before 6424da3b4faa): ``param_groups_master`` made in ``__init__``, the
step in ``group["step"]`` (an int), ``exp_avg``/``exp_avg_sq`` created as fp32 zeros for a
parameter with empty state in ``step()``, torch's own ``state_dict``/``load_state_dict``, and
``zero_grad()`` without arguments. ``master_weights`` (capturable only) is left out.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from copy import deepcopy
from itertools import chain

import torch


def _adam_update(p, grad, exp_avg, exp_avg_sq, *, group: dict, step: int, adam_w_mode: bool) -> None:
    """One element-wise update of the multi-tensor Adam kernel (TE's and apex's share the math)."""
    beta1, beta2 = group["betas"]
    lr, eps, decay = group["lr"], group["eps"], group["weight_decay"]
    correction1 = 1 - beta1 ** step if group["bias_correction"] else 1.0
    correction2 = 1 - beta2 ** step if group["bias_correction"] else 1.0
    grad = grad.float()
    if not adam_w_mode:
        grad = grad + decay * p
    exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    update = (exp_avg / correction1) / ((exp_avg_sq / correction2).sqrt() + eps)
    if adam_w_mode:
        update = update + decay * p
    p.sub_(lr * update)


def _stepped_groups(optimizer) -> Iterator[tuple[dict, int]]:
    """Each non-empty param group with its step count advanced (both keep it as an int in the group)."""
    for group in optimizer.param_groups:
        if group["params"]:
            group["step"] = group.get("step", 0) + 1
            yield group, group["step"]


class TEFusedAdam(torch.optim.Optimizer):
    """Transformer Engine 2.11's FusedAdam, state layout and checkpoint behaviour (see the module docstring)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, *,
                 bias_correction=True, adam_w_mode=True, capturable=False, master_weights=False,
                 master_weight_dtype=torch.float32, exp_avg_dtype=torch.float32, exp_avg_sq_dtype=torch.float32,
                 use_decoupled_grad=False, store_param_remainders=False):
        fp32 = (master_weight_dtype, exp_avg_dtype, exp_avg_sq_dtype) == (torch.float32,) * 3
        if amsgrad or capturable or use_decoupled_grad or not fp32:
            raise NotImplementedError("the stand-in mirrors fp32 state only, without amsgrad/capturable/decoupled grads")
        super().__init__(params, {"lr": lr, "bias_correction": bias_correction, "betas": betas, "eps": eps,
                                  "weight_decay": weight_decay})
        self.adam_w_mode, self.master_weights, self.capturable = adam_w_mode, master_weights, False
        self.name_to_dtype_map = {"exp_avg": exp_avg_dtype, "exp_avg_sq": exp_avg_sq_dtype,
                                  "master_param": master_weight_dtype}
        self.store_param_remainders = store_param_remainders and master_weights

    def get_unscaled_state(self, param, state_name):
        dtype = self.name_to_dtype_map[state_name]  # KeyError for any other name, as in TE
        state = self.state[param][state_name]
        assert dtype == torch.float32 and state.dtype == torch.float32, (state_name, state.dtype)
        return state

    def set_scaled_state(self, param, state_name, unscaled_state):
        assert unscaled_state.dtype == torch.float32
        if state_name not in self.state[param]:
            self._initialize_state(param, state_name, zero_buffer=False)
        self.state[param][state_name].copy_(unscaled_state)

    def _initialize_state(self, param, state_name, zero_buffer, store_param_remainders=False):
        dtype = self.name_to_dtype_map[state_name]
        data = torch.empty(param.shape, dtype=dtype, device=param.device)
        if zero_buffer:
            data.zero_()
        self.state[param][state_name] = data

    def initialize_state(self, param, store_param_remainders):
        self._initialize_state(param, "exp_avg", zero_buffer=True)
        self._initialize_state(param, "exp_avg_sq", zero_buffer=True)
        if self.master_weights:
            self._initialize_state(param, "master_param", zero_buffer=False)
            self.set_scaled_state(param, "master_param", param.clone().detach().float())

    def _id_map(self, saved_groups) -> dict:
        return dict(zip(chain.from_iterable(g["params"] for g in saved_groups),
                        chain.from_iterable(g["params"] for g in self.param_groups)))

    def state_dict(self):
        state_dict = super().state_dict()
        id_map = self._id_map(deepcopy(state_dict["param_groups"]))
        for key, values in state_dict["state"].items():
            if key in id_map:
                state_dict["state"][key] = {name: self.get_unscaled_state(id_map[key], name) for name in values}
        return state_dict

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        id_map = self._id_map(deepcopy(state_dict["param_groups"]))
        for key, values in state_dict["state"].items():
            if key in id_map:
                param = id_map[key]
                self.state[param] = {}
                for name, value in values.items():
                    if value is not None:
                        self.set_scaled_state(param, name, value.float())

    def zero_grad(self, set_to_none=None):
        super().zero_grad(set_to_none=True if set_to_none is None else set_to_none)

    @torch.no_grad()
    def step(self, closure=None, grad_scaler=None):
        loss = closure() if closure is not None else None
        for group, step in _stepped_groups(self):
            for p in group["params"]:
                if len(self.state[p]) == 0:
                    self.initialize_state(p, self.store_param_remainders)
                if p.grad is None:
                    continue
                state = self.state[p]
                target = state["master_param"] if self.master_weights else p
                _adam_update(target, p.grad, state["exp_avg"], state["exp_avg_sq"], group=group, step=step,
                             adam_w_mode=bool(self.adam_w_mode))
                if self.master_weights:
                    p.copy_(target)
        return loss


class ApexFusedAdam(torch.optim.Optimizer):
    """apex's FusedAdam, state layout (see the module docstring)."""

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, adam_w_mode=True,
                 weight_decay=0.0, amsgrad=False, set_grad_none=True, capturable=False, master_weights=False):
        if amsgrad or capturable or master_weights:
            raise NotImplementedError("the stand-in mirrors apex's default (non-capturable) path only")
        super().__init__(params, {"lr": lr, "bias_correction": bias_correction, "betas": betas, "eps": eps,
                                  "weight_decay": weight_decay})
        self.adam_w_mode, self.set_grad_none, self.capturable, self.master_weights = adam_w_mode, set_grad_none, \
            False, False
        self.param_groups_master = [{"params": [None for _ in pg["params"]]} for pg in self.param_groups]

    def zero_grad(self):
        if self.set_grad_none:
            for group in self.param_groups:
                for p in group["params"]:
                    p.grad = None
        else:
            super().zero_grad()

    @torch.no_grad()
    def step(self, closure=None, grads=None, output_params=None, scale=None, grad_norms=None, grad_scaler=None):
        loss = closure() if closure is not None else None
        for group, step in _stepped_groups(self):
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if len(state) == 0:
                    state["exp_avg"] = torch.zeros_like(p).float()
                    state["exp_avg_sq"] = torch.zeros_like(p).float()
                _adam_update(p, p.grad, state["exp_avg"], state["exp_avg_sq"], group=group, step=step,
                             adam_w_mode=bool(self.adam_w_mode))
        return loss


STANDINS = {"te": (TEFusedAdam, "USING_TE_OPTIMIZER"), "apex": (ApexFusedAdam, "USING_APEX_OPTIMIZER")}


@contextlib.contextmanager
def megatron_uses(kind: str) -> Iterator[None]:
    """Makes Megatron-Core build ``kind``'s FusedAdam ("te" or "apex") exactly where it would if that
    package imported: the ``Adam`` class and the ``USING_*`` flags its optimizer package and
    DistributedOptimizer read at import time. "torch": Megatron as installed (the CPU fallback)."""
    import megatron.core.optimizer as mcore_optimizer
    import megatron.core.optimizer.distrib_optimizer as distrib

    if kind == "torch":
        yield
        return
    cls, flag = STANDINS[kind]
    saved = {(mcore_optimizer, "Adam"): mcore_optimizer.Adam,
             (mcore_optimizer, "USING_PYTORCH_OPTIMIZER"): mcore_optimizer.USING_PYTORCH_OPTIMIZER,
             (distrib, "Adam"): distrib.Adam, (distrib, "HAVE_APEX_OR_TE"): distrib.HAVE_APEX_OR_TE,
             (distrib, flag): getattr(distrib, flag)}
    try:
        mcore_optimizer.Adam, mcore_optimizer.USING_PYTORCH_OPTIMIZER = cls, False
        distrib.Adam, distrib.HAVE_APEX_OR_TE = cls, True
        setattr(distrib, flag, True)
        yield
    finally:
        for (module, name), value in saved.items():
            setattr(module, name, value)
