"""Staleness k >= 2 (issue 37): the collector keeps the next k steps' batches in flight, every token
within k pushes; a checkpoint records the batches in flight and a resume trains every prompt exactly
once, at the step the uninterrupted run trains it (DAPO's refills included, k changed included); the
pool's job mode lets a push go ahead while jobs generate."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest

from megatron_gtpo.rollout.collector import DynamicSampling, OffPolicy
from megatron_gtpo.rollout.config import Sampling
from megatron_gtpo.rollout.group import RolloutGroup
from megatron_gtpo.rollout.pool import RolloutPool
from megatron_gtpo.types import Completion, Prompt
from tests.helpers import expected_versions
from tests.unit.test_collector import collector
from tests.unit.test_staleness import MIXED, SerialServer, drive, pool_sync, uids, versions_of

STEPS = 7


def trained(batches, start: int = 0) -> dict[int, list[str]]:
    return {start + 1 + i: uids(b) for i, b in enumerate(batches)}


def test_k2_trains_the_on_policy_prompts_and_seeds_at_most_two_pushes_behind():
    on, on_engines = collector(MIXED)
    off, off_engines = collector(MIXED, off_policy=OffPolicy(staleness=2, last_step=STEPS))
    on_batches, off_batches = drive(on, on_engines, STEPS), drive(off, off_engines, STEPS)
    assert trained(off_batches) == trained(on_batches) and off_engines.seeds == on_engines.seeds
    assert [versions_of(b) for b in off_batches] == [{v} for v in expected_versions(range(1, STEPS + 1), start=0,
                                                                                     staleness=2)]
    assert [b.staleness for b in off_batches] == [0, 1, 2, 2, 2, 2, 2]
    assert not off._ahead and len(off_engines.seeds) == STEPS  # nothing generated beyond the last step


def test_k2_with_one_push_too_many_raises():
    c, engines = collector(MIXED, off_policy=OffPolicy(staleness=2))
    with pytest.raises(Exception, match=r"step 3: .* 4 weight pushes old; rollout.staleness=2 allows at most 2"):
        drive(c, engines, 4, pushes_per_step=2)


@pytest.mark.parametrize("k,resume_k,refills", [(2, 2, True), (3, 3, True), (2, 1, False), (1, 3, False)])
def test_resume_at_every_step_trains_each_prompt_once_at_its_uninterrupted_step(k, resume_k, refills):
    """Kill after any step's checkpoint (the batches of the next k steps in flight), resume with
    ``resume_k``: the steps train the same prompts as the uninterrupted run; the regenerated
    batches carry the restored version (fresher, never staler than the bound). DAPO's refills are
    drawn after the batches in flight, so with them the schedule holds for an unchanged k (a resume
    with another k interleaves refills and first batches differently: still each prompt once)."""
    script = {**MIXED, 3: ["a", "a"], 8: ["b", "b"]} if refills else MIXED  # refills at two steps
    dynamic = DynamicSampling(metric="accuracy", max_tries=3) if refills else None
    full, engines = collector(script, dynamic=dynamic, off_policy=OffPolicy(staleness=k, last_step=STEPS))
    reference = trained(drive(full, engines, STEPS))
    for stop in range(1, STEPS):
        first, first_engines = collector(script, dynamic=dynamic, off_policy=OffPolicy(staleness=k, last_step=STEPS))
        before = drive(first, first_engines, stop)
        saved = first.cursor.state_dict()  # the checkpoint of step `stop`
        assert [r["step"] for r in saved.get("in_flight", [])] == list(range(stop + 1, min(stop + k, STEPS) + 1))
        resumed, resumed_engines = collector(script, dynamic=dynamic,
                                             off_policy=OffPolicy(staleness=resume_k, last_step=STEPS))
        resumed.cursor.load_state_dict(saved)
        after = drive(resumed, resumed_engines, STEPS, start=stop)
        assert {**trained(before), **trained(after, start=stop)} == reference, stop
        ids = list(itertools.chain(*trained(before).values(), *trained(after, start=stop).values()))
        assert len(ids) == len(set(ids)), stop  # each prompt trained once
        for step, batch in zip(range(stop + 1, STEPS + 1), after):
            assert max(versions_of(batch)) <= step - 1 and batch.staleness <= resume_k
            assert min(versions_of(batch)) >= min(expected_versions([step], start=stop, staleness=resume_k)), step


def test_a_malformed_in_flight_record_is_refused_when_loaded():
    c, _ = collector(MIXED, off_policy=OffPolicy(staleness=2))
    saved = {"stream": c.dataset.state_dict(), "in_flight": [{"step": 1, "cursor": {"position": 0}}]}
    with pytest.raises(ValueError, match="malformed in-flight batch record"):
        c.cursor.load_state_dict(saved)
    bad_cursor = {"stream": c.dataset.state_dict(),
                  "in_flight": [{"step": 1, "cursor": {**c.dataset.state_dict(), "fingerprint": "x"}, "prompts": 2}]}
    with pytest.raises(ValueError, match="data cursor mismatch on 'fingerprint'"):
        c.cursor.load_state_dict(bad_cursor)


class JobServer(SerialServer):
    """SerialServer with the job requests: ``submit`` is answered at once, the job generates on the
    version served *when its completions are fetched* (what a server that keeps generating across a
    push and continues its requests returns: first token of the submit version, then the newer one)."""

    def __init__(self, address: str, log: list):
        super().__init__(address, log)
        self.jobs = {}

    def submit_job(self, job, partial, prompts, seeds, sampling) -> None:
        self.log.append((self.address, "submit", job, partial))
        self.jobs[job] = (list(prompts), list(seeds), sampling, self.version)

    def send(self, op: str, args: dict | None = None, blobs=()) -> None:
        if op == "fetch":
            self.queue.append(("fetch", args))
            self.log.append((self.address, "send", "fetch"))
        else:
            super().send(op, args, blobs)

    def generated(self, prompts):
        op, args = self.queue.pop(0)
        assert op == "fetch"
        sent, seeds, sampling, version = self.jobs.pop(args["job"])
        assert sent == list(prompts)
        self.log.append((self.address, "answer", "fetch"))
        return self.version, [Completion(prompt_index=i, prompt_token_ids=p.token_ids, token_ids=[seeds[i], 0],
                                         logprobs=[-0.5, -0.5], weight_version=version,
                                         token_versions=[version, self.version])
                              for i, p in enumerate(prompts) for _ in range(sampling.n)]


def test_pool_jobs_generate_across_a_push_which_does_not_wait_for_them():
    log: list = []
    pool = RolloutPool([JobServer("s0", log), JobServer("s1", log)], model_dir="unused", partial="continue")
    group, sync = RolloutGroup(pool, shard=False, model_dir="unused"), pool_sync(pool)
    prompts = [Prompt(uid=f"p{k}", token_ids=[k]) for k in range(3)]
    sampling = Sampling(n=2, temperature=1.0, top_p=1.0, max_tokens=4)
    first, second = group.submit(prompts, sampling, seed=7), group.submit(prompts, sampling, seed=9)
    assert [e for e in log if e[1] == "submit"] == [("s0", "submit", 1, "continue"), ("s1", "submit", 1, "continue"),
                                                   ("s0", "submit", 2, "continue"), ("s1", "submit", 2, "continue")]
    sync.push(SimpleNamespace(buckets=lambda nbytes: []), version=1)
    assert not any(e[2] == "fetch" for e in log if len(e) == 3)  # the push did not wait for the jobs
    for generation in (first, second):
        out = generation.wait()
        assert [c.prompt_index for c in out] == [0, 0, 1, 1, 2, 2]
        assert {tuple(c.versions()) for c in out} == {(0, 1)}  # continued across the push
    assert pool.prompts_served == {"s0": 4, "s1": 2}
