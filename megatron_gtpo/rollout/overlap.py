"""How much of a step's train phase the rollout servers spent generating (``rollout/overlap_*``).

    server windows [(start, end), ...]  (wall clock, time.time(), from the servers' answers)
    train window (start, end)           (wall clock on trainer rank 0)
    overlap_s = |union(server windows) ∩ train window|,  overlap_frac = overlap_s / |train window|

A rollout server reports, with each ``generate`` answer (and each fetched job), the interval during
which its engine generated that call (rollout/messages.py); the pool keeps them
(rollout/pool.py) and the driver asks for the overlap of each step's train phase. The union counts
a second once however many servers generated in it: the metric says whether generation ran while
the trainer trained, not how much.

The clocks are those of different hosts on a cluster: the metric assumes they are synchronised
(NTP keeps them within milliseconds, far below a train phase); in tests they are one host's.
Pure arithmetic, no state.
"""

from __future__ import annotations

from collections.abc import Iterable

Window = tuple[float, float]


def covered_seconds(intervals: Iterable[Window], window: Window) -> float:
    """Seconds of ``window`` covered by at least one of ``intervals`` (each clipped to ``window``,
    then merged, so overlapping intervals count once). Empty or reversed intervals cover nothing."""
    lo, hi = window
    clipped = sorted((max(s, lo), min(e, hi)) for s, e in intervals if min(e, hi) > max(s, lo))
    total, end = 0.0, lo
    for start, stop in clipped:
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def overlap_metrics(intervals: Iterable[Window], window: Window) -> dict[str, float]:
    """``rollout/overlap_s`` and ``rollout/overlap_frac`` of one train ``window`` (names:
    ``megatron_gtpo.metrics``); a window of no length overlaps nothing."""
    seconds = covered_seconds(intervals, window)
    length = window[1] - window[0]
    return {"rollout/overlap_s": seconds, "rollout/overlap_frac": seconds / length if length > 0 else 0.0}
