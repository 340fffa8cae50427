"""LoRA checkpoints: the base model's identity and the checks that keep adapters on their base.

A LoRA run's step dir holds the adapters and their optimizer state only (``store.py`` keeps the
``.lora.`` entries of the model's sharded state dict; the optimizer holds nothing else). The base
is not copied: ``common.pt`` records, under ``lora``, the LoRA settings the adapters were trained
with and the base's identity: its resolved path and a sha256 over its weight files (the
safetensors of an HF directory, the dist-checkpoint files of a Megatron one). Adapters on another
base compute something else without any error, so a resume (and ``megatron-gtpo convert``) hashes
the base it is given and refuses a mismatch before anything is built.

Hashing reads the whole base once (sha256 at ~1.4 GB/s per core): the ranks of a job split the
files between them (largest first), so an 8B bf16 base (16 GB in 4 files) costs about 3 s on 8
ranks, and its pages are then in the page cache for the weight load that follows.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from megatron_gtpo.checkpoint.files import FileRecord, hash_files, list_files, share_of
from megatron_gtpo.convert.offline import checkpoint_model_dir
from megatron_gtpo.models.hf_config import has_hf_weights, read_hf_config
from megatron_gtpo.models.resolve import resolve_model
from megatron_gtpo.models.shape import shape_from_hf_config
from megatron_gtpo.parallel import control
from megatron_gtpo.train.lora import LoraConfig, check_rank_fits
from megatron_gtpo.utils.configuration import ConfigError

log = logging.getLogger("megatron_gtpo")
RECORD = "lora"
"""Key of the LoRA record in a step dir's common state (absent or None: a full fine-tuning checkpoint)."""
SHAPE_FIELDS = ("rank", "alpha", "target_modules", "share_a")
"""LoRA settings that fix the adapters' shapes and meaning: a resume must use the saved ones."""


@dataclass(frozen=True, kw_only=True)
class BaseIdentity:
    """Which frozen base a LoRA run's adapters belong to."""

    path: str
    """The base's resolved directory (model.path after resolution) when the run started."""
    sha256: str
    """sha256 over ``(file name, file sha256)`` of every weight file, in name order."""
    files: int
    """Weight files hashed."""
    bytes: int
    """Their total size."""


def weight_files(model_dir: Path) -> tuple[Path, list[str]]:
    """(directory, names) of the files that hold a base's weights: the safetensors (and their
    index) of an HF directory, every file of a Megatron dir's dist checkpoint otherwise."""
    if has_hf_weights(model_dir):
        return model_dir, sorted(p.name for p in model_dir.iterdir()
                                 if p.name.endswith(".safetensors") or p.name == "model.safetensors.index.json")
    ckpt = checkpoint_model_dir(model_dir)
    return ckpt, list_files(ckpt)


def identify_base(model_dir: str | Path) -> BaseIdentity:
    """The identity of the base in ``model_dir``; collective in a multi-rank job (each rank hashes
    its share of the files, the digests are gathered), identical on every rank."""
    start = time.perf_counter()
    model_dir = Path(model_dir).resolve()
    directory, names = weight_files(model_dir)
    sizes = {name: FileRecord((directory / name).stat().st_size, "") for name in names}
    rank, world = control.world()
    mine = hash_files(directory, list(share_of(sizes, rank, world)))
    records = {name: r for part in control.all_gather_data(mine, records=(FileRecord,)) for name, r in part.items()}
    digest = hashlib.sha256()
    for name in names:
        digest.update(f"{name}\0{records[name].digest}\n".encode())
    identity = BaseIdentity(path=str(model_dir), sha256=digest.hexdigest(), files=len(names),
                            bytes=sum(r.size for r in records.values()))
    log.info("LoRA base %s: %d weight file(s), %.1f MB, sha256 %s... in %.2fs", model_dir, identity.files,
             identity.bytes / 1e6, identity.sha256[:12], time.perf_counter() - start)
    return identity


def lora_record(cfg: LoraConfig, base: BaseIdentity) -> dict:
    """What a LoRA step dir's common state stores under :data:`RECORD` (plain values)."""
    return {"config": {"rank": cfg.rank, "alpha": cfg.alpha, "dropout": cfg.dropout,
                       "target_modules": list(cfg.target_modules), "share_a": cfg.share_a},
            "base": asdict(base)}


def saved_lora(step_dir: Path) -> dict | None:
    """The LoRA record of a committed step dir (None: saved by a full fine-tuning run)."""
    from megatron.core import dist_checkpointing

    return dist_checkpointing.load_common_state_dict(str(step_dir)).get(RECORD)


def saved_config(record: dict) -> LoraConfig:
    """The LoraConfig a record was saved with."""
    return LoraConfig(**record["config"])


def check_same_base(record: dict, base: BaseIdentity, *, source: str, field: str = "model.path") -> None:
    """ConfigError when ``base`` is not the base ``record`` was trained on (``source``: the step
    dir, named in the message with the recorded path and hash and the fix)."""
    saved = record["base"]
    if saved["sha256"] != base.sha256:
        raise ConfigError(
            f"{field}={base.path}: its weights (sha256 {base.sha256[:16]}..., {base.files} file(s)) are not the "
            f"base the LoRA adapters of {source} were trained on ({saved['path']}, sha256 {saved['sha256'][:16]}..., "
            f"{saved['files']} file(s)); point {field} at that base (same weight files), or start a new run")


def check_same_lora(record: dict, cfg: LoraConfig, *, source: str) -> None:
    """ConfigError naming every LoRA setting that fixes the adapters' shapes and differs from the saved one."""
    saved = saved_config(record)
    diffs = [f"model.lora.{name}={getattr(cfg, name)!r} (saved: {getattr(saved, name)!r})" for name in SHAPE_FIELDS
             if _norm(name, getattr(cfg, name)) != _norm(name, getattr(saved, name))]
    if diffs:
        raise ConfigError(f"{source} holds LoRA adapters of other settings: {'; '.join(diffs)}; resume with the saved "
                          "settings, or start a new run")


def _norm(name: str, value):
    if name == "target_modules":  # q_proj, k_proj, v_proj and linear_qkv name the same adapter
        return tuple(t.name for t in LoraConfig(rank=1, target_modules=list(value)).targets())
    return value


def lora_start(model, point_dir: Path | None) -> BaseIdentity | None:
    """The driver's LoRA checks before anything is built (``model``: the ModelConfig, ``point_dir``:
    the step dir a resume starts from): the rank fits every adapted layer, the base is identified,
    and a resume point holds adapters of the same settings on the same base (or, without LoRA, full
    weights). Returns the base's identity (None without LoRA)."""
    record = saved_lora(point_dir) if point_dir is not None else None
    source = str(point_dir)
    if not model.lora.enabled:
        if record is not None:
            raise ConfigError(f"{source} holds LoRA adapters (rank {record['config']['rank']}) on the base "
                              f"{record['base']['path']}, not full weights; resume with model.lora.rank="
                              f"{record['config']['rank']} (and the saved model.lora settings)")
        return None
    model_dir = resolve_model(model.path)
    check_rank_fits(model.lora, shape_from_hf_config(read_hf_config(model_dir), name=str(model.path)))
    if point_dir is not None and record is None:
        raise ConfigError(f"{source} holds full weights (saved without LoRA); model.lora.rank={model.lora.rank} "
                          "cannot resume it: drop model.lora.rank, or start a new run")
    if record is not None:
        check_same_lora(record, model.lora, source=source)
    base = identify_base(model_dir)
    if record is not None:
        check_same_base(record, base, source=source)
    return base
