"""A copy of the policy's parameters: restart training from the same point, measure how far it moved.

The reward-scale probe (``megatron_gtpo/probe.py``, spec 6 D3) trains several short runs from one
initial policy inside one job: it captures the parameters once, restores them before each run and
compares the runs' parameter changes. Norms and dot products are sums over this rank's parameters,
leaving out shared and tensor-parallel duplicate ones (Megatron's grad-norm filter), all-reduced
over the model-parallel group (TP x PP): data-parallel replicas hold identical values, so every
parameter counts once. The copy lives where the parameters do (a probe is a short job).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_gtpo.parallel import collectives

Tensor = torch.Tensor


def _unique(param) -> bool:
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared

    return param_is_not_shared(param) and param_is_not_tensor_parallel_duplicate(param)


class ParamSnapshot:
    """The parameters of ``model_chunks`` at construction time."""

    def __init__(self, model_chunks):
        self.params = [p for chunk in model_chunks for p in chunk.parameters()]
        self.values = [p.detach().clone() for p in self.params]

    @torch.no_grad()
    def restore(self) -> None:
        """Writes the captured values back into the parameters (the optimizer must be rebuilt: its
        main copies and moments belong to the old trajectory)."""
        for param, value in zip(self.params, self.values):
            param.copy_(value)

    @torch.no_grad()
    def delta(self) -> list[Tensor]:
        """Current parameters minus the captured ones (fp32, one tensor per parameter)."""
        return [p.detach().float() - v.float() for p, v in zip(self.params, self.values)]


@dataclass(frozen=True)
class DeltaStats:
    """How two parameter changes compare (over the whole model)."""

    norm: float
    """``||delta||``."""
    reference_norm: float
    """``||reference||``."""
    cosine: float
    """``<delta, reference> / (||delta|| ||reference||)`` (NaN when either is 0)."""


@torch.no_grad()
def delta_stats(snapshot: ParamSnapshot, delta: list[Tensor], reference: list[Tensor]) -> DeltaStats:
    """Norms and cosine of two parameter changes of ``snapshot``'s parameters. Collective over the
    model-parallel group (every rank calls it)."""
    from megatron.core import parallel_state as ps

    sums = torch.zeros(3, dtype=torch.float64)
    for param, d, r in zip(snapshot.params, delta, reference):
        if _unique(param):
            d, r = d.double(), r.double()
            sums += torch.stack([(d * d).sum(), (r * r).sum(), (d * r).sum()]).cpu()
    sums = sums.to(collectives.comm_device())
    group = ps.get_model_parallel_group()
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(sums, group=group)
    dd, rr, dr = sums.tolist()
    norm, ref = math.sqrt(dd), math.sqrt(rr)
    return DeltaStats(norm=norm, reference_norm=ref, cosine=dr / (norm * ref) if norm and ref else float("nan"))
