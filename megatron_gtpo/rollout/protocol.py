"""What the rest of the stack may ask of a rollout engine: the declared protocols (structural types).

    Engine         what RolloutGroup drives on every rank (rollout/group.py): submit -> wait, sleep,
                   wake_up, close. RolloutEngine (in this process) and RolloutPool (rank 0's pool of
                   rollout servers) both implement it; nobody asks which one it is.
    LocalWeights   an engine in this process that a colocated push loads into (sync/colocated.py);
                   its EngineWeights part (weight names, dtype, version check) is what every push checks.
    ServerPool     rank 0's pool as the separate weight transport drives it (sync/separate.py).
    WeightReceiver the weight side a rollout server is composed with (sync/receiver.py provides it,
                   cli/rollout_server.py plugs it in): its requests (:class:`Op`), over the
                   :class:`ServerContext` the server hands it (its engine as :class:`ServedEngine`,
                   and the ``swapping()`` block a weight change runs in while jobs generate).

``submit`` starts one generate call and returns a ticket; ``wait`` returns its completions. An
engine in this process generates inside ``submit`` (an immediate future: there is nothing on the
same processes to overlap with); a pool sends the requests and returns, and its servers generate
while the trainer trains (``rollout.staleness: 1``).

``sync/`` reaches engines only through these protocols (and the records of rollout/config.py); it
never imports an engine implementation, the pool or the server, and no code tells engine kinds
apart by their attributes (tests/unit/test_layering.py). What crosses the network is declared
elsewhere: the generate requests in rollout/messages.py, the push requests in sync/wire.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from megatron_gtpo.rollout.config import Sampling
from megatron_gtpo.types import Completion, Prompt
from megatron_gtpo.utils.rendezvous import KeyValueHost


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

    def sleep(self, *, keep_weights: bool = False) -> None:
        """Frees accelerator memory the engine shares with the trainer (no-op where it shares none);
        ``keep_weights``: the weights wait on the host and come back with the next wake-up (no push needed)."""

    def wake_up(self, tags: Sequence[str] = ("weights", "kv_cache")) -> None:
        """Re-allocates ``weights`` (before a push) and/or ``kv_cache`` (before generating)."""

    def close(self) -> None:
        """Releases the engine."""


class EngineWeights(Protocol):
    """What every push checks against, whichever way it loads: the engine's weight names, dtype and
    served version."""

    @property
    def model_dir(self) -> str:
        """The HF directory the engine was built from (its config.json defines the weight names)."""

    @property
    def dtype(self) -> torch.dtype:
        """The engine's weight dtype (pushes are cast to it)."""

    def check_version(self, version: int) -> None:
        """Raises ValueError unless ``version`` may follow the served one."""


class LocalWeights(EngineWeights, Protocol):
    """An engine in this process, as a colocated weight push loads into it."""

    @property
    def tensor_parallel_size(self) -> int:
        """Ranks one engine spans (vLLM's TP): what each rank receives depends on it (sync/shards.py)."""

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int,
                     sharded: bool = False) -> None:
        """Loads a whole push (HF names, engine dtype; this rank's TP shards when ``sharded``) and
        serves ``version``."""


class ServerPool(Protocol):
    """Rank 0's pool of rollout servers, as the separate weight transport drives a push.

    A push is a few requests (sync/wire.py), each sent to every server before any answer is awaited,
    so the servers work in parallel: ``join`` (each server's worker 0 joins its transfer group),
    ``plan`` (the whole push checked before any byte moves), ``receive`` (buckets arrive over the
    transfer group into the server's staging), ``commit`` or ``abort``. Every server answers its
    requests in order. Failures never raise here: they come back by server address (a server that
    is gone, timed out or refused), and the transport decides for the whole push."""

    def servers(self) -> list[tuple[str, dict]]:
        """``(address, hello info)`` of every server, in pool order; the info holds at least the
        engine's ``tp`` and its served ``version``."""

    secret_path: Path | str
    """The job-secret file the servers were started with: the senders read it to join the transfer
    groups (its contents never travel)."""

    def drain(self) -> None:
        """Waits for the generate call in flight, if any: a push never overlaps a generation (raises
        the call's own failure)."""

    def post(self, op: str, args: dict, *, skip: Sequence[str] = ()) -> dict[str, str]:
        """Sends request ``op`` with ``args`` to every server whose address is not in ``skip``,
        without waiting; the failures by address."""

    def collect(self, *, skip: Sequence[str] = (), timeout_s: float | None = None) -> dict[str, str]:
        """Takes the answer of every server (not in ``skip``) with a request outstanding, waiting up
        to ``timeout_s`` each (None: the pool's timeout); the failures by address."""


# ------------------------------------------------------------------------ inside a rollout server

class ServedEngine(EngineWeights, Protocol):
    """A rollout server's engine, as its weight receiver drives it (vLLM's weight-transfer calls run
    in the engine's workers through :meth:`rpc`)."""

    @property
    def weight_version(self) -> int:
        """The version being served."""

    def rpc(self, method: str, **kwargs) -> list:
        """vLLM's ``collective_rpc`` of ``method`` on every worker of the engine."""

    def loaded(self, version: int, *, ok: bool) -> None:
        """Records a reload the workers made themselves: serves ``version`` when ``ok``, else refuses
        to generate until a later load succeeds."""


Handler = Callable[[dict, list], "tuple[dict, list] | dict | None"]
"""A request handler: (schema-checked args, blobs) -> result dict (and blobs) or None."""


@dataclass(frozen=True)
class Op:
    """One request a rollout server answers: the schema of its ``args`` (utils/channel.py ``check``)
    and its handler."""

    schema: dict
    handle: Handler


@dataclass(frozen=True, kw_only=True)
class ServerContext:
    """What a weight receiver gets from the server it is composed into."""

    engine: ServedEngine
    rendezvous: KeyValueHost
    """Open it (``with ctx.rendezvous.open(join_id, timeout_s=...)``) while a transfer group forms."""
    address: tuple[str, int]
    """Where this server's vLLM workers reach its port (for the rendezvous)."""
    timeout_s: float
    """Longest wait inside one request (transfer-group rendezvous, one bucket)."""
    swapping: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    """The block a weight change (the commit's reload) runs in: the server's background generation
    (rollout/inflight.py) pauses between two engine steps around it and, if the version changed,
    continues or restarts the requests in flight."""


class WeightReceiver(Protocol):
    """The weight side of a rollout server (``sync/receiver.py`` provides one)."""

    vllm_kwargs: dict
    """Merged into the engine's ``vllm.LLM`` arguments (weight-transfer backend, worker extension)."""

    def bind(self, ctx: ServerContext) -> dict[str, Op]:
        """Its requests by name, over the built engine."""

    def drop(self) -> None:
        """The trainer went away: nothing staged survives it."""
