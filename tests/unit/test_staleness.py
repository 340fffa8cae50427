"""Off-policy rollouts (``rollout.staleness`` = k, ``rollout.partial``): the version bookkeeping of
rollout/staleness.py (per token), the collector's schedule (rollout/collector.py) under a simulated
driver loop at k = 1 and 2, the prompt cursor a checkpoint saves and what a resume trains (every
prompt once, at the step the uninterrupted run trains it), the config rules, and the pool against a
serial stand-in for a rollout server: one generate call in flight that a push waits for, or jobs
that generate across pushes."""

from __future__ import annotations

import time
import typing
from types import SimpleNamespace

import pytest

from megatron_gtpo.config import ConfigError, load_config
from megatron_gtpo.rollout.collector import DynamicSampling, OffPolicy, rollout_metrics
from megatron_gtpo.rollout.config import RolloutConfig, Sampling
from megatron_gtpo.rollout.group import RolloutGroup
from megatron_gtpo.rollout.staleness import PARTIAL_MODES, PolicyVersions, StalenessError, staleness_problem
from megatron_gtpo.sync.base import WeightSync
from megatron_gtpo.rollout.pool import RolloutPool
from megatron_gtpo.sync.separate import PoolSync
from megatron_gtpo.types import Completion, Prompt
from tests.helpers import expected_versions
from tests.unit.test_collector import collector

MIXED = {k: ["a", "b"] for k in range(40)}  # every group has one right and one wrong answer


def drive(c, engines, steps: int, *, start: int = 0, pushes_per_step: int = 1):
    """The driver's calls: the start push, then per step collect, train (nothing here) and push the
    step's weights (``pushes_per_step`` > 1 pushes extra versions: more than one step off)."""
    engines.version = start
    c.pushed(start)
    batches = []
    for step in range(start + 1, steps + 1):
        batch = c.collect(step, prompts_per_step=2)
        batches.append(batch)
        if batch.groups:  # the driver skips training and the push when nothing was kept
            for extra in range(pushes_per_step):
                engines.version = step * 10 + extra if pushes_per_step > 1 else step
                c.pushed(engines.version)
    return batches


def versions_of(batch) -> set[int]:
    return {c.weight_version for g in batch.groups for c in g.completions}


def uids(batch) -> list[str]:
    return [g.prompt.uid for g in batch.groups]


# ----------------------------------------------------------------------------- version bookkeeping

def test_policy_versions_count_pushes_not_version_numbers():
    v = PolicyVersions(bound=1)
    v.pushed(0)  # the start push of version 0 again changes nothing
    assert (v.current, v.history) == (0, [0])
    v.pushed(3)
    v.pushed(5)  # step 4 pushed nothing (DAPO kept no group): 3 is one push old, not two
    assert (v.age(5), v.age(3), v.age(0)) == (0, 1, 2)
    assert v.history == [0, 3, 5]
    v.pushed(6)
    assert v.history == [3, 5, 6] and v.age(0) > 1  # trimmed: anything older is out of bounds anyway
    with pytest.raises(StalenessError, match="never pushed"):
        v.age(4)
    with pytest.raises(StalenessError, match="never decrease"):
        v.pushed(2)


def test_check_tags_and_bound_name_the_step_and_versions():
    v = PolicyVersions(bound=1, history=[0, 1, 2])
    tagged = lambda version: Completion(prompt_index=0, prompt_token_ids=[1], token_ids=[2], logprobs=[0.0],  # noqa: E731
                                        weight_version=version)
    v.check_tags([tagged(2), tagged(2)], expected=2, step=3)
    with pytest.raises(StalenessError, match=r"step 3: a completion generated from weight version 2 on \(pushed since: "
                                             r"\[2\]\) carries token versions v1 x1"):
        v.check_tags([tagged(2), tagged(1)], expected=2, step=3)
    assert v.check_bound([tagged(2), tagged(1)], step=3) == (1, 0.5)
    assert v.check_bound([], step=3) == (0, 0.0)
    with pytest.raises(StalenessError, match=r"step 3: trains the weights of version 2 on tokens of version 0, "
                                             r"2 weight pushes old; rollout.staleness=1 allows at most 1"):
        v.check_bound([tagged(0), tagged(2)], step=3)


def spanning(*spans, weight_version=None):
    """A completion whose tokens were sampled by the versions of ``spans`` ((version, tokens), ...)."""
    versions = [v for v, n in spans for _ in range(n)]
    return Completion(prompt_index=0, prompt_token_ids=[1], token_ids=[5] * len(versions),
                      logprobs=[0.0] * len(versions), token_versions=versions,
                      weight_version=versions[0] if weight_version is None else weight_version)


def test_per_token_versions_of_continued_requests_are_checked_token_by_token():
    v = PolicyVersions(bound=2, history=[0, 1, 2, 3])
    v.check_tags([spanning((1, 3), (2, 2), (3, 1)), spanning((3, 4))], expected=1, step=4)
    assert v.check_bound([spanning((1, 3), (2, 2), (3, 1))], step=4) == (2, pytest.approx((3 * 2 + 2 * 1) / 6))
    for bad, why in [(spanning((2, 1), (1, 1)), "v2 x1, v1 x1"),       # decreasing along the completion
                     (spanning((1, 1), (5, 1)), "v1 x1, v5 x1"),       # a version never pushed
                     (spanning((0, 2)), "v0 x2"),                      # older than the call
                     (spanning((1, 2), weight_version=2), "v1 x2")]:   # weight_version is not the first token's
        with pytest.raises(StalenessError, match=why):
            v.check_tags([bad], expected=1, step=4)
    with pytest.raises(StalenessError, match="on tokens of version 0, 3 weight pushes old"):
        v.check_bound([spanning((3, 5), (3, 1)), spanning((0, 1), (3, 1))], step=4)
    batch = SimpleNamespace(groups=[SimpleNamespace(completions=[spanning((1, 3), (2, 1)), spanning((2, 4))],
                                                    rewards=[1.0, 0.0], correct=[True, False])],
                            tries=1, dropped_groups=0, staleness=1, staleness_mean=0.375, reward_stats={})
    m = rollout_metrics(batch)
    assert (m["rollout/weight_version_min"], m["rollout/weight_version_max"], m["rollout/partial_frac"],
            m["rollout/staleness_mean"]) == (1, 2, 0.5, 0.375)


def test_expected_versions():
    assert expected_versions(range(1, 6), start=0, staleness=1) == [0, 0, 1, 2, 3]
    assert expected_versions(range(1, 6), start=0, staleness=0) == [0, 1, 2, 3, 4]
    assert expected_versions(range(3, 6), start=2, staleness=1) == [2, 2, 3]


# ----------------------------------------------------------------------------- config

def test_staleness_needs_an_importance_correction():
    assert staleness_problem(0, "none") is None and staleness_problem(1, "tis") is None
    assert staleness_problem(1, "mis") is None
    with pytest.raises(ConfigError, match=r"rollout.staleness=1 with algo.mismatch_correction='none' is not allowed.*"
                                          r"set algo.mismatch_correction=tis"):
        load_config(None, ["rollout.staleness=1"])
    with pytest.raises(ConfigError, match=r"rollout.staleness=-1 is not allowed: expected an integer >= 0"):
        load_config(None, ["rollout.staleness=-1", "algo.mismatch_correction=tis"])
    assert load_config(None, ["rollout.staleness=3", "algo.mismatch_correction=tis"]).rollout.in_flight_pushes() == "off"
    with pytest.raises(ConfigError, match=r"rollout.partial='sometimes' is not allowed: expected one of 'off', 'abort'"):
        load_config(None, ["rollout.partial=sometimes"])
    assert load_config(None, ["rollout.partial=off"]).rollout.partial == "off"  # YAML 1.1 reads a bare off as False
    assert typing.get_args(typing.get_type_hints(RolloutConfig)["partial"]) == PARTIAL_MODES
    with pytest.raises(ConfigError, match=r"rollout.partial='continue' is not allowed: expected off with staleness=0"):
        load_config(None, ["rollout.partial=continue", "sync.transport=separate"])
    with pytest.raises(ConfigError, match=r"rollout.partial=abort is not allowed with sync.transport=colocated.*"
                                          r"set rollout.partial=off, or sync.transport=separate"):
        load_config(None, ["rollout.partial=abort", "rollout.staleness=1", "algo.mismatch_correction=tis"])
    cfg = load_config(None, ["rollout.partial=continue", "rollout.staleness=1", "algo.mismatch_correction=tis",
                             "sync.transport=separate"])
    assert cfg.rollout.in_flight_pushes() == "continue"
    assert load_config(None, ["rollout.staleness=1", "algo.mismatch_correction=tis"]).rollout.in_flight_pushes() is None
    cfg = load_config(None, ["rollout.staleness=1", "algo.mismatch_correction=mis"])
    assert cfg.rollout.staleness == 1


# ----------------------------------------------------------------------------- the collector's schedule

def test_one_step_off_trains_the_same_prompts_and_seeds_one_version_behind():
    on, on_engines = collector(MIXED)
    off, off_engines = collector(MIXED, off_policy=OffPolicy(staleness=1, last_step=5))
    on_batches, off_batches = drive(on, on_engines, 5), drive(off, off_engines, 5)
    assert [uids(b) for b in off_batches] == [uids(b) for b in on_batches]  # same prompts per step
    assert off_engines.seeds == on_engines.seeds  # same seeds, in the same order
    assert [versions_of(b) for b in on_batches] == [{v} for v in expected_versions(range(1, 6), start=0, staleness=0)]
    assert [versions_of(b) for b in off_batches] == [{v} for v in expected_versions(range(1, 6), start=0, staleness=1)]
    assert [b.staleness for b in on_batches] == [0] * 5
    assert [b.staleness for b in off_batches] == [0, 1, 1, 1, 1]
    m = rollout_metrics(off_batches[3])
    assert (m["rollout/weight_version_min"], m["rollout/weight_version_max"], m["rollout/staleness_max"]) == (2, 2, 1)
    assert not off._ahead and len(off_engines.seeds) == 5  # nothing generated beyond the last step


def test_more_than_one_push_behind_raises():
    c, engines = collector(MIXED, off_policy=OffPolicy(staleness=1))
    with pytest.raises(StalenessError, match=r"step 2: .* 2 weight pushes old; rollout.staleness=1 allows at most 1"):
        drive(c, engines, 3, pushes_per_step=2)


def test_a_push_that_did_not_reach_the_engines_is_caught_by_the_tags():
    c, engines = collector(MIXED)
    c.pushed(0)
    c.collect(1, prompts_per_step=2)
    c.pushed(1)  # the driver pushed version 1, the engines still serve 0
    with pytest.raises(StalenessError, match=r"step 2: a completion generated from weight version 1 on .* carries "
                                             r"token versions v0 x1"):
        c.collect(2, prompts_per_step=2)


def test_collecting_out_of_order_while_a_batch_is_in_flight_raises():
    c, engines = collector(MIXED, off_policy=OffPolicy(staleness=1))
    c.collect(1, prompts_per_step=2)
    with pytest.raises(RuntimeError, match=r"collect\(3\) called while the rollout batch of step 2 is the next in flight"):
        c.collect(3, prompts_per_step=2)


def test_checkpoint_cursor_leaves_out_the_batch_in_flight_and_a_resume_regenerates_it():
    full, full_engines = collector(MIXED, off_policy=OffPolicy(staleness=1))
    batches = drive(full, full_engines, 2)
    saved = full.cursor.state_dict()  # what a checkpoint of step 2 holds; step 3's batch is in flight
    assert [a.step for a in full._ahead] == [3]
    assert saved["stream"]["position"] == 6 and full.dataset.position == 6  # the stream is past step 3's prompts
    assert [(r["step"], r["cursor"]["position"], r["prompts"]) for r in saved["in_flight"]] == [(3, 4, 2)]
    step3 = full.collect(3, prompts_per_step=2)
    resumed, engines = collector(MIXED, off_policy=OffPolicy(staleness=1))
    resumed.cursor.load_state_dict(saved)
    again = drive(resumed, engines, 4, start=2)
    assert uids(again[0]) == uids(step3) and engines.seeds[0] == full_engines.seeds[2]  # regenerated, same draw
    assert versions_of(again[0]) == {2} and again[0].staleness == 0  # with the restored weights
    assert versions_of(again[1]) == {2} and again[1].staleness == 1  # then one step off again
    assert [uids(b) for b in batches] == [["p0", "p1"], ["p2", "p3"]]


def test_dynamic_sampling_refills_with_the_current_weights():
    script = {**MIXED, 2: ["a", "a"]}  # step 2's first try: p2 is all right (dropped), p3 is kept
    c, engines = collector(script, dynamic=DynamicSampling(metric="accuracy", max_tries=3),
                           off_policy=OffPolicy(staleness=1))
    batches = drive(c, engines, 2)
    assert uids(batches[1]) == ["p3", "p4"] and batches[1].tries == 2
    assert [{x.weight_version for x in g.completions} for g in batches[1].groups] == [{0}, {1}]
    assert batches[1].staleness == 1


# ----------------------------------------------------------------------------- the pool in the background

class SerialServer:
    """A rollout server's control link as the pool sees it (rollout/pool.py ``ServerLink``): requests are
    answered one at a time, in the order sent; generate tags its completions with the version served; a
    commit switches versions. ``log`` records what was sent and answered."""

    def __init__(self, address: str, log: list):
        self.address, self.info, self.version, self.queue, self.log = address, {"tp": 1}, 0, [], log
        self.sent_at: list[float] = []  # when each generate call was sent: it "generates" until answered

    @property
    def pending(self) -> int:
        return len(self.queue)

    def send(self, op: str, args: dict | None = None, blobs=()) -> None:
        self.queue.append((op, args or {}))
        self.log.append((self.address, "send", op))

    def recv(self, timeout_s=None):
        op, args = self.queue.pop(0)
        self.log.append((self.address, "answer", op))
        if op == "commit":
            self.version = args["version"]
        return {"version": self.version}, []

    def submit_generate(self, prompts, seeds, sampling) -> None:
        self.queue.append(("generate", (list(prompts), list(seeds), sampling)))
        self.log.append((self.address, "send", "generate"))
        self.sent_at.append(time.time())

    def generated(self, prompts):
        op, (sent, seeds, sampling) = self.queue.pop(0)
        assert op == "generate" and sent == list(prompts)
        self.log.append((self.address, "answer", "generate"))
        return self.version, [Completion(prompt_index=i, prompt_token_ids=p.token_ids, token_ids=[seeds[i]],
                                         logprobs=[-0.5], weight_version=self.version)
                              for i, p in enumerate(prompts) for _ in range(sampling.n)]

    def answer(self, prompts):
        """``generated`` plus the window a real server reports: from the request to its answer."""
        version, completions = self.generated(prompts)
        return version, completions, (self.sent_at.pop(0), time.time()) if self.sent_at else None

    def close(self, *, stop: bool) -> None:
        self.log.append((self.address, "close", stop))


def pool_sync(pool: RolloutPool) -> PoolSync:
    """A PoolSync on rank 0 of a world of one over ``pool`` without transfer groups (an empty push
    plan: no bucket moves, but every control step of a push runs: plan, receive, verify, commit)."""
    sync = PoolSync.__new__(PoolSync)
    WeightSync.__init__(sync, SimpleNamespace(dims=SimpleNamespace(pp=1), bucket_bytes=1 << 20))
    sync._pool, sync._timeout, sync.sent_bytes = pool, 10.0, 0
    sync.servers = pool.servers()
    sync._stage, sync._groups = None, []
    return sync


def test_pool_generates_in_the_background_and_a_push_waits_for_it():
    log: list = []
    pool = RolloutPool([SerialServer("s0", log), SerialServer("s1", log)], model_dir="unused")
    group, sync = RolloutGroup(pool, shard=False, model_dir="unused"), pool_sync(pool)
    prompts = [Prompt(uid=f"p{k}", token_ids=[k]) for k in range(3)]
    sampling = Sampling(n=2, temperature=1.0, top_p=1.0, max_tokens=4)
    in_flight = group.submit(prompts, sampling, seed=7)
    assert [e[1] for e in log] == ["send", "send"]  # sent; nothing received yet: the trainer goes on
    stats = sync.push(SimpleNamespace(buckets=lambda nbytes: []), version=1)
    assert stats.version == 1
    # the push first took both answers of the generate call, then planned, received, committed
    assert [e[1:] for e in log if e[0] == "s0"] == [("send", "generate"), ("answer", "generate"), ("send", "plan"),
                                                    ("answer", "plan"), ("send", "receive"), ("answer", "receive"),
                                                    ("send", "verify"), ("answer", "verify"),
                                                    ("send", "commit"), ("answer", "commit")]
    old = in_flight.wait()
    assert [c.prompt_index for c in old] == [0, 0, 1, 1, 2, 2] and {c.weight_version for c in old} == {0}
    assert {c.weight_version for c in group.generate(prompts, sampling, seed=8)} == {1}


def test_a_new_call_waits_for_the_one_in_flight_and_close_drains():
    log: list = []
    pool = RolloutPool([SerialServer("s0", log)], model_dir="unused")
    prompts = [Prompt(uid="p0", token_ids=[0])]
    one = Sampling(n=1, temperature=1.0, top_p=1.0, max_tokens=4)
    first = pool.submit(prompts, seeds=[1], sampling=one)
    second = pool.submit(prompts, seeds=[2], sampling=one)
    assert [e[1:] for e in log] == [("send", "generate"), ("answer", "generate"), ("send", "generate")]
    assert [c.token_ids for c in pool.wait(second)] == [[2]] and [c.token_ids for c in pool.wait(first)] == [[1]]
    pool.submit(prompts, seeds=[3], sampling=one)
    pool.close()
    assert log[-2:] == [("s0", "answer", "generate"), ("s0", "close", False)]
