"""Hugging Face hub ids as ``model.path`` (``Qwen/Qwen2.5-3B-Instruct``), resolved through ``huggingface_hub``.

The local cache comes first (``HF_HOME`` / ``HF_HUB_CACHE``, the layout ``hf download`` writes), so
a cluster that pre-fetched the weights never touches the network; a missing file is downloaded
unless ``HF_HUB_OFFLINE=1``, with ``HF_TOKEN`` for gated repositories (read by the hub library
itself, never logged). What each caller needs is all it fetches: the cluster dry-run only
``config.json``, ``train --dry-run`` also the tokenizer, training the whole snapshot.
"""

from __future__ import annotations

import re
from pathlib import Path

CONFIG_ONLY = ("config.json",)
"""What ``megatron-gtpo dry-run`` reads: the shape of the model."""

METADATA = ("config.json", "generation_config.json", "tokenizer*", "special_tokens_map.json", "vocab*",
            "merges.txt", "*.model", "*.tiktoken", "chat_template*")
"""What ``train --dry-run`` reads: the shape and the tokenizer (prompts are tokenised), no weights."""

WEIGHTS = ("*.safetensors", "*.bin", "*.pt")

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def is_hub_id(name: str) -> bool:
    """``org/name`` that is not an existing path: a hub id (``./org/name`` or ``/x/y`` are paths)."""
    return bool(_HUB_ID.fullmatch(name)) and not Path(name).expanduser().exists()


def download_hint(repo_id: str, patterns: tuple[str, ...] | None) -> str:
    """The command that fills the cache on a machine with network (same HF_HOME as the job)."""
    include = "".join(f" --include '{p}'" for p in patterns or ())
    return f"`hf download {repo_id}{include}` (huggingface_hub >= 1.0; older: `huggingface-cli download {repo_id}`)"


def hub_snapshot(repo_id: str, patterns: tuple[str, ...] | None = None) -> Path:
    """The cached snapshot directory of ``repo_id`` holding ``patterns`` (None: the whole model,
    weights included); downloads what is missing unless offline. FileNotFoundError names the repo,
    the cache it looked in and the command that fills it."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError, \
        RepositoryNotFoundError

    cached = _cached(repo_id, patterns)
    if cached is not None:
        return cached
    where = f"the Hugging Face cache {constants.HF_HUB_CACHE} (HF_HOME / HF_HUB_CACHE)"
    fetch = download_hint(repo_id, patterns)
    if constants.is_offline_mode():
        raise FileNotFoundError(f"model.path={repo_id!r}: no such local directory, and not in {where} while "
                                f"HF_HUB_OFFLINE is set; download it on a machine with network: {fetch}")
    try:
        path = Path(snapshot_download(repo_id, allow_patterns=list(patterns) if patterns else None))
    except GatedRepoError:
        raise FileNotFoundError(f"model.path={repo_id!r} is a gated repository: accept its license on its hub page, "
                                f"then export HF_TOKEN (a read token) or run `hf auth login`") from None
    except RepositoryNotFoundError:
        raise FileNotFoundError(f"model.path={repo_id!r}: no such repository on the hub (or a private one: export "
                                f"HF_TOKEN), and no such local directory") from None
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as err:
        raise FileNotFoundError(f"model.path={repo_id!r}: no such local directory, not in {where}, and the download failed "
                                f"({type(err).__name__}: {str(err)[:200]}); fetch it with {fetch}") from None
    if _cached(repo_id, patterns) is None:
        raise FileNotFoundError(f"model.path={repo_id!r}: the downloaded snapshot {path} has no "
                                f"{'weights' if patterns is None else 'config.json'}")
    return path


def _cached(repo_id: str, patterns: tuple[str, ...] | None) -> Path | None:
    """The local snapshot (``refs/main``) when it holds config.json and what the caller needs (the
    tokenizer for METADATA, weights for None); None otherwise. Never touches the network."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        path = Path(snapshot_download(repo_id, local_files_only=True))
    except (LocalEntryNotFoundError, OSError, ValueError):
        return None
    if not (path / "config.json").is_file():
        return None
    # a cluster dry-run leaves only config.json: train --dry-run needs the tokenizer, training the weights
    needs = WEIGHTS if patterns is None else ("tokenizer*",) if "tokenizer*" in patterns else ()
    if needs and not any(next(path.glob(p), None) for p in needs):
        return None
    return path
