"""RolloutGroup's split of one generate call across the engines of a 2-rank gloo world.

The engines here are stand-ins that return one record per sample (the real-engine runs are in
tests/e2e/test_sync_megatron.py); what is checked is the placement logic: which prompts and seeds
each rank's engine is asked for, and that every rank gets the same full, correctly indexed result,
also with fewer prompts than engines (``split``: a prompt's samples shared, its seeds kept).
The workers run with strict device groups (the results travel over the gloo control plane).
"""

from __future__ import annotations

import datetime
import os

import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_gtpo.parallel import control, strict
from tests.helpers import free_port


class RecordingEngine:
    """An engine of the declared protocol (rollout/protocol.py: ``submit`` -> ``wait``) that returns a
    Completion per sample whose tokens encode (prompt uid, seed + j); the ticket is the call's result."""

    def __init__(self):
        self.calls = []

    def submit(self, prompts, *, seeds, sampling):
        from megatron_gtpo.types import Completion

        self.calls.append(([p.uid for p in prompts], list(seeds)))
        return [Completion(prompt_index=i, prompt_token_ids=list(p.token_ids), token_ids=[int(p.uid), s + j],
                           logprobs=[0.0, 0.0])
                for i, (p, s) in enumerate(zip(prompts, seeds)) for j in range(sampling.n)]

    def wait(self, ticket):
        return ticket


MODES = ("tp1", "tp2", "separate", "split")
PROMPTS = {"split": 1}
"""Prompts per call (5 unless named): ``split`` has fewer prompts than engines."""


def _worker(rank: int, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    if os.environ.get(strict.ENV, "1") == "1":  # as under tests/helpers.py::torchrun
        strict.install()
    control.init(timeout=datetime.timedelta(seconds=120))
    from megatron_gtpo.rollout.config import Sampling
    from megatron_gtpo.rollout.engine import prompt_seeds
    from megatron_gtpo.rollout.group import RolloutGroup
    from megatron_gtpo.types import Prompt

    for mode in MODES:
        engine = RecordingEngine() if mode != "separate" or rank == 0 else None
        group = RolloutGroup(engine, shard=mode != "separate", model_dir="/unused", seed=3,
                             ranks_per_engine=2 if mode == "tp2" else 1)
        count = PROMPTS.get(mode, 5)
        prompts = [Prompt(uid=str(i), token_ids=[i + 10]) for i in range(count)]
        out = group.generate(prompts, Sampling(n=2, temperature=1.0, max_tokens=4), seed=9)
        queue.put({"mode": mode, "rank": rank, "calls": engine.calls if engine else None,
                   "out": [(c.prompt_index, c.token_ids, c.prompt_token_ids is prompts[c.prompt_index].token_ids)
                           for c in out],
                   "seeds": prompt_seeds(9, count, 2)})
    dist.destroy_process_group()


def run_all() -> dict[str, dict[int, dict]]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results: dict[str, dict[int, dict]] = {}
    for _ in range(2 * len(MODES)):
        r = queue.get(timeout=300)
        results.setdefault(r["mode"], {})[r["rank"]] = r
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return results


def expected(seeds: list[int]) -> list:
    return [(i, [i, seeds[i] + j], True) for i in range(len(seeds)) for j in range(2)]


def test_every_rank_gets_the_whole_batch_in_order():
    runs = run_all()
    assert set(runs) == set(MODES)
    for mode, results in runs.items():
        seeds = results[0]["seeds"]
        for r in results.values():
            assert r["out"] == expected(seeds), (mode, r)
        calls = {rank: r["calls"] for rank, r in results.items()}
        if mode == "tp1":  # one engine per rank: contiguous shards, with the whole batch's seeds
            assert calls == {0: [(["0", "1", "2"], seeds[:3])], 1: [(["3", "4"], seeds[3:])]}
        elif mode == "split":  # 1 prompt, 2 engines: each samples one of its 2, seeded as in the whole request
            assert calls == {0: [(["0"], seeds)], 1: [(["0"], [seeds[0] + 1])]}
        elif mode == "tp2":  # one engine over both ranks: both submit the same (whole) batch
            assert calls[0] == calls[1] == [([str(i) for i in range(5)], seeds)]
        else:  # rank 0 owns the only engine
            assert calls == {0: [([str(i) for i in range(5)], seeds)], 1: None}
