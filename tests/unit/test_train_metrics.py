"""The train step's device-side metrics (train/metric_sums.py) and the observer's mismatch metric."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_gtpo.train.metric_sums import MetricSums, read
from megatron_gtpo.train.observer import mismatch_metrics


def t(x) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float64)


def test_read_gives_each_update_its_own_means_and_extrema():
    first, second = MetricSums(), MetricSums()
    first.add("loss", t(0.25), t(0.5))
    first.add("loss", t(0.75), t(0.5))  # two micro-batches: sum 1.0 over weight 1.0
    first.add_mean("train/ratio_mean", t(1.0), t(3.0))
    first.add_mean("train/ratio_mean", t(2.0), t(1.0))  # token-weighted: (3 + 2) / 4
    first.add_extremum("train/ratio_max", t(1.5), t(True), largest=True)
    first.add_extremum("train/ratio_max", t(9.0), t(False), largest=True)  # no tokens: ignored
    first.add_extremum("train/ratio_min", t(0.5), t(True), largest=False)
    first.add_extremum("train/ratio_min", t(0.25), t(True), largest=False)
    second.add("bias/clip_overshoot_rate", t(0.0), t(0.0))  # empty denominator: NaN
    second.add_extremum("mismatch/logprob_abs_max", t(3.0), t(False), largest=True)  # never present: absent
    second.add_mean("train/ratio_mean", t(4.0), t(2.0))
    one, two = read([first, second], None)
    assert one == {"loss": 1.0, "train/ratio_mean": 1.25, "train/ratio_max": 1.5, "train/ratio_min": 0.25}
    assert set(two) == {"bias/clip_overshoot_rate", "train/ratio_mean"} and two["train/ratio_mean"] == 4.0
    assert math.isnan(two["bias/clip_overshoot_rate"])
    assert read([MetricSums()], None) == [{}]


def test_nonfinite_counts_per_name():
    sums = MetricSums()
    sums.count_nonfinite("loss", t(1.0))
    assert sums.nonfinite() == {}
    sums.count_nonfinite("loss", t(float("nan")))
    sums.count_nonfinite("<H>_i", t([1.0, float("inf"), float("nan")]))
    assert sums.nonfinite() == {"loss": 1, "<H>_i": 2}


def test_mismatch_metrics_masked_mean_max_and_k3():
    trainer = torch.tensor([[-1.1, -2.0, -2.0], [-0.25, -1.0, 0.0]])
    engine = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -9.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    sums = MetricSums()
    mismatch_metrics(sums, trainer, engine, mask)
    total, count = sums.pairs["mismatch/logprob_abs_mean"].tolist()
    assert count == 3 and total / count == pytest.approx((0.1 + 0.0 + 0.25) / 3)
    metrics = read([sums], None)[0]
    assert metrics["mismatch/logprob_abs_max"] == pytest.approx(0.25)
    d = torch.tensor([-0.1, 0.0, 0.25], dtype=torch.float64)  # log(pi_train / pi_engine) on the masked tokens
    k3 = (torch.exp(d) - d - 1).sum().item()
    assert sums.pairs["mismatch/kl_k3"].tolist() == pytest.approx([k3, 3.0], rel=1e-5)
    empty = MetricSums()
    mismatch_metrics(empty, trainer, engine, torch.zeros(2, 3, dtype=torch.bool))
    metrics = read([empty], None)[0]
    assert "mismatch/logprob_abs_max" not in metrics and empty.pairs["mismatch/logprob_abs_mean"].tolist() == [0, 0]
