"""Manifest checks on real Megatron checkpoints (2 ranks, DP=2, distributed optimizer, fp32, CPU).

Usage: ckpt_manifest.py WORK. Trains 3 steps of the tiny Qwen2 model of ckpt_resume.py, saving
each into WORK/run/checkpoints (keep_last=3); then, for each kind of damage done to a copy's
step 3, a fresh differently initialised model resumes: prepare_resume must pick step 2, name
the damaged file, and the load must restore step 2's weights. Also: a corrupt step asked for
by number, a run dir whose checkpoints are all damaged, stale temp dirs and PREEMPTED, and a
re-save of step 3 over the damaged one (pruning keeps the intact steps).
Every rank prints RESULT lines (see ckpt_resume.report).
"""

import logging
import shutil
import sys
from pathlib import Path

import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_gtpo.checkpoint.store import CheckpointError, load_checkpoint, prepare_resume, save_checkpoint
from megatron_gtpo.checkpoint.files import step_dir, verify
from tests.dist.scripts.ckpt_resume import extra_for, report, setup, train_step

DAMAGE = {
    "truncate": ("__1_0.distcp", lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])),
    "delete_common": ("common.pt", lambda p: p.unlink()),
    "delete_metadata": (".metadata", lambda p: p.unlink()),
    "flip_bytes": ("__0_0.distcp", lambda p: _flip(p)),
    "no_manifest": ("manifest.json", lambda p: p.unlink()),
}


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


class Collect(logging.Handler):
    """The megatron_gtpo log lines of this rank (what the user would read)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(f"{record.levelname} {record.getMessage()}")

    def take(self) -> list[str]:
        lines, self.lines = self.lines, []
        return lines


def fingerprint(chunks) -> list[float]:
    params = [p.detach().double() for c in chunks for p in c.parameters()]
    return [sum(float(p.sum()) for p in params), sum(float(p.abs().sum()) for p in params)]


def copy_run(work: Path, name: str, damaged: tuple[int, ...], kind: str) -> Path:
    """WORK/<name>: a copy of WORK/run with ``kind`` damage done to the given steps (rank 0)."""
    target = work / name
    if dist.get_rank() == 0:
        shutil.copytree(work / "run", target)
        file, damage = DAMAGE[kind]
        for step in damaged:
            damage(step_dir(target / "checkpoints", step) / file)
    dist.barrier()
    return target


def reference(work: Path, logs: Collect) -> dict[int, list[float]]:
    dims, chunks, opt = setup(1, 1, init_seed=1)
    prints = {}
    for step in (1, 2, 3):
        train_step(step, dims, chunks, opt)
        save_checkpoint(work / "run" / "checkpoints", step=step, model_chunks=chunks, optimizer=opt, keep_last=3,
                        extra_state=extra_for(step))
        prints[step] = fingerprint(chunks)
    report(mode="saved", logs=logs.take(), prints=prints,
           problems=[verify(step_dir(work / "run" / "checkpoints", s), checksums=True) for s in (1, 2, 3)])
    ps.destroy_model_parallel()
    return prints


def fallbacks(work: Path, logs: Collect) -> None:
    dims, chunks, opt = setup(1, 1, init_seed=999)  # other weights: the load must overwrite them
    for kind in DAMAGE:
        run_dir = copy_run(work, kind, (3,), kind)
        point = prepare_resume(run_dir, "require")
        step, extra = load_checkpoint(point.path.parent, model_chunks=chunks, optimizer=opt, step=point.step,
                                      verify=False)
        report(mode="fallback", kind=kind, step=step, extra=extra, skipped=list(point.skipped), logs=logs.take(),
               print=fingerprint(chunks))
    # The same damage found by load_checkpoint itself (no prepare_resume first), and a step asked for by number.
    root = work / "truncate" / "checkpoints"
    step, _ = load_checkpoint(root, model_chunks=chunks, optimizer=opt)
    try:
        load_checkpoint(root, model_chunks=chunks, optimizer=opt, step=3)
        error = None
    except CheckpointError as err:
        error = str(err)
    report(mode="load", step=step, error=error, logs=logs.take())
    # After falling back to step 2: step 3 is trained and saved again over the damaged one.
    train_step(3, dims, chunks, opt)
    save_checkpoint(root, step=3, model_chunks=chunks, optimizer=opt, keep_last=2, extra_state=extra_for(3))
    report(mode="resaved", print=fingerprint(chunks), kept=sorted(p.name for p in root.iterdir()),
           problems=verify(step_dir(root, 3), checksums=True), logs=logs.take())
    ps.destroy_model_parallel()


def edge_cases(work: Path, logs: Collect) -> None:
    run_dir = copy_run(work, "all_bad", (1, 2, 3), "truncate")
    errors = {}
    for mode in ("require", "auto"):
        try:
            prepare_resume(run_dir, mode)
            errors[mode] = None
        except CheckpointError as err:
            errors[mode] = str(err)
    report(mode="all_bad", errors=errors, logs=logs.take())
    run_dir = copy_run(work, "stale", (), "truncate")
    if dist.get_rank() == 0:
        (run_dir / "checkpoints" / ".tmp_step_00000004").mkdir()
        (run_dir / "checkpoints" / ".old_step_00000002").mkdir()
        (run_dir / "PREEMPTED").write_text("3\n")
    dist.barrier()
    point = prepare_resume(run_dir, "require")
    dist.barrier()
    report(mode="stale", step=point.step, left=sorted(p.name for p in (run_dir / "checkpoints").iterdir()),
           preempted=(run_dir / "PREEMPTED").exists(), logs=logs.take())
    empty = work / "fresh"
    report(mode="fresh", point=prepare_resume(empty, "auto"), logs=logs.take())


def main():
    work = Path(sys.argv[1])
    dist.init_process_group("gloo")
    logs = Collect()
    logger = logging.getLogger("megatron_gtpo")
    logger.addHandler(logs)
    logger.setLevel(logging.INFO)
    reference(work, logs)
    fallbacks(work, logs)
    edge_cases(work, logs)
    dist.barrier()


if __name__ == "__main__":
    main()
