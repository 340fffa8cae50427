"""The job's engines behind one generate call: how the generation work is fanned out over ranks.

Every trainer rank calls ``RolloutGroup.generate`` with the same full prompt list and gets the same
full completion list back (the TrainBatch contract: every rank holds the whole batch and takes its
own slice). How the work is spread depends on the transport:

* colocated: **every rank is part of one engine**. vLLM joins the torchrun world at start-up, so
  all ranks must build one (``external_launcher``). With the default engine TP=1 (CPU) each rank
  holds a full-model engine, and the trainer's TP peers, which would otherwise idle during
  generation, each sample a contiguous shard of the prompts; the shards are all-gathered. With
  ``vllm.tensor_parallel_size=k`` (GPU, k = the trainer's TP) vLLM groups k consecutive ranks into
  one engine, exactly like Megatron's TP groups; the k ranks of an engine submit the same shard and
  only its first rank's copy is kept. Every prompt's seed is derived from the *whole* batch, so the
  completions do not depend on the number of engines. The exporter hands every rank the full
  tensors (``dst_ranks="all"``) and each rank loads its own engine (vLLM shards them itself).
* separate: **global rank 0 owns the one engine process**; it generates everything and broadcasts
  the completions. Only rank 0 receives full tensors from the exporter (``dst_ranks="first"``).

A world of one rank needs no communication in either case.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist

from megatron_gtpo.parallel import control
from megatron_gtpo.rollout.engine import call_seed, prompt_seeds
from megatron_gtpo.types import Completion, Prompt


class RolloutGroup:
    """The job's engines behind one generate call made on every rank."""

    def __init__(self, engine, *, shard: bool, model_dir: str,
                 seed: int = 0, ranks_per_engine: int = 1):
        self.engine = engine
        """This rank's engine (None on ranks without one): a ``RolloutEngine``, or any object with
        its ``sample``/``tokenizer``/``sleep``/``close`` API (``sync.separate.SeparateEngine``)."""
        self._shard, self._model_dir, self._seed, self._calls = shard, str(model_dir), seed, 0
        self._per_engine = ranks_per_engine
        self._tokenizer = None
        multi = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self._rank, self._world = (dist.get_rank(), dist.get_world_size()) if multi else (0, 1)
        if engine is None and not (self._world > 1 and not shard):
            raise ValueError("every rank needs an engine unless rank 0 generates for all (shard=False)")
        if self._world % ranks_per_engine:
            raise ValueError(f"world size {self._world} is not a multiple of the ranks per engine "
                             f"({ranks_per_engine} = vLLM tensor x pipeline parallel size)")

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
            seed = call_seed(self._seed, self._calls)
        self._calls += 1
        seeds = prompt_seeds(seed, len(prompts), n)
        sampling = dict(n=n, temperature=temperature, top_p=top_p, max_tokens=max_tokens, stop=stop)
        if self._world == 1:
            return self.engine.sample(prompts, seeds=seeds, **sampling)
        if self._shard:
            return self._sharded(prompts, seeds, sampling)
        mine = self.engine.sample(prompts, seeds=seeds, **sampling) if self._rank == 0 else None
        return _relink(control.broadcast_object(mine, src=0), prompts, offset=0)

    def _sharded(self, prompts: Sequence[Prompt], seeds: list[int], sampling: dict) -> list[Completion]:
        engines, index = self._world // self._per_engine, self._rank // self._per_engine
        per_engine = -(-len(prompts) // engines)
        lo, hi = min(index * per_engine, len(prompts)), min((index + 1) * per_engine, len(prompts))
        mine = self.engine.sample(prompts[lo:hi], seeds=seeds[lo:hi], **sampling) if hi > lo else []
        shards = control.all_gather_object((lo, mine))
        first_ranks = shards[::self._per_engine]  # the other ranks of an engine hold the same shard
        return [c for start, part in first_ranks for c in _relink(part, prompts, offset=start)]

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
