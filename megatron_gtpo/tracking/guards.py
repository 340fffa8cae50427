"""Guards that catch a recipe out of its algorithm's regime, from the metrics every step logs.

Each guard watches one logged metric over a window of steps and fires once per run process when its
mean over the window is above a bound: a warning in the log naming the key to change, and an MLflow
tag ``guard/<name>`` with the same text. They are warnings, not errors: a researcher may want the
regime on purpose (the learning study's gamma ablation does). Why each bound (docs/algorithms.md,
"Reward scale and the entropy shift"; docs/results.md):

* ``gtpo_shift_dominates``: GTPO's entropy shift carries most of the update. With a reward whose
  scale is small against ``gamma <H>_i`` (a 0/1 reward: 65-71% in the first learning study), the
  uncentred, length-normalised shift is a policy gradient on a reward that grows with length.
* ``gtpo_filter_drops_all``: the entropy filter removes nearly every completion: no learning signal.
* ``most_completions_truncated``: most completions hit ``rollout.max_tokens``; a truncated answer
  cannot earn a format or correctness reward, and GTPO's shift then drives the length.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass(frozen=True, kw_only=True)
class Guard:
    """One regime check."""

    name: str
    """Tag suffix (``guard/<name>``) and the warning's name."""
    metric: str
    """The logged metric it watches (``megatron_gtpo.metrics``)."""
    above: float
    """Fires when the metric's mean over ``window`` steps exceeds this."""
    window: int
    """Steps averaged (the first ``window - 1`` steps never fire)."""
    advice: str
    """What to change, naming the config key."""


GUARDS: tuple[Guard, ...] = (
    Guard(name="gtpo_shift_dominates", metric="gtpo/shift_share", above=0.5, window=5,
          advice="GTPO's entropy shift gamma <H>_i outweighs the reward's advantages, and on equal-reward groups it "
                 "rewards longer completions. Put gamma on the reward's scale: algo.entropy_gamma_relative (gamma = "
                 "that x reward range; 0.005 is the paper's 0.1 on its 0-20 reward) or a smaller algo.entropy_gamma, "
                 "or use the paper's reward (reward.fn=gtpo or gtpo_boxed)"),
    Guard(name="gtpo_filter_drops_all", metric="gtpo/filtered_frac", above=0.9, window=5,
          advice="GTPO's entropy filter drops nearly every completion, so almost nothing is learned: raise "
                 "algo.entropy_threshold, or set it to auto (the authors' rule: no filter when the initial "
                 "model's mean entropy is above ln 2)"),
    Guard(name="most_completions_truncated", metric="completion/truncated_frac", above=0.5, window=5,
          advice="most completions hit the length cap, where no answer is finished or rewarded: raise "
                 "rollout.max_tokens (or shorten the prompt template's reasoning)"),
)
"""The guards every run checks."""


@dataclass
class RegimeGuards:
    """The guards' windows for one run (rank 0, driver side)."""

    guards: tuple[Guard, ...] = GUARDS
    _seen: dict[str, deque] = field(default_factory=dict)
    _fired: set[str] = field(default_factory=set)

    def check(self, metrics: dict[str, float]) -> list[tuple[str, str]]:
        """Adds one step's metrics; returns ``(name, warning)`` of each guard that fires now (each once)."""
        fired = []
        for guard in self.guards:
            if guard.metric not in metrics:
                continue
            window = self._seen.setdefault(guard.name, deque(maxlen=guard.window))
            window.append(float(metrics[guard.metric]))
            mean = sum(window) / len(window)
            if len(window) == guard.window and mean > guard.above and guard.name not in self._fired:
                self._fired.add(guard.name)
                fired.append((guard, mean))
        return [(g.name, f"{g.name}: {g.metric} averaged {mean:.2f} over the last {g.window} steps (> {g.above}): {g.advice}")
                for g, mean in fired]
