"""What a recipe's checkpoints cost: bytes per save, seconds per save, disk held (the dry-run prints it).

A save writes one copy of the model (weights in the model dtype) and its optimizer state (fp32
moments plus the fp32 master copy of a half-precision model: ``optimizer_bytes_per_param``),
whatever the layout: Megatron's distributed checkpoint writes each shard once. LoRA saves the
adapters only. The write time assumes the job's aggregate filesystem bandwidth (``fs_gbps``).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_gtpo.plan.memory import GIB, optimizer_bytes_per_param

STEP_SHARE = 0.05
"""Warn when saving costs more than this share of the training time (write time / checkpoint_every
over the step time)."""

DISK_SHARE = 0.5
"""Warn when the checkpoints kept (keep_last, plus the one being written) need more than this share of
the disk given with --disk-gib."""


@dataclass(frozen=True)
class CheckpointCost:
    """One save and what the run's saves hold on disk."""

    bytes_per_save: int
    """Weights + optimizer state of one save (adapters + their state under LoRA)."""
    seconds_per_save: float
    """bytes_per_save at the stated filesystem bandwidth."""
    disk_bytes: int
    """keep_last saves plus the one being written (the oldest is deleted after the new one is complete)."""


def checkpoint_cost(params: int, *, param_bytes: int, optimizer: str, keep_last: int, fs_gbps: float) -> CheckpointCost:
    """The cost of saving ``params`` trained parameters (all of them, or LoRA's adapters)."""
    per_save = params * (param_bytes + optimizer_bytes_per_param(optimizer=optimizer, param_bytes=param_bytes))
    return CheckpointCost(bytes_per_save=per_save, seconds_per_save=per_save / (fs_gbps * 1e9),
                          disk_bytes=per_save * (keep_last + 1))


def checkpoint_warnings(cost: CheckpointCost, *, every: int, step_time_s: float,
                        disk_gib: float | None) -> list[str]:
    """A warning per stated limit a recipe exceeds, each naming the setting that changes it."""
    out = []
    share = cost.seconds_per_save / every / step_time_s
    if share > STEP_SHARE:
        out.append(f"checkpoints take {100 * share:.0f}% of the training time ({cost.seconds_per_save:.0f} s per save "
                   f"every {every} step(s) of ~{step_time_s:g} s, --step-time-s), over {100 * STEP_SHARE:.0f}%: raise "
                   f"train.checkpoint_every to {_every_for(cost.seconds_per_save, step_time_s)} or more")
    if disk_gib is not None and cost.disk_bytes > DISK_SHARE * disk_gib * GIB:
        out.append(f"checkpoints hold {cost.disk_bytes / GIB:.0f} GiB (train.keep_last + the save in progress), over "
                   f"{100 * DISK_SHARE:.0f}% of the {disk_gib:g} GiB disk (--disk-gib): lower train.keep_last")
    return out


def _every_for(seconds_per_save: float, step_time_s: float) -> int:
    return int(-(-seconds_per_save // (STEP_SHARE * step_time_s)))
