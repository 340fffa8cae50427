"""The reward-scale probe (spec 6 D3; S4 Prop. 2): short runs of one recipe with every reward
multiplied by phi, all from the same initial policy, inside ONE job.

    trainer.build(cfg) once: policy, engines, data, reward, tracking     (start-up paid once)
    trainer.start_point: the parameters and the data cursor
    for each variant (algo.* / optim.* overrides) and each phi (the reference phi first):
        trainer.restart: parameters + data cursor back, fresh optimizer and LR schedule, the
        variant's algorithm, reward scale = phi, weights pushed
        N steps of trainer.one_step, the training loop's own step (collect -> train -> push with
        its memory calls; sampling seeds follow the step, so every run starts from the same
        completions)
        record the reward curve (divided by phi), the parameter change against the reference
        phi's (norm ratio, cosine) and the share of Adam second moments with sqrt(v_hat) < 10 eps

The probe only says what to run: the driver (megatron_gtpo/trainer.py) builds, rewires and steps
its own parts, so the probe trains exactly as a training run does (an offloaded trainer included).

Prop. 2: with beta = 0, rescaling r -> phi r leaves AdamW's update unchanged while eps << phi
sqrt(v_hat). Expected: GRPO/DAPO invariant (their std divides phi out of the advantage), Dr. GRPO and
GTPO with gamma = 0 near-invariant, GTPO with gamma > 0 not (its -gamma <H> shift does not scale),
and an advantage that scales with phi (GTPO, Dr. GRPO) breaks when adam_eps is comparable to
sqrt(v_hat). Gradient clipping also breaks it (the clip acts on the scaled gradient): set
``optim.optimizer.clip_grad=0`` to probe Adam alone. Report: ``megatron-gtpo probe --help``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from megatron_gtpo import trainer
from megatron_gtpo.rollout.collector import rollout_metrics
from megatron_gtpo.train.diagnostics import small_v_fraction
from megatron_gtpo.train.snapshot import delta_stats
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
    parts = trainer.build(cfg, resume=False)
    start, runs, version = trainer.start_point(parts), [], parts.start_step
    try:
        for name, overrides in plan.variants:
            vcfg = variant_config(cfg, overrides)
            order = [plan.reference_phi] + [p for p in plan.phis if p != plan.reference_phi]
            reference = None
            for phi in order:
                log.info("probe: variant %s, phi %g (%d steps)", name, phi, plan.steps)
                version += 1
                trainer.restart(parts, vcfg, start, steps=plan.steps, reward_scale=cfg.reward.scale * phi,
                                version=version)
                run, version = _run(parts, vcfg, phi, plan.steps, version)
                delta = start.params.delta()
                reference = delta if reference is None else reference
                stats = delta_stats(start.params, delta, reference)
                small_v = run.pop("small_v_frac")
                runs.append({"variant": name, "phi": phi, **run, "delta_norm": stats.norm,
                             "delta_norm_ratio": stats.norm / stats.reference_norm if stats.reference_norm
                             else float("nan"), "cosine_vs_reference": stats.cosine, "small_v_frac": small_v})
    except BaseException as err:  # the MLflow run ends FAILED with the reason, as a training run's
        parts.reporter.finish("FAILED", reason=repr(err)[:500])
        raise
    trainer.close(parts, status="FINISHED")
    runs.sort(key=lambda r: ([n for n, _ in plan.variants].index(r["variant"]), plan.phis.index(r["phi"])))
    return {"probe": "reward-scale", "steps": plan.steps, "phis": list(plan.phis),
            "reference_phi": plan.reference_phi, "runs": runs, "summary": summarise(runs)}


def _run(parts, vcfg, phi: float, steps: int, version: int) -> tuple[dict, int]:
    """``steps`` steps of the training loop's own step; the reward curve is divided by phi (the
    unscaled reward). D3's share of small Adam second moments is read after every update, while the
    optimizer state is on the device (the last one is reported). Returns the run's record and the
    last pushed version."""
    spec, optimizer = vcfg.algorithm, vcfg.optim.optimizer
    out = {"algo": spec.name, "entropy_gamma": spec.entropy_gamma, "adam_eps": float(optimizer.get("adam_eps", 1e-8)),
           "clip_grad": float(optimizer.get("clip_grad", 1.0)), "reward_mean": [], "accuracy": [], "loss": [],
           "grad_norm": [], "small_v_frac": None}

    def read_moments(parts_):
        out["small_v_frac"] = small_v_fraction(parts_.learner.policy.optimizer)

    for step in range(1, steps + 1):
        record = trainer.one_step(parts, step, version=version + 1, prompts_per_step=vcfg.train.prompts_per_step,
                                  after_train=read_moments)
        if record.train is None:
            continue
        version += 1
        scored = rollout_metrics(record.rollout)
        out["reward_mean"].append(scored["reward/mean"] / phi)
        out["accuracy"].append(scored["reward/accuracy"])
        out["loss"].append(record.train["loss"])
        out["grad_norm"].append(record.train["optim/grad_norm"])
    return out, version


def summarise(runs: list[dict]) -> list[dict]:
    """Per variant: the smallest cosine to the reference run and the largest |norm ratio - 1|."""
    out = []
    for name in dict.fromkeys(r["variant"] for r in runs):
        mine = [r for r in runs if r["variant"] == name]
        out.append({"variant": name, "min_cosine": min(r["cosine_vs_reference"] for r in mine),
                    "max_norm_ratio_deviation": max(abs(r["delta_norm_ratio"] - 1.0) for r in mine)})
    return out
