"""pass@k against its closed form, maj@k on hand cases (ties included), mean@k."""

import math
from fractions import Fraction

import pytest

from megatron_gtpo.eval.metrics import ProblemSamples, benchmark_metrics, maj_at_k, mean_at_k, pass_at_k


@pytest.mark.parametrize("n,c,k,expected", [
    (5, 2, 2, 0.7),  # 1 - C(3,2)/C(5,2) = 1 - 3/10
    (4, 1, 1, 0.25),
    (10, 0, 5, 0.0),
    (10, 10, 1, 1.0),
    (10, 7, 4, 1.0),  # fewer than k wrong samples: every k-subset holds a correct one
    (64, 1, 64, 1.0),
    (64, 1, 8, 0.125),  # 1 - C(63,8)/C(64,8) = 8/64
])
def test_pass_at_k_hand_cases(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_matches_closed_form_on_a_grid():
    for n in range(1, 21):
        for c in range(n + 1):
            for k in range(1, n + 1):
                exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
                assert pass_at_k(n, c, k) == pytest.approx(float(exact), abs=1e-12), (n, c, k)


def test_pass_at_k_rejects_impossible_inputs():
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match="c <= n"):
        pass_at_k(4, 5, 1)


def test_maj_at_n_is_the_plain_vote_and_abstentions_do_not_vote():
    assert maj_at_k(["1", "2", "2", None], [False, True, True, False], 4) == 1.0
    assert maj_at_k([None, None, "3"], [False, False, False], 3) == 0.0
    assert maj_at_k([None, None], [False, False], 2) == 0.0  # nobody answered


def test_maj_ties_go_to_the_earliest_sample():
    assert maj_at_k(["5", "7"], [False, True], 2) == 0.0
    assert maj_at_k(["7", "5"], [True, False], 2) == 1.0
    # k=2 of 3: subsets {0,1}, {0,2}, {1,2}; ties resolved by the lowest sample index in the subset
    assert maj_at_k(["a", "a", "b"], [True, True, False], 2) == 1.0
    assert maj_at_k(["b", "a", "a"], [False, True, True], 2) == pytest.approx(1 / 3)


def test_maj_at_1_is_the_mean_accuracy():
    answers, correct = ["1", None, "2", "1", "3"], [True, False, False, True, False]
    assert maj_at_k(answers, correct, 1) == pytest.approx(2 / 5)


def test_maj_random_subsets_agree_with_enumeration():
    answers = [str(i % 3) for i in range(20)]
    correct = [a == "1" for a in answers]
    exact = maj_at_k(answers, correct, 10, max_exact_subsets=200_000)
    sampled = maj_at_k(answers, correct, 10, max_exact_subsets=10, num_resamples=4000, seed=1)
    assert 0 < exact < 1 and sampled == pytest.approx(exact, abs=0.03)
    assert maj_at_k(answers, correct, 10, max_exact_subsets=10, num_resamples=500, seed=1) == \
        maj_at_k(answers, correct, 10, max_exact_subsets=10, num_resamples=500, seed=1)  # seeded


def test_mean_at_k_uses_the_first_k_samples():
    assert mean_at_k([True, False, False, True], 2) == 0.5
    assert mean_at_k([True, False, False, True], 4) == 0.5
    assert mean_at_k([False, True], 1) == 0.0
    with pytest.raises(ValueError):
        mean_at_k([True], 2)


def test_benchmark_metrics_average_over_problems():
    problems = [ProblemSamples(uid="a", answers=["1", "1", "2", "1"], correct=[True, True, False, True]),
                ProblemSamples(uid="b", answers=["9", "8", None, "9"], correct=[False, True, False, False])]
    m = benchmark_metrics(problems, [1, 4])
    assert m["pass@1"] == pytest.approx((3 / 4 + 1 / 4) / 2)
    assert m["pass@4"] == 1.0
    assert m["maj@4"] == 0.5  # a: "1" wins (right); b: "9" wins (wrong)
    assert m["mean@4"] == m["pass@1"]  # pass@1 is c/n, as is the mean over all n samples
    assert m["mean@1"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="at least one problem"):
        benchmark_metrics([], [1])
