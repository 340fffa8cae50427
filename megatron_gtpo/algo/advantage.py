"""Group-relative advantages and GTPO's sequence-level shaping (docs/algorithms.md sections 2-5).

Dataflow for one global batch (many prompts, ``group_ids`` says which completions share a prompt)::

    rewards [B] --group_advantages--> A [B]  (GRPO/DAPO: (R-mean)/(std+eps); Dr.GRPO/GTPO: R-mean)
    entropy [B,T] --completion_mean_entropy--> <H> [B] --entropy_filter--> delta [B]   (GTPO only)
    A, delta, <H> --shape_advantages--> A~ = delta * (A - gamma <H>)                   (GTPO only)

Groups may have different sizes. Everything here is a pure tensor function.
"""

from __future__ import annotations

import torch

from megatron_gtpo.algo.checks import as_mask, check_finite, check_float, check_integer, check_shape

Tensor = torch.Tensor


def group_index(group_ids: Tensor) -> tuple[Tensor, Tensor]:
    """Compacts arbitrary integer group ids.

    Returns ``(index [B] long in 0..num_groups-1, sizes [num_groups] long)``; groups are numbered
    in increasing id order.
    """
    if not isinstance(group_ids, Tensor) or group_ids.dim() != 1:
        raise ValueError("group_ids must be a 1-D integer tensor [B] (one prompt id per completion)")
    check_integer(group_ids, name="group_ids")
    _, index, sizes = torch.unique(group_ids, return_inverse=True, return_counts=True)
    return index, sizes


def group_advantages(rewards: Tensor, group_ids: Tensor, *, std_scale: bool, eps: float = 1e-4,
                     unbiased: bool = True) -> Tensor:
    """Outcome advantage of every completion relative to its group: ``A_i = R_i - mean_g(R)``,
    divided by ``std_g(R) + eps`` when ``std_scale`` (GRPO, DAPO) [spec 2, 3, 4, 5.2].

    Contract:
      * ``rewards`` [B] finite floats; ``group_ids`` [B] integers; every group needs >= 2 completions
        (a singleton group has no baseline: ValueError naming ``group_ids``).
      * ``unbiased=True`` uses Bessel's std like TRL (``nanstd``) and verl; ``eps`` = 1e-4 is TRL's and
        Unsloth's value (verl uses 1e-6).
      * A group whose rewards are all equal gets ``A = 0`` exactly (no NaN even with eps = 0), and a
        centred value within ``8 * eps(rewards.dtype) * max|R|`` of zero is snapped to exactly 0, so
        that the sign test of conflict detection (``A > 0`` / ``A < 0``) is never decided by rounding.
      * Computed in float64; returned in the rewards' float dtype (float32 for integer rewards).
    """
    if not isinstance(rewards, Tensor) or rewards.dim() != 1:
        raise ValueError("rewards must be a 1-D tensor [B] (one scalar reward per completion)")
    check_shape(group_ids, tuple(rewards.shape), name="group_ids", what="[B], one group id per reward")
    check_finite(rewards.double(), name="rewards")
    if not (eps >= 0.0 and eps < float("inf")):
        raise ValueError(f"eps={eps!r} must be a finite number >= 0 (TRL uses 1e-4)")
    index, sizes = group_index(group_ids)
    if (sizes < 2).any():
        gid = int(torch.unique(group_ids)[(sizes < 2).nonzero()[0]])
        raise ValueError(f"group_ids: group {gid} has a single completion; group-relative advantages "
                         "need >= 2 completions per prompt (sample n >= 2, or drop singleton groups)")
    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    r = rewards.double()
    num_groups = sizes.numel()
    mean = torch.zeros(num_groups, dtype=r.dtype, device=r.device).index_add_(0, index, r) / sizes
    centred = r - mean[index]
    # Snap rounding residue (e.g. 0.2 against the mean of [0.1, 0.2, 0.3]) to 0: anything within a few
    # units of the input dtype's rounding, relative to the group's largest |R|, is not a real difference.
    scale = torch.zeros_like(mean).scatter_reduce_(0, index, r.abs(), "amax", include_self=True)
    unit = torch.finfo(rewards.dtype if rewards.is_floating_point() else torch.float64).eps
    tol = 8 * unit * scale[index]
    centred = torch.where(centred.abs() <= tol, torch.zeros_like(centred), centred)
    if std_scale:
        ddof = 1 if unbiased else 0
        var = torch.zeros_like(mean).index_add_(0, index, centred * centred) / (sizes - ddof)
        denom = var.sqrt()[index] + eps
        # centred == 0 covers all-equal groups, where denom may be 0 when eps == 0.
        centred = torch.where(centred == 0, centred, centred / torch.where(centred == 0, 1.0, denom))
    return centred.to(out_dtype)


def completion_mean_entropy(entropy: Tensor, mask: Tensor, *, check: bool = True) -> Tensor:
    """``<H>_i = (1/|o_i|) sum_t H_{i,t}`` over the masked tokens, without gradient [spec 1, 5.5].

    ``entropy`` [B, T] in nats; ``mask`` [B, T] prefix of ones. An empty completion gets 0.
    ``check=False``: no value checks (no host sync; ``checks.py``), ``mask`` must be bool.
    """
    if check:
        mask = as_mask(mask)
    check_float(entropy, name="entropy")
    check_shape(entropy, tuple(mask.shape), name="entropy", what="[B, T], like mask")
    if check:
        check_finite(entropy, name="entropy", mask=mask)
    ent = torch.where(mask, entropy.detach(), torch.zeros((), dtype=entropy.dtype, device=entropy.device))
    return ent.sum(dim=1) / mask.sum(dim=1).clamp(min=1)


def entropy_filter(mean_entropy: Tensor, *, threshold: float | None, check: bool = True) -> Tensor:
    """GTPO's trajectory filter ``delta_i = 1[<H>_i <= threshold]`` (code form of spec 5.5).

    Returns a float tensor [B] of 0/1. ``threshold`` = 0.7 in the official code (ln 2 in the README);
    a huge value (the Colab's 777) disables filtering. ``check=False``: no finiteness check.
    """
    check_float(mean_entropy, name="mean_entropy")
    if mean_entropy.dim() != 1:
        raise ValueError(f"mean_entropy must be 1-D [B] (one <H>_i per completion), got shape "
                         f"{tuple(mean_entropy.shape)}")
    if check:
        check_finite(mean_entropy, name="mean_entropy")
    if threshold is None:
        raise ValueError("threshold is None: algo.entropy_threshold 'auto' must be decided (config.filter_rule, "
                         "the driver does it at the first step) before any completion is filtered")
    if threshold != threshold:
        raise ValueError("threshold is NaN; pass a number such as 0.7")
    return (mean_entropy.detach() <= threshold).to(mean_entropy.dtype)


def shape_advantages(advantages: Tensor, *, delta: Tensor, mean_entropy: Tensor, gamma: float,
                     check: bool = True) -> Tensor:
    """GTPO's shaped advantage ``A~_i = delta_i * (A_i - gamma * <H>_i)`` [spec 5.6].

    ``<H>_i`` carries no gradient, so the entropy term is an advantage shift, not a regulariser.
    Note the spec's consequence: ``A_i = 0`` with ``delta_i = 1`` still gives ``A~_i = -gamma <H>_i``.
    ``check=False``: no finiteness checks (no host sync; ``checks.py``).
    """
    check_shape(delta, tuple(advantages.shape), name="delta", what="[B], like advantages")
    check_shape(mean_entropy, tuple(advantages.shape), name="mean_entropy", what="[B], like advantages")
    if check:
        check_finite(advantages, name="advantages")
        check_finite(mean_entropy, name="mean_entropy")
    if not (gamma >= 0.0 and gamma < float("inf")):
        raise ValueError(f"gamma={gamma!r} must be a finite number >= 0 (the official code uses 0.1)")
    return delta * (advantages - gamma * mean_entropy.detach().to(advantages.dtype))
