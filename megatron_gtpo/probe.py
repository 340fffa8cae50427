"""The reward-scale probe (spec 6 D3; S4 Prop. 2): short runs of one recipe with every reward
multiplied by phi, all from the same initial policy, inside ONE job.

    trainer.build(cfg) once: policy, engines, data, reward, tracking     (start-up paid once)
    snapshot the parameters and the data cursor
    for each variant (algo.* / optim.* overrides) and each phi (the reference phi first):
        restore parameters + data cursor, fresh optimizer and LR schedule, reward scale = phi,
        push the weights; N steps of collect -> learner.step -> sync (sampling seeds follow the
        step, so every run starts from the same completions)
        record the reward curve (divided by phi), the parameter change against the reference
        phi's (norm ratio, cosine) and the share of Adam second moments with sqrt(v_hat) < 10 eps

Prop. 2: with beta = 0, rescaling r -> phi r leaves AdamW's update unchanged while eps << phi
sqrt(v_hat). Expected: GRPO/DAPO invariant (their std divides phi out of the advantage), Dr. GRPO and
GTPO with gamma = 0 near-invariant, GTPO with gamma > 0 not (its -gamma <H> shift does not scale),
and an advantage that scales with phi (GTPO, Dr. GRPO) breaks when adam_eps is comparable to
sqrt(v_hat). Gradient clipping also breaks it (the clip acts on the scaled gradient): set
``optim.optimizer.clip_grad=0`` to probe Adam alone. Report: ``megatron-gtpo probe --help``.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from megatron_gtpo.rollout.collector import DynamicSampling, rollout_metrics
from megatron_gtpo.train.batching import collate
from megatron_gtpo.train.diagnostics import small_v_fraction
from megatron_gtpo.train.learner import build_policy
from megatron_gtpo.train.optim import build_optimizer
from megatron_gtpo.train.snapshot import ParamSnapshot, delta_stats
from megatron_gtpo.train.step import StepSettings
from megatron_gtpo.trainer import Parts, build, close, overlong_punishment
from megatron_gtpo.utils.configuration import apply_overrides, to_dict
from megatron_gtpo.utils.configuration import build as build_config

log = logging.getLogger("megatron_gtpo")

VARIANT_KEYS = ("algo.", "optim.")
"""What may differ between variants: the model, engines and data are built once per probe."""


@dataclass(frozen=True, kw_only=True)
class ProbePlan:
    """What one probe runs."""

    phis: tuple[float, ...]
    """Reward scales; 1 (or the first) is the reference the others are compared with."""
    steps: int
    """Rollout steps per run."""
    variants: tuple[tuple[str, tuple[str, ...]], ...] = (("base", ()),)
    """(name, dotted overrides of algo.* / optim.*) per variant of the recipe."""

    @property
    def reference_phi(self) -> float:
        return 1.0 if 1.0 in self.phis else self.phis[0]


def variant_config(cfg, overrides) -> object:
    """``cfg`` (a RunConfig) with a variant's overrides, validated; ValueError names a key that may
    not differ between variants."""
    bad = [o for o in overrides if not o.split("=", 1)[0].startswith(VARIANT_KEYS)]
    if bad:
        raise ValueError(f"variant overrides {bad}: only algo.* and optim.* keys may differ between the variants "
                         "of one probe (the model, engines and data are built once); pass others to the recipe")
    return build_config(type(cfg), apply_overrides(to_dict(cfg), list(overrides)))


def run_probe(cfg, plan: ProbePlan) -> dict:
    """Runs every (variant, phi) of ``plan`` on ``cfg`` (a RunConfig) in this torchrun world and
    returns the report (the same on every rank)."""
    parts = build(cfg, resume=False)
    snapshot = ParamSnapshot(parts.learner.policy.chunks)
    state = _ProbeState(parts=parts, snapshot=snapshot, cursor=parts.collector.dataset.state_dict(),
                        base_scale=cfg.reward.scale)
    runs = []
    try:
        for name, overrides in plan.variants:
            vcfg = variant_config(cfg, overrides)
            order = [plan.reference_phi] + [p for p in plan.phis if p != plan.reference_phi]
            reference = None
            for phi in order:
                log.info("probe: variant %s, phi %g (%d steps)", name, phi, plan.steps)
                run = {"variant": name, "phi": phi, **state.restart(vcfg, phi, plan.steps)}
                run.update(state.train(vcfg, phi, plan.steps))
                delta = snapshot.delta()
                reference = delta if reference is None else reference
                stats = delta_stats(snapshot, delta, reference)
                run.update(delta_norm=stats.norm, delta_norm_ratio=stats.norm / stats.reference_norm
                           if stats.reference_norm else float("nan"), cosine_vs_reference=stats.cosine,
                           small_v_frac=small_v_fraction(parts.learner.policy.optimizer))
                runs.append(run)
    except BaseException as err:  # the MLflow run ends FAILED with the reason, as a training run's
        parts.reporter.finish("FAILED", reason=repr(err)[:500])
        raise
    close(parts, status="FINISHED")
    runs.sort(key=lambda r: ([n for n, _ in plan.variants].index(r["variant"]), plan.phis.index(r["phi"])))
    return {"probe": "reward-scale", "steps": plan.steps, "phis": list(plan.phis),
            "reference_phi": plan.reference_phi, "runs": runs, "summary": summarise(runs)}


def summarise(runs: list[dict]) -> list[dict]:
    """Per variant: the smallest cosine to the reference run and the largest |norm ratio - 1|."""
    out = []
    for name in dict.fromkeys(r["variant"] for r in runs):
        mine = [r for r in runs if r["variant"] == name]
        out.append({"variant": name, "min_cosine": min(r["cosine_vs_reference"] for r in mine),
                    "max_norm_ratio_deviation": max(abs(r["delta_norm_ratio"] - 1.0) for r in mine)})
    return out


@dataclass(kw_only=True)
class _ProbeState:
    """The probe's parts and what every run starts from."""

    parts: Parts
    snapshot: ParamSnapshot
    cursor: dict
    base_scale: float
    version: int = 0
    reference_policy: object = None

    def restart(self, vcfg, phi: float, steps: int) -> dict:
        """Puts the policy, optimizer, data cursor, reward scale and engines back at the start."""
        parts, learner = self.parts, self.parts.learner
        spec = vcfg.algo.resolve(max_completion_tokens=vcfg.rollout.max_tokens)
        self.snapshot.restore()
        policy = learner.policy
        policy.optimizer, policy.scheduler = build_optimizer(policy.chunks, vcfg.optim, total_steps=steps * spec.mu)
        learner.settings = StepSettings(spec=spec, micro_batch_size=vcfg.train.micro_batch_size,
                                        temperature=vcfg.rollout.temperature, micro_batch_tokens=vcfg.token_budget)
        if spec.needs_reference and self.reference_policy is None:
            self.reference_policy = learner.reference or build_policy(vcfg.model, dims=learner.dims)
        learner.reference = self.reference_policy if spec.needs_reference else None
        parts.collector.dynamic = (DynamicSampling(metric=spec.dynamic_sampling_metric,
                                                   max_tries=spec.dynamic_sampling_max_tries)
                                   if spec.dynamic_sampling else None)
        if parts.scorer is not None:  # rank 0 scores
            parts.scorer.config = dataclasses.replace(parts.scorer.config, scale=self.base_scale * phi)
            parts.scorer.overlong = overlong_punishment(spec)
        parts.collector.dataset.load_state_dict(self.cursor)
        self.version += 1
        parts.weight_sync.sync(policy.chunks, version=self.version)
        parts.collector.pushed(self.version)  # the collector checks every completion's version tag
        return {"algo": spec.name, "entropy_gamma": spec.entropy_gamma,
                "adam_eps": float(vcfg.optim.optimizer.get("adam_eps", 1e-8)),
                "clip_grad": float(vcfg.optim.optimizer.get("clip_grad", 1.0))}

    def train(self, vcfg, phi: float, steps: int) -> dict:
        """``steps`` rollout steps; the reward curve is divided by phi (the unscaled reward)."""
        parts, out = self.parts, {"reward_mean": [], "accuracy": [], "loss": [], "grad_norm": []}
        for step in range(1, steps + 1):
            rollout = parts.collector.collect(step, prompts_per_step=vcfg.train.prompts_per_step)
            if not rollout.groups:
                continue
            train = parts.learner.step(collate(rollout.groups, pad_id=parts.pad_id))
            self.version += 1
            parts.weight_sync.sync(parts.learner.policy.chunks, version=self.version)
            parts.collector.pushed(self.version)
            scored = rollout_metrics(rollout)
            out["reward_mean"].append(scored["reward/mean"] / phi)
            out["accuracy"].append(scored["reward/accuracy"])
            out["loss"].append(train["loss"])
            out["grad_norm"].append(train["optim/grad_norm"])
        return out
