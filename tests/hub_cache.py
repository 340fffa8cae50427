"""A Hugging Face hub cache built on disk, in the layout ``hf download`` writes (never the network).

``HF_HOME/hub/models--Org--Name/{blobs/<sha256>, snapshots/<commit>/<file> -> ../../blobs/<sha256>,
refs/main}``: what ``huggingface_hub.snapshot_download(..., local_files_only=True)`` reads.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from huggingface_hub import constants

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def add_to_hub_cache(hf_home: Path, repo_id: str, files: dict[str, Path | bytes], repo_type: str = "model") -> Path:
    """Puts ``files`` (name -> source file or content) into the cache of ``repo_id`` (a ``model`` or
    ``dataset`` repo); returns the snapshot directory."""
    repo = Path(hf_home) / "hub" / f"{repo_type}s--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(COMMIT)
    for name, source in files.items():
        data = source if isinstance(source, bytes) else Path(source).read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(os.path.relpath(blob, link.parent))
    return snapshot


def offline_hub(hf_home: Path, monkeypatch) -> Path:
    """Points the hub library at ``hf_home`` and offline for this test (it reads both into ``constants``
    at import, so setting the environment would come too late); returns ``hf_home``."""
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(Path(hf_home) / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return Path(hf_home)
