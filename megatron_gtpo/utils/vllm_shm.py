"""vLLM's CPU shared-memory segments, named after the torch world that owns them (CPU hosts only).

    install_world_names()          before an external-launcher engine starts (rollout/engine.py)
    remove_world_segments(env)     after a world's ranks ended (parallel/launch.py, the fork launcher)

vLLM's CPU tensor-parallel all-reduce (0.32: ``cpu_communicator._CPUSHMDistributed``) keeps one
``/dev/shm`` segment per rank of a TP group, named after ``VLLM_DIST_IDENT``, which vLLM's CPU worker
derives from the distributed init method. Under the external launcher (every colocated engine of
TP > 1 here) that method is always ``env://``, so every such engine on a host names its segments
``-tp:0-[0-1]-cpushm_<rank>``. vLLM creates them with O_EXCL and unlinks them only in its manager's
destructor: after a run that was killed, and beside any other such run on the host, the next engine
fails to start with ``create shm in SHMManager failed. errno: 17`` until someone empties /dev/shm.
(The suite met it: a killed TP=2 run, later test_engine_tp2_colocated_push_roundtrip.)

Here the names start with the world's rendezvous address instead, ``MASTER_ADDR:MASTER_PORT``: no two
live worlds on one host share it (rank 0 holds the port while the world lives). A segment of this
rank under such a name can only be a dead world's (torchrun's default port 29500 is reused by every
plain ``torchrun`` on the host), so it is removed before vLLM creates its own; and the fork launcher
removes its world's segments once its ranks ended, so a killed rank does not leave ~4 MiB of shared
memory behind. GPU engines use NCCL and never reach this code.
"""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Mapping
from pathlib import Path

SHM_DIR = Path("/dev/shm")
PREFIX = "mgtpo-"


def world_tag(env: Mapping[str, str] = os.environ) -> str:
    """``mgtpo-<MASTER_ADDR>_<MASTER_PORT>`` with only the characters a shared-memory name allows."""
    address = f"{env.get('MASTER_ADDR', 'local')}_{env.get('MASTER_PORT', '0')}"
    return PREFIX + re.sub(r"[^A-Za-z0-9._-]", "_", address)


def install_world_names() -> bool:
    """Makes vLLM name its CPU shared-memory segments after this process's world (``world_tag``, read
    when an engine starts) and remove a dead world's segment of the same name first. Idempotent; a
    process forked after it (a rank) keeps it. False where this vLLM has no such communicator."""
    try:
        from vllm.distributed.device_communicators import cpu_communicator
    except ImportError:
        return False
    shm = getattr(cpu_communicator, "_CPUSHMDistributed", None)
    if shm is None or not hasattr(shm, "make_group_name") or not hasattr(shm, "_init_cpu_shm"):
        return False
    if getattr(shm, "_mgtpo_world_names", False):
        return True
    vllm_name, vllm_init = shm.make_group_name, shm._init_cpu_shm

    def make_group_name(communicator) -> str:
        return "/" + world_tag() + vllm_name(communicator).lstrip("/")

    def init_cpu_shm(self):
        remove_stale_segment(self.group_name, self.communicator.rank)
        return vllm_init(self)

    shm.make_group_name = staticmethod(make_group_name)
    shm._init_cpu_shm = init_cpu_shm
    shm._mgtpo_world_names = True
    return True


def remove_stale_segment(group_name: str, rank: int) -> Path | None:
    """Removes the segment vLLM is about to create for ``rank`` of the group ``group_name`` when one
    is left over; returns its path. vLLM creates it with O_EXCL and only this rank creates it (the
    others open it after a barrier), so removing it here races with no one."""
    stale = SHM_DIR / f"{group_name.lstrip('/')}_{rank}"
    if not stale.exists():
        return None
    stale.unlink(missing_ok=True)
    print(f"removed {stale}, a vLLM shared-memory segment left by a dead run of the same rendezvous address",
          flush=True)
    return stale


def remove_world_segments(env: Mapping[str, str]) -> list[str]:
    """Removes the segments of the world whose environment is ``env`` (its ranks have ended);
    returns their names."""
    removed = []
    for path in SHM_DIR.glob(glob.escape(world_tag(env)) + "-*cpushm_*"):
        path.unlink(missing_ok=True)
        removed.append(path.name)
    return removed
