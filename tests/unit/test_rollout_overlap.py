"""``rollout/overlap_s``: the interval arithmetic (rollout/overlap.py), the window a server's answer
carries (rollout/messages.py), and the pool's measure of a train phase against the serial stand-in
of a server (tests/unit/test_staleness.py), one step off (the call generates across the phase)
and on-policy (answered before it starts). The end-to-end proof is in tests/e2e/test_staleness.py.

Proved against: intervals summed without merging (3 union cases fail, and the two-server pool
reports 200% of the phase); the pool draining its call in ``submit`` (the one-step-off test fails)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

import megatron_gtpo.rollout.messages as msg
from megatron_gtpo.rollout.config import Sampling
from megatron_gtpo.rollout.group import RolloutGroup
from megatron_gtpo.rollout.overlap import covered_seconds, overlap_metrics
from megatron_gtpo.rollout.pool import RolloutPool
from megatron_gtpo.types import Completion, Prompt
from megatron_gtpo.utils.channel import SchemaError, check
from tests.unit.test_staleness import SerialServer, pool_sync


@pytest.mark.parametrize(("intervals", "expected"), [
    ([], 0.0),
    ([(0.0, 1.0)], 0.0),  # ends where the window starts
    ([(12.0, 15.0)], 0.0),  # after it
    ([(2.0, 4.0)], 2.0),  # inside
    ([(0.0, 20.0)], 10.0),  # covers it: clipped to the window
    ([(5.0, 8.0), (2.0, 6.0)], 6.0),  # overlapping servers count once (unsorted on purpose)
    ([(2.0, 3.0), (2.0, 3.0)], 1.0),  # the same second on two servers: once
    ([(0.0, 3.0), (5.0, 6.0), (9.0, 30.0)], 5.0),  # clipped at both ends, a gap between
    ([(2.0, 8.0), (3.0, 4.0)], 6.0),  # one inside another
    ([(4.0, 2.0), (3.0, 3.0)], 0.0),  # reversed or empty: nothing
])
def test_covered_seconds_is_the_union_of_the_intervals_inside_the_window(intervals, expected):
    assert covered_seconds(intervals, (1.0, 11.0)) == pytest.approx(expected)


def test_overlap_metrics_are_seconds_and_the_share_of_the_window():
    assert overlap_metrics([(0.0, 3.0)], (1.0, 5.0)) == {"rollout/overlap_s": 2.0, "rollout/overlap_frac": 0.5}
    assert overlap_metrics([(0.0, 3.0)], (1.0, 1.0)) == {"rollout/overlap_s": 0.0, "rollout/overlap_frac": 0.0}


def test_the_answer_carries_the_window_and_a_forged_one_is_refused():
    done = [Completion(prompt_index=0, prompt_token_ids=[5], token_ids=[1], logprobs=[-0.1], weight_version=2)]
    result, _ = msg.encode_completions(2, done, window=(100.0, 101.5))
    check(result, msg.GENERATE_REPLY)
    assert msg.decode_window(result) == (100.0, 101.5)
    plain, _ = msg.encode_completions(2, done)  # nothing generated (or an older server): no window
    check(plain, msg.GENERATE_REPLY)
    assert "window" not in plain and msg.decode_window(plain) is None
    for forged in ([101.5, 100.0], [1.0], [1.0, 2.0, 3.0], [float("nan"), 1.0], [0.0, float("inf")]):
        with pytest.raises(SchemaError, match="window"):
            msg.decode_window({**result, "window": forged})
    with pytest.raises(SchemaError, match="window"):
        check({**result, "window": ["a", "b"]}, msg.GENERATE_REPLY)


def _pool_group(partial=None):
    pool = RolloutPool([SerialServer("s0", []), SerialServer("s1", [])], model_dir="unused", partial=partial)
    return pool, RolloutGroup(pool, shard=False, model_dir="unused", overlap=pool.overlap)


PROMPTS = [Prompt(uid=f"p{k}", token_ids=[k]) for k in range(3)]
SAMPLING = Sampling(n=2, temperature=1.0, top_p=1.0, max_tokens=4)


def _train() -> tuple[float, float]:
    start = time.time()
    time.sleep(0.05)
    return start, time.time()


def test_one_step_off_the_servers_generate_through_the_train_phase():
    pool, group = _pool_group()
    group.submit(PROMPTS, SAMPLING, seed=7)  # the next step's call, sent before the step trains
    window = _train()
    pool_sync(pool).push(SimpleNamespace(buckets=lambda nbytes: []), version=1)  # drains the call
    m = group.overlap(*window)
    assert m["rollout/overlap_s"] > 0 and m["rollout/overlap_frac"] == pytest.approx(1.0)
    assert group.overlap(window[1] + 1.0, window[1] + 2.0)["rollout/overlap_s"] == 0.0  # nothing in flight then
    assert pool._windows == []  # windows that ended before the phase are forgotten


def test_on_policy_the_call_is_answered_before_the_train_phase():
    pool, group = _pool_group()
    group.generate(PROMPTS, SAMPLING, seed=7)  # staleness 0: submit and wait, then train
    window = _train()
    pool_sync(pool).push(SimpleNamespace(buckets=lambda nbytes: []), version=1)
    assert group.overlap(*window) == {"rollout/overlap_s": 0.0, "rollout/overlap_frac": 0.0}


def test_no_overlap_is_logged_where_it_is_not_measured():
    assert _pool_group(partial="continue")[1].overlap(0.0, 1.0) == {}  # a job's window comes steps later
    assert RolloutGroup(SimpleNamespace(), shard=False, model_dir="unused").overlap(0.0, 1.0) == {}  # colocated
