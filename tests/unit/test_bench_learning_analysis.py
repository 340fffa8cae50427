"""bench/learning_analysis.py on a synthetic study whose numbers are worked out by hand.

Injected bugs, each seen failing once: the seed mean taken over the first seed only; the sign test
one-sided (p halved).
"""

from __future__ import annotations

import json

import pytest

from bench import learning_analysis as la


def test_paired_comparison_power_and_base(tmp_path):
    got = la.analyse([la.synthetic_study(tmp_path)])
    # per-prompt pass@1 averaged over 2 seeds: gtpo [0.75, 0.75, 0, 1], grpo [0.25, 0.25, 0, 1], base [0, .5, 0, 1]
    pair = got["paired"]["gtpo-grpo"]
    assert pair["mean_diff"] == pytest.approx(0.25)
    assert (pair["wins"], pair["losses"], pair["ties"]) == (2, 0, 2)
    assert pair["sign_test_p"] == pytest.approx(0.5)
    assert got["vs_base"]["gtpo"]["mean_diff"] == pytest.approx((0.75 + 0.25 + 0 + 0) / 4)
    # greedy after: gtpo 0.5/0.7 (std 0.1414), grpo 0.4/0.4 (std 0): pooled sqrt(0.02 / 2) = 0.1
    assert got["power"]["pooled_seed_std"] == pytest.approx(0.1)
    assert got["power"]["seeds_per_arm_for_0.1"] == 16


def test_sign_test_is_two_sided():
    assert la.sign_test(0, 0) == 1.0
    assert la.sign_test(5, 0) == pytest.approx(2 / 32)
    assert la.sign_test(3, 3) == 1.0


def test_quick_prints_one_line_and_a_missing_study_is_refused(capsys, tmp_path):
    assert la.main(["--quick"]) == 0
    assert json.loads(capsys.readouterr().out)["paired"]["gtpo-grpo"]["wins"] == 2
    assert la.main([str(tmp_path)]) == 2
    assert "no summary.json" in capsys.readouterr().err
