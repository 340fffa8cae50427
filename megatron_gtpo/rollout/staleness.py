"""Policy versions of rollouts: which weights made each completion, and how stale they may be.

Version ``v`` names the weights pushed after training step ``v`` (``v`` = the start step for the
weights a run starts or resumes with). The collector records every version the engines are told to
serve, in push order (:class:`PolicyVersions`), and checks every step's completions on every rank
(the completions and the record are the same on every rank, so all ranks raise together):

* **tags**: a generate call issued while the engines serve ``v`` returns completions tagged ``v``
  (``Completion.weight_version``, set by the engine that sampled them). Anything else means that a
  push did not reach an engine, or that one changed its weights in the middle of a generation.
* **bound**: a completion's *staleness* is the number of pushes after its version, up to the
  version the step trains from (the last push). It never exceeds ``rollout.staleness``. It is
  counted in pushes, not by subtracting version numbers: a step that trains on nothing (DAPO's
  dynamic sampling kept no group) pushes nothing, so versions can skip a number.

With ``rollout.staleness: 1`` step ``k`` trains the weights of version ``k - 1`` on completions of
version ``k - 2`` (one push old) from its second step on; the first step after a start or a resume
has no batch in flight and generates its own (staleness 0). Uninterrupted, from step 0:
``weight_version(step k) = max(k - 2, 0)``; after a start or resume at step ``s``,
``max(k - 1 - staleness, s)``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from megatron_gtpo.types import Completion

MAX_STALENESS = 1
"""Largest ``rollout.staleness`` the collector implements (one-step-off rollouts)."""

CORRECTED = ("tis", "mis")
"""``algo.mismatch_correction`` modes that reweight stale completions (``staleness_problem``)."""


class StalenessError(RuntimeError):
    """A completion's policy version is wrong (tag) or older than ``rollout.staleness`` allows."""


def staleness_problem(staleness: int, mismatch_correction: str) -> str | None:
    """Why ``rollout.staleness`` and ``algo.mismatch_correction`` cannot go together (None: they can).

    Stale completions come from an older policy than the one the trainer recomputes as pi_old, so the
    gradient needs the importance weight ``pi_old / pi_sampler`` of ``algo/importance.py``: without a
    correction a one-step-off run would silently train as if the samples were on-policy."""
    if staleness >= 1 and mismatch_correction not in CORRECTED:
        return (f"rollout.staleness={staleness} with algo.mismatch_correction={mismatch_correction!r} is not "
                f"allowed: one-step-off completions are sampled by the previous policy, so the loss needs the "
                f"importance correction pi_old / pi_sampler; set algo.mismatch_correction=tis (or mis), or "
                f"rollout.staleness=0")
    return None


@dataclass(kw_only=True)
class PolicyVersions:
    """The versions the engines were told to serve, in push order, and the checks of the module
    docstring. ``current`` is the version the trainer's weights have now."""

    bound: int = 0
    """Most pushes a completion may be behind the trainer (``rollout.staleness``)."""
    history: list[int] = field(default_factory=lambda: [0])
    """Pushed versions, oldest first (the engines start on the model directory's weights, version 0);
    only the last ``bound + 2`` are kept: anything older is out of bounds anyway."""

    @property
    def current(self) -> int:
        """The version pushed last: what the engines serve and the trainer's weights are."""
        return self.history[-1]

    def pushed(self, version: int) -> None:
        """The engines serve ``version`` now (a push of the current version again changes nothing)."""
        if not isinstance(version, int) or version < self.current:
            raise StalenessError(f"weight version {version!r} pushed after version {self.current}: versions "
                                 "must be integers that never decrease")
        if version > self.current:
            self.history = (self.history + [version])[-(self.bound + 2):]

    def age(self, version: int) -> int:
        """Pushes after ``version`` up to ``current`` (0 = the current weights)."""
        if version in self.history:
            return len(self.history) - 1 - self.history.index(version)
        if version < self.history[0]:
            return max(len(self.history), self.bound + 1)  # older than anything kept: beyond the bound
        raise StalenessError(f"weight version {version} was never pushed (pushed: {self.history})")

    def check_tags(self, completions: list[Completion], *, expected: int, step: int) -> None:
        """Every completion of one generate call, issued while the engines served ``expected``, is
        tagged ``expected``."""
        wrong = sorted({c.weight_version for c in completions} - {expected})
        if wrong:
            raise StalenessError(
                f"step {step}: completions generated while the engines served weight version {expected} are "
                f"tagged {wrong}: a weight push did not reach every engine, or changed weights mid-generation")

    def check_bound(self, completions: Iterable[Completion], *, step: int) -> int:
        """The largest staleness among ``completions`` (0 when there are none); raises when it
        exceeds ``bound``."""
        versions = {c.weight_version for c in completions}
        ages = {v: self.age(v) for v in versions}
        worst = max(ages.values(), default=0)
        if worst > self.bound:
            old = min(v for v, a in ages.items() if a == worst)
            raise StalenessError(
                f"step {step}: trains the weights of version {self.current} on completions of version {old}, "
                f"{worst} weight pushes old; rollout.staleness={self.bound} allows at most {self.bound}")
        return worst
