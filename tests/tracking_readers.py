"""What W&B and TensorBoard hold for a run directory, read back from their own files: TensorBoard's
event files through its ``EventAccumulator`` (which applies its purge rule for restarts), W&B's
offline ``.wandb`` logs (every history row of every process start) through wandb's own record proto."""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK, HEADER = 32768, 7  # the .wandb file is a LevelDB-style log: 32 KiB blocks, 7-byte record headers
FULL, LAST = 1, 4


def tensorboard_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} of the run's TensorBoard run (one subdirectory per journal),
    in the order TensorBoard shows them, duplicates included."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    runs = [d for d in (run_dir / "tensorboard").iterdir() if d.is_dir()]
    assert len(runs) == 1, f"expected one TensorBoard run in {run_dir / 'tensorboard'}: {runs}"
    acc = EventAccumulator(str(runs[0]), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _records(path: Path):
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    pos, chunk = HEADER, b""
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # block trailer padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        pos += HEADER
        chunk += data[pos:pos + length]
        pos += length
        if kind in (FULL, LAST):
            record = pb.Record()
            record.ParseFromString(chunk)
            chunk = b""
            yield record


def wandb_history(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """{key: [(step, value), ...]} over every offline run directory of ``run_dir/wandb`` (one per
    process start), in file then row order, duplicates included; W&B's own keys (``_step``,
    ``_runtime``, ...) left out."""
    out: dict[str, list[tuple[int, float]]] = {}
    for log in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        for record in _records(log):
            if record.WhichOneof("record_type") != "history":
                continue
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            for key, value in row.items():
                if not key.startswith("_"):
                    out.setdefault(key, []).append((int(row["_step"]), float(value)))
    return out


def wandb_exit_codes(run_dir: Path) -> list[int]:
    """The exit code each offline run directory of ``run_dir/wandb`` ended with, in start order."""
    codes = []
    for log in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        codes += [r.exit.exit_code for r in _records(log) if r.WhichOneof("record_type") == "exit"]
    return codes


def wandb_config(run_dir: Path) -> dict:
    """The W&B run's config as its offline logs hold it (the last value of each key)."""
    config = {}
    for log in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        for record in _records(log):
            kind = record.WhichOneof("record_type")
            items = record.config.update if kind == "config" else record.run.config.update if kind == "run" else []
            config.update({item.key: json.loads(item.value_json) for item in items})
    return config
