"""Where the engines of a torchrun job live, and how one generate call uses them.

Every trainer rank calls ``RolloutGroup.generate`` with the same full prompt list and gets the same
full completion list back (the TrainBatch contract: every rank holds the whole batch and takes its
own slice). How the work is spread depends on the transport:

* colocated: **every rank holds one engine** holding the full model (engine TP=1). vLLM joins the
  torchrun world at start-up, so all ranks must build one (``external_launcher``); the trainer's TP
  peers, which would otherwise idle during generation, each sample a contiguous shard of the
  prompts, and the shards are all-gathered. Every prompt's seed is derived from the *whole* batch,
  so the completions do not depend on the number of ranks. The exporter hands every rank the full
  tensors (``dst_ranks="all"``) and each rank loads its own engine.
* separate: **global rank 0 owns the one engine process**; it generates everything and broadcasts
  the completions. Only rank 0 receives full tensors from the exporter (``dst_ranks="first"``).

A world of one rank needs no communication in either case.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist

from megatron_gtpo.rollout.config import RolloutConfig
from megatron_gtpo.rollout.engine import _SEED_SPACE, RolloutEngine, prompt_seeds
from megatron_gtpo.sync.base import WeightSync
from megatron_gtpo.sync.colocated import ColocatedSync
from megatron_gtpo.sync.config import SyncConfig
from megatron_gtpo.sync.separate import SeparateEngine, SeparateSync
from megatron_gtpo.types import Completion, Prompt


class RolloutGroup:
    """The job's engines behind one generate call made on every rank."""

    def __init__(self, engine: RolloutEngine | SeparateEngine | None, *, shard: bool, model_dir: str,
                 seed: int = 0):
        self.engine = engine
        """This rank's engine (None on ranks without one)."""
        self._shard, self._model_dir, self._seed, self._calls = shard, str(model_dir), seed, 0
        self._tokenizer = None
        multi = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self._rank, self._world = (dist.get_rank(), dist.get_world_size()) if multi else (0, 1)
        if engine is None and not (self._world > 1 and not shard):
            raise ValueError("every rank needs an engine unless rank 0 generates for all (shard=False)")

    @property
    def tokenizer(self):
        """The policy's Hugging Face tokenizer (also on ranks without an engine)."""
        if self.engine is not None:
            return self.engine.tokenizer
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self._model_dir)
        return self._tokenizer

    def generate(self, prompts: list[Prompt], *, n: int, temperature: float, top_p: float,
                 max_tokens: int, stop: list[str] | None = None, seed: int | None = None) -> list[Completion]:
        """As :meth:`RolloutEngine.generate`; the same result on every rank."""
        if seed is None:
            seed = hash((self._seed, self._calls)) % _SEED_SPACE
        self._calls += 1
        seeds = prompt_seeds(seed, len(prompts), n)
        sampling = dict(n=n, temperature=temperature, top_p=top_p, max_tokens=max_tokens, stop=stop)
        if self._world == 1:
            return self.engine.sample(prompts, seeds=seeds, **sampling)
        if self._shard:
            return self._sharded(prompts, seeds, sampling)
        box = [self.engine.sample(prompts, seeds=seeds, **sampling) if self._rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return _relink(box[0], prompts, offset=0)

    def _sharded(self, prompts: Sequence[Prompt], seeds: list[int], sampling: dict) -> list[Completion]:
        per_rank = -(-len(prompts) // self._world)
        lo, hi = min(self._rank * per_rank, len(prompts)), min((self._rank + 1) * per_rank, len(prompts))
        mine = self.engine.sample(prompts[lo:hi], seeds=seeds[lo:hi], **sampling) if hi > lo else []
        shards: list = [None] * self._world
        dist.all_gather_object(shards, (lo, mine))
        return [c for start, part in shards for c in _relink(part, prompts, offset=start)]

    def sleep(self) -> None:
        """Frees accelerator memory for training where the engine shares the trainer's devices."""
        if self.engine is not None:
            self.engine.sleep()

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()


def _relink(completions: list[Completion], prompts: Sequence[Prompt], *, offset: int) -> list[Completion]:
    """Global prompt indices, and each group's prompt ids as the caller's own list again."""
    for c in completions:
        c.prompt_index += offset
        c.prompt_token_ids = prompts[c.prompt_index].token_ids
    return completions


def build_rollout(rollout: RolloutConfig, sync: SyncConfig, *, model_dir: str) -> tuple[RolloutGroup, WeightSync]:
    """The job's engines and the syncer that feeds them; call on every rank at the same point."""
    return _TRANSPORTS[sync.transport](rollout, sync, str(model_dir))


def _colocated(rollout: RolloutConfig, sync: SyncConfig, model_dir: str) -> tuple[RolloutGroup, WeightSync]:
    engine = RolloutEngine(model_dir=model_dir, vllm_kwargs=rollout.vllm, seed=rollout.seed)
    return RolloutGroup(engine, shard=True, model_dir=model_dir, seed=rollout.seed), ColocatedSync(engine)


def _separate(rollout: RolloutConfig, sync: SyncConfig, model_dir: str) -> tuple[RolloutGroup, WeightSync]:
    first = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
    engine = SeparateEngine(model_dir=model_dir, vllm_kwargs=rollout.vllm, seed=rollout.seed,
                            timeout_s=sync.timeout_s) if first else None
    return RolloutGroup(engine, shard=False, model_dir=model_dir, seed=rollout.seed), SeparateSync(engine)


_TRANSPORTS = {"colocated": _colocated, "separate": _separate}
