"""What the rest of the stack may ask of a rollout engine: the declared protocols (structural types).

    Engine        what RolloutGroup drives on every rank (rollout/group.py): submit -> wait, sleep,
                  wake_up, close. RolloutEngine (in this process) and RolloutPool (rank 0's pool of
                  rollout servers) both implement it; nobody asks which one it is.
    LocalWeights  an engine in this process that a colocated push loads into (sync/colocated.py).
    ServerPool    rank 0's pool as the separate weight transport drives it (sync/separate.py).

``submit`` starts one generate call and returns a ticket; ``wait`` returns its completions. An
engine in this process generates inside ``submit`` (an immediate future: there is nothing on the
same processes to overlap with); a pool sends the requests and returns, and its servers generate
while the trainer trains (``rollout.staleness: 1``).

``sync/`` reaches engines only through these protocols (and the records of rollout/config.py); it
never imports an engine implementation, and no code tells engine kinds apart by their attributes
(tests/unit/test_layering.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import torch

from megatron_gtpo.rollout.config import Sampling
from megatron_gtpo.types import Completion, Prompt


class Engine(Protocol):
    """One engine (or pool of them) as a rank's :class:`~megatron_gtpo.rollout.group.RolloutGroup` uses it."""

    @property
    def tokenizer(self) -> Any:
        """The policy's Hugging Face tokenizer."""

    def submit(self, prompts: Sequence[Prompt], *, seeds: Sequence[int], sampling: Sampling) -> Any:
        """Starts generating ``sampling.n`` completions per prompt (sample j of prompt i seeded with
        ``seeds[i] + j``); returns the ticket :meth:`wait` takes."""

    def wait(self, ticket: Any) -> list[Completion]:
        """The completions of ``ticket``'s call, grouped by prompt, in prompt order."""

    def sleep(self) -> None:
        """Frees accelerator memory the engine shares with the trainer (no-op where it shares none)."""

    def wake_up(self, tags: Sequence[str] = ("weights", "kv_cache")) -> None:
        """Re-allocates ``weights`` (before a push) and/or ``kv_cache`` (before generating)."""

    def close(self) -> None:
        """Releases the engine."""


class LocalWeights(Protocol):
    """An engine in this process, as a colocated weight push loads into it."""

    @property
    def model_dir(self) -> str:
        """The HF directory the engine was built from (its config.json defines the weight names)."""

    @property
    def dtype(self) -> torch.dtype:
        """The engine's weight dtype (pushes are cast to it)."""

    @property
    def tensor_parallel_size(self) -> int:
        """Ranks one engine spans (vLLM's TP): what each rank receives depends on it (sync/shards.py)."""

    def check_version(self, version: int) -> None:
        """Raises ValueError unless ``version`` may follow the served one."""

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int,
                     sharded: bool = False) -> None:
        """Loads a whole push (HF names, engine dtype; this rank's TP shards when ``sharded``) and
        serves ``version``."""


class ServerPool(Protocol):
    """Rank 0's pool of rollout servers, as the separate weight transport drives a push.

    Requests are the push's steps, in order: ``join`` (every server's workers join their transfer
    group), ``plan`` (the whole push checked before any byte moves), ``receive`` (buckets arrive over
    the transfer group into the server's staging), ``commit`` or ``abort``. Every server answers its
    requests in order; failures raise RuntimeError (a server that is gone, timed out or refused),
    which the transport collects per server address."""

    @property
    def servers(self) -> list[tuple[str, dict]]:
        """``(address, hello info)`` of every server, in pool order; the info holds at least the
        engine's ``tp`` (its workers' ranks in the transfer group) and its served ``version``."""

    def drain(self) -> None:
        """Waits for the generate call in flight, if any: a push never overlaps a generation."""

    def post(self, address: str, request: str, *args: Any) -> None:
        """Sends one push request to one server without waiting for its answer."""

    def answer(self, address: str, timeout_s: float | None = None) -> Any:
        """The answer to the oldest request posted to that server (waits up to ``timeout_s``)."""
