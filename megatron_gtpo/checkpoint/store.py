"""Training checkpoints (Megatron dist-checkpointing) and loading converted model weights.

Layout under ``root`` (``<run dir>/checkpoints``)::

    root/step_00000100/   one torch_dist checkpoint: model ("model" or "model0..k" with VPP),
                          optimizer (Megatron's sharded format), per-rank RNG, in common.pt
                          the step and the caller's ``extra_state`` (data cursor, tracking run
                          id, scheduler state ...), and manifest.json (every file's size and
                          sha256, see ``checkpoint.files``). A LoRA run's model entries are its
                          adapters only, its optimizer holds nothing else, and common.pt records
                          the LoRA settings and the frozen base's identity (``checkpoint.adapters``)
    root/.tmp_step_*/     a save in progress; renamed to step_* only once every rank finished
                          and the manifest is written

Contracts: a step directory exists only when complete (rename is the commit, after the
manifest); a resume verifies the manifest (sizes and sha256, hashed by all ranks in parallel)
before Megatron reads a byte, and falls back to the previous complete step with a warning naming
the bad file. ``keep_last`` counts only intact steps, so pruning never deletes the last good one.
A run resumes at another DP size with the same TP/PP (optimizer state in Megatron's
``dp_reshardable`` format); model weights alone reload at any layout (``load_model_weights``).
RNG states are per (PP, TP) coordinate, shared by the DP replicas. Every rank must call
save/load/prepare_resume.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import random
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from megatron_gtpo.checkpoint.adapters import lora_record
from megatron_gtpo.checkpoint.files import (CHECKPOINTS, HASH, CheckpointError, FileRecord, ResumePoint, clean_stale,
                                            clear_preempted, file_problems, fsync_dir, hash_files, list_files,
                                            mark_preempted, prunable, read_manifest, refuse_fresh_start_over,
                                            resolve_mode, resume_decision, select, share_of, step_dir, step_dirs,
                                            write_manifest)
from megatron_gtpo.convert.offline import checkpoint_model_dir
from megatron_gtpo.parallel.dims import current_dims
from megatron_gtpo.parallel.control import all_gather_data, any_rank, barrier, broadcast_data
from megatron_gtpo.train import optim_state
from megatron_gtpo.train.lora_layers import is_adapter_name
from megatron_gtpo.train.model import unwrap
from megatron_gtpo.utils.configuration import ConfigError
from megatron_gtpo.utils.runtime import PreemptionFlag
from megatron_gtpo.utils.secret import private_directory

log = logging.getLogger("megatron_gtpo")
__all__ = ["CheckpointError", "Checkpointer", "ResumePoint", "latest_step", "load_checkpoint", "load_model_weights",
           "prepare_resume", "save_checkpoint", "step_dir", "verify_parallel"]

# Distributed-optimizer state format (Megatron-LM's default): every rank writes its own buffers
# without gathers, and the state reloads at another DP size. (Megatron 0.16.1's TP/PP-reshardable
# formats fail on CPU without apex/TE: "fully_reshardable" loads hit KeyError 'step', and
# "fully_sharded_model_space" needs flattened_range, which it no longer supports.)
_OPTIM_METADATA = {"distrib_optim_sharding_type": "dp_reshardable", "chained_optim_avoid_prefix": True}


def latest_step(root: str | Path) -> int | None:
    """Highest committed step under ``root`` (not verified: ``prepare_resume`` does that), or None."""
    dirs = step_dirs(root)
    return dirs[0][0] if dirs else None


def model_sharded_state_dict(model_chunks: list[torch.nn.Module], *, adapters_only: bool = False) -> dict:
    """``{"model": ...}`` or ``{"model0": ..., "model1": ...}`` (VPP), as Megatron-LM names them.
    Built from the bare GPTModel (the stored keys are the same through DDP/Float16Module), so
    the loaded dicts fit ``GPTModel.load_state_dict``. ``adapters_only``: the LoRA adapters'
    entries alone (a LoRA checkpoint: the frozen base is not saved)."""
    def entries(chunk):
        state = unwrap(chunk).sharded_state_dict()
        return {k: v for k, v in state.items() if is_adapter_name(k)} if adapters_only else state

    if len(model_chunks) == 1:
        return {"model": entries(model_chunks[0])}
    return {f"model{i}": entries(chunk) for i, chunk in enumerate(model_chunks)}


def _load_into_models(model_chunks: list[torch.nn.Module], state: dict, *, adapters_only: bool = False) -> None:
    keys = ["model"] if len(model_chunks) == 1 else [f"model{i}" for i in range(len(model_chunks))]
    for chunk, key in zip(model_chunks, keys):
        # Non-strict only for ``_extra_state`` a converted checkpoint may not carry (TE spec), and
        # for the frozen base of a LoRA checkpoint (its adapters alone are stored).
        # Into the bare GPTModel: DDP/Float16Module wrappers do not return the key lists.
        missing, unexpected = unwrap(chunk).load_state_dict(state[key], strict=False)
        missing = [k for k in missing if not k.endswith("._extra_state") and (is_adapter_name(k) or not adapters_only)]
        if missing or unexpected:
            raise RuntimeError(f"checkpoint does not match the model: missing {missing[:5]}, "
                               f"unexpected {unexpected[:5]}")


def _drop_objects_missing_from(sharded: dict, ckpt_dir: Path) -> list[str]:
    """Removes ShardedObjects the checkpoint does not hold (TE ``_extra_state`` when loading a
    checkpoint converted for the local spec); returns their keys."""
    from megatron.core.dist_checkpointing import ShardedObject
    from torch.distributed.checkpoint import FileSystemReader

    stored = set(FileSystemReader(str(ckpt_dir)).read_metadata().state_dict_metadata)
    dropped = []

    def walk(node):
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in list(items):
            if isinstance(value, ShardedObject) and value.unique_key not in stored:
                dropped.append(value.unique_key)
                node[key] = None
            elif isinstance(value, (dict, list)):
                walk(value)

    walk(sharded)
    return dropped


def load_model_weights(model_chunks: list[torch.nn.Module], ckpt_dir: str | Path) -> None:
    """Loads only the model weights into chunks built at any TP/PP/VPP layout (Megatron reshards
    at load) from a converted Megatron dir (its ``model/`` subfolder is used), a bare dist
    checkpoint or a training step dir. ConfigError when none is found."""
    from megatron.core import dist_checkpointing

    ckpt_dir = checkpoint_model_dir(Path(ckpt_dir))
    if (ckpt_dir / "common.pt").is_file() and dist_checkpointing.load_common_state_dict(str(ckpt_dir)).get("lora"):
        raise ConfigError(f"{ckpt_dir} is a LoRA checkpoint: it holds adapters, not a model; export the merged model "
                          "with `megatron-gtpo convert --to hf --input <step dir> --output <dir>` and load that, or "
                          "resume the LoRA run with --resume")
    sharded = model_sharded_state_dict(model_chunks)
    _drop_objects_missing_from(sharded, ckpt_dir)
    _load_into_models(model_chunks, dist_checkpointing.load(sharded, str(ckpt_dir)))


def _rng_state() -> dict:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
             "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _layout(model_chunks) -> dict:
    dims = current_dims()
    return {"tp": dims.tp, "pp": dims.pp, "model_chunks": len(model_chunks)}


def _rng_sharded():
    """This rank's RNG as a ShardedObject over the (PP, TP) grid; DP replicas and CP ranks (the same
    RNG streams: Megatron seeds by PP and TP rank) share the main replica's, DP and CP rank 0's."""
    from megatron.core.dist_checkpointing import ShardedObject

    dims = current_dims()
    return ShardedObject("rng_state", _rng_state(), (dims.pp, dims.tp), (dims.pp_rank, dims.tp_rank),
                         replica_id=(dims.dp_rank, dims.cp_rank))


def _full_state(model_chunks, optimizer, *, is_loading: bool, adapters_only: bool = False) -> dict:
    state = model_sharded_state_dict(model_chunks, adapters_only=adapters_only)
    state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=is_loading, metadata=_OPTIM_METADATA)
    state["rng_state"] = _rng_sharded()
    return state


def _write_results_in_process() -> None:
    """Megatron's checkpoint writer hands each save's write results back through a queue that it
    creates on first use in a spawned multiprocessing Manager (``filesystem_async._results_queue``):
    one more interpreter per rank, which imports torch when the first results reach it. Every
    rank's first save waited ~3.3 s for that (tiny recipe, 2 ranks on 2 cores: 3.8 s, later saves
    0.4 s), and the Manager lived on as a process in the rank's group that a preemption signal
    could kill. The queue has to cross processes only for Megatron's asynchronous saves (written by
    a process of their own); these saves are synchronous, in the rank, so the results go through
    an in-process queue (``put`` / ``get_nowait`` are the calls Megatron makes on either).
    tests/unit/test_optim_state.py guards that Megatron still reads this global."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def save_checkpoint(root: str | Path, *, step: int, model_chunks: list[torch.nn.Module], optimizer,
                    extra_state: dict, keep_last: int, lora: dict | None = None) -> Path:
    """Saves model, optimizer, RNG, ``step`` and ``extra_state`` as ``root/step_<step>``
    atomically (with its manifest), then deletes all but the newest ``keep_last`` intact steps.
    ``lora`` (``checkpoint.adapters.lora_record``): a LoRA run, whose adapters alone are saved,
    with this record in common.pt. Returns the step dir."""
    from megatron.core import dist_checkpointing

    if keep_last < 1:
        raise ValueError(f"keep_last={keep_last} must be >= 1")
    root, rank = Path(root), dist.get_rank()
    final, tmp = step_dir(root, step), root / f".tmp_step_{step:08d}"
    if rank == 0:
        # Tests and kill-during-save drills key on this line: it comes right before the first write.
        log.info("checkpoint: saving step %d into %s", step, tmp)
        private_directory(root)  # owner only, like the run directory (docs/security.md)
        shutil.rmtree(tmp, ignore_errors=True)  # left over by a crashed save
        tmp.mkdir()
    barrier()
    state = _full_state(model_chunks, optimizer, is_loading=False, adapters_only=lora is not None)
    # Plain values: written once, to common.pt.
    state.update(step=step, extra_state=extra_state, layout=_layout(model_chunks), lora=lora)
    _write_results_in_process()
    dist_checkpointing.save(state, str(tmp))
    barrier()
    records, cost = _hash_written(tmp, rank)
    if rank == 0:
        write_manifest(tmp, step, records)
        _commit(tmp, final)
        for old in prunable(root, saved=step, keep_last=keep_last):
            shutil.rmtree(old, ignore_errors=True)
        log.info("checkpoint: step %d committed: %d files, %.1f MB, %s in %.2fs on %d rank(s) (slowest rank)",
                 step, len(records), cost[0] / 1e6, HASH, cost[1], dist.get_world_size())
    barrier()
    return final


def _hash_written(tmp: Path, rank: int) -> tuple[dict[str, FileRecord], tuple[int, float]]:
    """Every rank hashes (and fsyncs) the shard files it wrote itself (Megatron names them
    ``__<rank>_<i>.distcp``), in parallel; rank 0 also the rest (common.pt, .metadata, ...).
    Returns (all records on rank 0, {} elsewhere) and (total bytes, slowest rank's seconds)."""
    start = time.perf_counter()
    names = list_files(tmp)
    mine = [n for n in names if n.startswith(f"__{rank}_")]
    records = hash_files(tmp, mine, sync=True)
    gathered = all_gather_data((records, time.perf_counter() - start), records=(FileRecord,))
    if rank != 0:
        return {}, (0, 0.0)
    merged = {name: r for part, _ in gathered for name, r in part.items()}
    merged.update(hash_files(tmp, [n for n in names if n not in merged], sync=True))
    return merged, (sum(r.size for r in merged.values()), max(max(t for _, t in gathered), time.perf_counter() - start))


def _commit(tmp: Path, final: Path) -> None:
    if final.exists():  # the same step saved again after a resume (e.g. over a corrupt one): replace it
        old = final.with_name(f".old_{final.name}")
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old)
    else:
        tmp.rename(final)
    fsync_dir(final.parent)  # the rename survives a power loss


def verify_parallel(directory: Path) -> list[str]:
    """Every problem of one step dir (empty = usable), identical on all ranks: each rank checks
    the size and sha256 of its share of the manifest's files; the problems are gathered."""
    start = time.perf_counter()
    files, problems = read_manifest(directory)
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    mine = share_of(files, rank, world)
    problems += file_problems(directory, mine, checksums=True)
    gathered = all_gather_data((problems, time.perf_counter() - start))
    merged = list(dict.fromkeys(p for part, _ in gathered for p in part))
    if not merged and rank == 0:
        size = sum(r.size for r in files.values())
        log.info("checkpoint: verified %s: %d files, %.1f MB, sizes + sha256 in %.2fs on %d rank(s)", directory,
                 len(files), size / 1e6, max(t for _, t in gathered), world)
    return merged


def _select_verified(root: Path) -> tuple[ResumePoint | None, list[str]]:
    """Newest step dir under ``root`` that passes ``verify_parallel`` (collective; rank 0's listing)."""
    candidates = broadcast_data(step_dirs(root))
    rank = dist.get_rank() if dist.is_initialized() else 0
    return select(candidates, verify_parallel, warn=rank == 0)  # one warning per bad step, not one per rank


def prepare_resume(run_dir: str | Path, resume: bool | str) -> ResumePoint | None:
    """Every rank, at start, before the model and engines are built: removes stale temp dirs,
    then picks the checkpoint to resume from. ``resume``: "require"/True (``--resume``: a
    CheckpointError naming the run dir when none is usable), "auto" (None = start fresh when
    there is no checkpoint; an error when all are unusable), "off"/False (None; an error when
    the run dir holds checkpoints). Bad newer checkpoints are skipped with a warning naming the
    file; PREEMPTED is cleared when the run continues."""
    mode, run_dir = resolve_mode(resume), Path(run_dir)
    root = run_dir / CHECKPOINTS
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        clean_stale(root)
    if mode == "off":
        refuse_fresh_start_over(run_dir)  # every rank sees the same (shared) run dir: all raise together
        return None
    point, problems = _select_verified(root)
    if resume_decision(run_dir, mode, point, problems) is None:
        if rank == 0:
            log.info("--resume=auto: no checkpoint under %s, starting fresh", root)
        return None
    if rank == 0:
        if point.skipped:
            log.warning("resuming from %s, the newest intact checkpoint (newer ones are unusable, see above)",
                        point.path)
        clear_preempted(run_dir)
    return point


def load_checkpoint(root: str | Path, *, model_chunks: list[torch.nn.Module], optimizer,
                    step: int | None = None, verify: bool = True) -> tuple[int, dict] | None:
    """Restores ``root/step_<step>`` into the model chunks, optimizer and RNG; with ``step=None``
    the newest intact one (newer corrupt ones are skipped with a warning). Returns
    ``(step, extra_state)``, or None when there is no intact checkpoint. The manifest is verified
    first (``verify=False`` when ``prepare_resume`` just did); CheckpointError naming the file when
    the requested step is corrupt. The TP/PP/VPP layout must be the saved one (ValueError
    otherwise); the DP size may differ."""
    from megatron.core import dist_checkpointing

    if step is None:
        point, _ = _select_verified(Path(root))
        if point is None:
            return None
        step, verify = point.step, False
    directory = step_dir(root, step)
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory} does not exist; available: latest is step {latest_step(root)}")
    if verify and (problems := verify_parallel(directory)):
        raise CheckpointError(f"checkpoint {directory} is unusable: " + "; ".join(problems))
    common = dist_checkpointing.load_common_state_dict(str(directory))
    saved, now = common.get("layout"), _layout(model_chunks)
    if saved != now:
        raise ValueError(f"{directory} was saved with layout {saved}, this run has {now}: resume with the same "
                         "TP/PP/VPP (the DP size may differ), or load only the weights with load_model_weights")
    adapters_only = _check_lora_match(directory, common, model_chunks)
    optim_state.prime(optimizer)  # in the layout of the optimizer in use (TE, apex, torch)
    state = _full_state(model_chunks, optimizer, is_loading=True, adapters_only=adapters_only)
    _drop_objects_missing_from(state, directory)
    loaded = dist_checkpointing.load(state, str(directory))
    _load_into_models(model_chunks, loaded, adapters_only=adapters_only)
    with torch.no_grad():  # fp32 main params can be views of the (grad-requiring) model params
        optimizer.load_state_dict(loaded["optimizer"])
    optim_state.restore_steps(optimizer, loaded["optimizer"])
    _set_rng_state(loaded["rng_state"])
    return int(loaded["step"]), loaded["extra_state"]


def _check_lora_match(directory: Path, common: dict, model_chunks) -> bool:
    """Whether ``directory`` is a LoRA checkpoint; ValueError when the model is not of the same
    kind (the driver refuses this before anything is built: ``checkpoint.adapters.lora_start``)."""
    adapters_only = common.get("lora") is not None
    has_adapters = any(is_adapter_name(name) for chunk in model_chunks for name, _ in unwrap(chunk).named_parameters())
    if adapters_only != has_adapters:
        raise ValueError(f"{directory} holds {'LoRA adapters' if adapters_only else 'full weights'}, but the model "
                         f"{'has' if has_adapters else 'has no'} LoRA adapters")
    return adapters_only


class Checkpointer:
    """The run's checkpoints: restore on ``--resume``, save when due, stop cleanly when preempted.

    It saves the policy (model, optimizer, LR schedule, RNG), the prompt cursor and the MLflow run
    id. SIGTERM / SIGUSR1 (SLURM preemption, scancel) set a flag; ``after_step`` then saves and
    writes ``PREEMPTED`` so the job can be requeued with ``--resume``. A step directory exists only
    once complete and verified by its manifest, so a kill loses at most the steps since the last save.
    """

    def __init__(self, root: str | Path, *, policy, dataset, every: int, keep_last: int, total_steps: int,
                 preempt: PreemptionFlag):
        self.root, self.policy, self.dataset = Path(root), policy, dataset
        self.every, self.keep_last, self.total_steps = every, keep_last, total_steps
        self.preempt = preempt
        """Set by SIGTERM/SIGUSR1; installed by the driver before anything slow starts."""
        self.last_saved = -1
        self.run_state: dict = {}
        """Decisions a run makes once and must keep on resume (GTPO's ``entropy_threshold: auto``):
        saved with every checkpoint, restored by ``restore`` (JSON-able values only)."""

    def restore(self, point: ResumePoint) -> tuple[int, str | None]:
        """Loads ``point`` (chosen and verified by ``prepare_resume``) into the policy and the
        dataset cursor; returns ``(step, MLflow run id)``."""
        step, extra = load_checkpoint(point.path.parent, model_chunks=self.policy.chunks,
                                      optimizer=self.policy.optimizer, step=point.step, verify=False)
        self.dataset.load_state_dict(extra["data"])
        self.policy.scheduler.load_state_dict(extra["scheduler"])
        self.run_state = dict(extra.get("run_state") or {})
        self.last_saved = step
        log.info("resumed from step %d (MLflow run %s)", step, extra.get("run_id"))
        return step, extra.get("run_id")

    def after_step(self, step: int, *, run_id: str | None, on_device=contextlib.nullcontext) -> bool:
        """Saves when due (every N steps, the last step, a preemption signal); True = stop now.
        ``on_device()``: a context the save runs in, with the policy's state on its device (the
        driver's ``Choreography.trainer_on_device`` under ``rollout.offload_trainer``)."""
        preempted = any_rank(self.preempt.set)
        if (step % self.every == 0 or step == self.total_steps or preempted) and self.last_saved != step:
            with on_device():
                self.save(step, run_id=run_id)
        if preempted:
            if dist.get_rank() == 0:
                mark_preempted(self.root.parent, step)
                log.warning("preempted: checkpoint of step %d saved, exiting (resume with --resume)", step)
            return True
        return False

    def save(self, step: int, *, run_id: str | None) -> None:
        if self.last_saved == step:
            return
        extra = {"data": self.dataset.state_dict(), "scheduler": self.policy.scheduler.state_dict(), "run_id": run_id,
                 "run_state": dict(self.run_state)}
        base = self.policy.base
        path = save_checkpoint(self.root, step=step, model_chunks=self.policy.chunks, optimizer=self.policy.optimizer,
                               extra_state=extra, keep_last=self.keep_last,
                               lora=None if base is None else lora_record(self.policy.lora, base))
        self.last_saved = step
        log.info("checkpoint: %s", path)
