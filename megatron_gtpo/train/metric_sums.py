"""One update's metrics and finiteness flags, accumulated on the device and read once.

Every micro-batch's loss adds to a :class:`MetricSums` without reading a device value (no host
sync): means travel as ``(sum, count)`` pairs, extrema as a running min/max with a count of the
micro-batches that had a value (a micro-batch without loss tokens has no ratio minimum), and
non-finite values are counted per name. The step reads the counts of non-finite values once per
update, before ``optimizer.step()`` (:meth:`MetricSums.nonfinite`), and every update's metrics once
per step, reduced over data parallelism in one pair of collectives (:func:`read`).
"""

from __future__ import annotations

import math

import torch

from megatron_gtpo.parallel import collectives

Tensor = torch.Tensor
F64 = torch.float64


class MetricSums:
    """The metrics of one update on one rank (last pipeline stage), all device tensors."""

    def __init__(self):
        self.pairs: dict[str, Tensor] = {}
        """name -> [sum, count] float64."""
        self.extrema: dict[str, tuple[Tensor, Tensor]] = {}
        """``min:name`` / ``max:name`` -> (running extremum, micro-batches with a value) float64."""
        self.bad: dict[str, Tensor] = {}
        """What -> how many non-finite values it held in this update."""

    def add(self, name: str, total: Tensor, count: Tensor) -> None:
        """Adds one micro-batch's ``(sum, count)`` of metric ``name`` (0-d tensors)."""
        pair = torch.stack([total.detach().to(F64), count.to(F64)])
        self.pairs[name] = self.pairs[name] + pair if name in self.pairs else pair

    def add_mean(self, name: str, mean: Tensor, count: Tensor) -> None:
        """Adds a micro-batch mean over ``count`` items (weighted by its count in the global mean)."""
        count = count.to(F64)
        self.add(name, mean.detach().to(F64) * count, count)

    def add_extremum(self, name: str, value: Tensor, present: Tensor, *, largest: bool) -> None:
        """Min (``largest=False``) or max of ``value`` over the micro-batches where ``present`` holds."""
        key = f"{'max' if largest else 'min'}:{name}"
        value, present = value.detach().to(F64), present.to(F64)
        value = torch.where(present > 0, value, -math.inf if largest else math.inf)
        if key in self.extrema:
            old, seen = self.extrema[key]
            value, present = (torch.maximum if largest else torch.minimum)(old, value), seen + present
        self.extrema[key] = (value, present)

    def add_token_metrics(self, metrics: dict[str, Tensor], tokens: Tensor) -> None:
        """Adds the metrics of ``algo.compute_loss`` / ``algo.mismatch_weights`` for one micro-batch:
        means over its ``tokens`` masked tokens, weighted by that count (the reduced value is the
        global-batch mean), and ``*_min``/``*_max`` extrema (from micro-batches with tokens)."""
        for name, value in metrics.items():
            if name.endswith(("_min", "_max")):
                self.add_extremum(name, value, tokens > 0, largest=name.endswith("_max"))
            else:
                self.add_mean(name, value, tokens)

    def count_nonfinite(self, what: str, values: Tensor) -> None:
        """Counts the NaN/inf entries of ``values`` under ``what`` (read by :meth:`nonfinite`)."""
        bad = (~torch.isfinite(values.detach())).sum()
        self.bad[what] = self.bad[what] + bad if what in self.bad else bad

    def nonfinite(self) -> dict[str, int]:
        """What held non-finite values in this update, and how many (one host read; {} when none)."""
        if not self.bad:
            return {}
        counts = torch.stack(list(self.bad.values())).tolist()
        return {what: int(n) for what, n in zip(self.bad, counts) if n}


def read(updates: list[MetricSums], group) -> list[dict[str, float]]:
    """Every update's metrics, identical on every rank of ``group`` (the last stage's DP group): sums
    and counts summed over the group, extrema reduced, then ONE host read for all of them. Means are
    ``sum / count`` (NaN for count 0); an extremum no micro-batch had is left out. The names of each
    update must be the same on every rank of ``group`` (they follow from the algorithm and the
    update's index)."""
    device = collectives.comm_device()
    empty = torch.zeros(0, dtype=F64, device=device)
    means, extrema, pairs, seen, maxima = [], [], [empty], [empty], [empty]
    for k, update in enumerate(updates):
        for name in sorted(update.pairs):
            means.append((k, name))
            pairs.append(update.pairs[name])
        for key in sorted(update.extrema):
            value, count = update.extrema[key]
            largest = key.startswith("max:")
            extrema.append((k, key[4:], largest))
            seen.append(count.reshape(1))
            maxima.append((value if largest else -value).reshape(1))
    # [sum, count] of every mean, then the micro-batch counts of every extremum; the extrema
    total, top = collectives.reduce_sums_and_maxima(torch.cat(pairs + seen), torch.cat(maxima), group)
    values = torch.cat([total, top]).tolist()
    out: list[dict[str, float]] = [{} for _ in updates]
    for i, (k, name) in enumerate(means):
        value, count = values[2 * i], values[2 * i + 1]
        out[k][name] = value / count if count != 0 else float("nan")
    seen_at, top_at = 2 * len(means), len(total)
    for j, (k, name, largest) in enumerate(extrema):
        if values[seen_at + j]:
            out[k][name] = values[top_at + j] if largest else -values[top_at + j]
    return out
