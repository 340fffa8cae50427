"""Sampling metrics over n completions per problem: pass@k, maj@k and mean@k.

- **pass@k** is the unbiased estimator of Chen et al. 2021 (Codex): with ``c`` of ``n`` samples
  correct, ``1 - C(n-c, k) / C(n, k)``, computed as a stable product.
- **maj@k** is the expected accuracy of a majority vote over ``k`` of the ``n`` samples, averaged
  over k-subsets: every subset when there are at most ``max_exact_subsets`` of them (so k == n is
  the plain vote over all samples), else ``num_resamples`` seeded random subsets.
  Votes are the canonical extracted answers; samples without an answer do not vote, and a subset
  where nobody answered counts as wrong. **Ties** go to the tied answer that appears first in
  sample order (the lowest sample index within the subset), which is deterministic and does not
  depend on how the subset was drawn. The vote is correct when that first sample was judged correct.
- **mean@k** is the mean correctness of the first ``k`` samples (samples are i.i.d., so any fixed
  subset is unbiased; with k == n it is the avg@n of DAPO's evaluation).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one problem with ``c`` correct out of ``n`` samples (needs k <= n)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    # 1 - prod_{i=n-c+1}^{n} (1 - k/i) equals 1 - C(n-c,k)/C(n,k) without huge binomials.
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def _subsets(n: int, k: int, *, max_exact: int, num_resamples: int, seed: int) -> np.ndarray:
    """Index matrix [S, k] of k-subsets of range(n), each row sorted ascending."""
    if math.comb(n, k) <= max_exact:
        return np.array(list(itertools.combinations(range(n), k)), dtype=np.int64).reshape(-1, k)
    rng = np.random.default_rng(seed)
    return np.sort(np.argsort(rng.random((num_resamples, n)), axis=1)[:, :k], axis=1)


def maj_at_k(answers: list[str | None], correct: list[bool], k: int, *, max_exact_subsets: int = 5000,
             num_resamples: int = 1000, seed: int = 0) -> float:
    """Expected majority-vote accuracy over k-subsets of one problem's samples (see module doc)."""
    n = len(answers)
    if len(correct) != n or not 1 <= k <= n:
        raise ValueError(f"maj_at_k needs len(answers) == len(correct) and 1 <= k <= n, got {n}, {len(correct)}, k={k}")
    keys = {a: i for i, a in enumerate(dict.fromkeys(a for a in answers if a is not None))}
    if not keys:
        return 0.0
    label = np.array([keys[a] if a is not None else -1 for a in answers])  # [n] class id, -1 = no vote
    ok = np.asarray(correct, dtype=bool)  # [n]
    subsets = _subsets(n, k, max_exact=max_exact_subsets, num_resamples=num_resamples, seed=seed)  # [S, k]
    sub_label = label[subsets]  # [S, k]
    votes = np.stack([(sub_label == c).sum(axis=1) for c in range(len(keys))], axis=1)  # [S, C]
    # Rows of `subsets` are sorted, so the first match along axis 1 is the earliest sample.
    first_pos = np.stack([np.where((sub_label == c).any(axis=1), (sub_label == c).argmax(axis=1), k)
                          for c in range(len(keys))], axis=1)  # [S, C] position of first vote, k = none
    best = votes.max(axis=1, keepdims=True)  # [S, 1]
    tied_first = np.where((votes == best) & (best > 0), first_pos, k + 1)  # [S, C]
    winner_pos = tied_first.min(axis=1)  # [S]
    has_vote = best[:, 0] > 0
    winner_sample = subsets[np.arange(len(subsets)), np.minimum(winner_pos, k - 1)]  # [S]
    return float(np.mean(has_vote & ok[winner_sample]))


def mean_at_k(correct: list[bool], k: int) -> float:
    """Mean correctness of the first ``k`` samples."""
    if not 1 <= k <= len(correct):
        raise ValueError(f"mean_at_k needs 1 <= k <= n, got k={k}, n={len(correct)}")
    return float(np.mean(correct[:k]))


@dataclass(kw_only=True)
class ProblemSamples:
    """The scored samples of one problem, in sample order."""

    uid: str
    """Problem id (``Prompt.uid``)."""
    answers: list[str | None]
    """Canonical extracted answer per sample (None = no answer, timeout or error)."""
    correct: list[bool]
    """Correctness per sample."""


def benchmark_metrics(problems: list[ProblemSamples], ks: list[int], *, max_exact_subsets: int = 5000,
                      num_resamples: int = 1000, seed: int = 0) -> dict[str, float]:
    """``{"pass@k": ..., "maj@k": ..., "mean@k": ...}`` for every k, averaged over problems (0..1)."""
    if not problems:
        raise ValueError("benchmark_metrics needs at least one problem")
    out: dict[str, float] = {}
    for k in ks:
        out[f"pass@{k}"] = float(np.mean([pass_at_k(len(p.correct), sum(p.correct), k) for p in problems]))
    for k in ks:
        out[f"maj@{k}"] = float(np.mean([
            maj_at_k(p.answers, p.correct, k, max_exact_subsets=max_exact_subsets,
                     num_resamples=num_resamples, seed=seed + i) for i, p in enumerate(problems)]))
    for k in ks:
        out[f"mean@{k}"] = float(np.mean([mean_at_k(p.correct, k) for p in problems]))
    return out
