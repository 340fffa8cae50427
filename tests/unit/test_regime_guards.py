"""The regime guards (tracking/guards.py): each fires once, after its window, naming the key to change.

Injected bugs, each seen failing once: the window ignored (fires at step 1); firing on every step
after the bound instead of once.
"""

from __future__ import annotations

from megatron_gtpo.tracking.guards import GUARDS, RegimeGuards


def steps(metric: str, values):
    guards = RegimeGuards()
    return [guards.check({metric: v, "reward/mean": 0.0}) for v in values]


def test_shift_guard_fires_once_after_five_dominated_steps_and_names_the_keys():
    fired = steps("gtpo/shift_share", [0.9, 0.8, 0.7, 0.6, 0.9, 0.95, 0.99])
    assert [len(f) for f in fired] == [0, 0, 0, 0, 1, 0, 0]
    name, text = fired[4][0]
    assert name == "gtpo_shift_dominates"
    assert "algo.entropy_gamma_relative" in text and "reward.fn=gtpo" in text and "0.78" in text


def test_a_mean_at_or_below_the_bound_never_fires():
    assert not any(steps("gtpo/shift_share", [0.5] * 10))
    assert not any(steps("gtpo/shift_share", [1.0, 0.0, 0.0] * 10))   # windows of 0.4 and 0.2


def test_filter_and_truncation_guards_name_their_keys():
    (name, text), = steps("gtpo/filtered_frac", [1.0] * 5)[-1]
    assert name == "gtpo_filter_drops_all" and "algo.entropy_threshold" in text
    (name, text), = steps("completion/truncated_frac", [0.8] * 5)[-1]
    assert name == "most_completions_truncated" and "rollout.max_tokens" in text


def test_every_guard_watches_a_documented_metric():
    from megatron_gtpo.metrics import METRICS

    assert {g.metric for g in GUARDS} <= set(METRICS)
