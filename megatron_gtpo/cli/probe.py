"""``megatron-gtpo probe reward-scale RECIPE --phi 0.1,1,10 --steps N --output-dir DIR [overrides]``

The reward-scale probe of "On the Hidden Objective Biases of Group-based RL" (S4 Prop. 2, spec 6 D3):
short runs of RECIPE with every reward multiplied by phi, all from the same initial policy, data
cursor and sampling seeds, inside ONE job (the engines and the model are built once; each run
restores the parameters and starts a fresh optimizer). ``--variant`` adds runs of the same recipe
with algo.* / optim.* overrides, e.g. GTPO with gamma = 0 next to gamma = 0.1, or a large adam_eps.

Writes DIR/reward_scale.json and DIR/reward_scale.png and prints the report as one JSON line:
``{"probe": "reward-scale", "runs": [{"variant", "phi", "reward_mean": [...] (divided by phi),
"accuracy", "loss", "grad_norm", "delta_norm", "delta_norm_ratio", "cosine_vs_reference",
"small_v_frac", "algo", "entropy_gamma", "adam_eps", "clip_grad"}, ...], "summary": [...]}``.
``cosine_vs_reference`` / ``delta_norm_ratio`` compare each run's parameter change with the
reference phi's (1 when given) of the same variant: 1 / 1 means invariant. ``small_v_frac`` is
the share of Adam second moments with sqrt(v_hat) < 10 * adam_eps, where invariance breaks.
Gradient clipping rescales the gradient differently per phi: pass optim.optimizer.clip_grad=0 to
probe Adam alone.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from megatron_gtpo.cli import train as train_cli
from megatron_gtpo.config import dump_resolved, load_config
from megatron_gtpo.plan.preflight import preflight
from megatron_gtpo.plotting import plot_probe
from megatron_gtpo.probe import ProbePlan, run_probe, variant_config
from megatron_gtpo.utils.configuration import ConfigError

EPILOG = """examples:
  megatron-gtpo probe reward-scale configs/tiny.yaml --phi 0.1,1,10 --steps 3 --output-dir /tmp/probe \\
      optim.optimizer.clip_grad=0
  megatron-gtpo probe reward-scale configs/tiny.yaml --steps 3 --output-dir /tmp/probe optim.optimizer.clip_grad=0 \\
      --variant gamma0 algo.entropy_gamma=0 --variant gamma0.5 algo.entropy_gamma=0.5 \\
      --variant big_eps algo.entropy_gamma=0 optim.optimizer.adam_eps=1e-3
(recipe overrides go before the first --variant, which takes the rest of its line's key=value pairs)
"""
REPORT, PLOT, PLAN = "reward_scale.json", "reward_scale.png", "probe_plan.json"


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="megatron-gtpo probe", description=__doc__, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("probe", choices=["reward-scale"], help="which probe (reward-scale: spec 6 D3)")
    parser.add_argument("recipe", help="YAML recipe (configs/tiny.yaml, gtpo.yaml, ...)")
    parser.add_argument("overrides", nargs="*", help="dotted recipe overrides key.path=value")
    parser.add_argument("--phi", default="0.1,1,10", help="comma-separated reward scales (default 0.1,1,10)")
    parser.add_argument("--steps", type=int, default=4, help="rollout steps per run (default 4)")
    parser.add_argument("--output-dir", required=True, help="where the report, plot and MLflow store go")
    parser.add_argument("--variant", nargs="+", action="append", default=[], metavar=("NAME", "KEY=VALUE"),
                        help="a variant: a name and algo.*/optim.* overrides (repeatable; default: the recipe)")
    return parser.parse_intermixed_args(argv)


def plan_of(args) -> ProbePlan:
    """The probe plan of the arguments; ValueError names a bad --phi/--steps/--variant."""
    try:
        phis = tuple(float(p) for p in args.phi.split(",") if p.strip())
    except ValueError:
        raise ValueError(f"--phi {args.phi!r}: expected comma-separated numbers such as 0.1,1,10") from None
    if not phis or any(not p > 0 for p in phis) or len(set(phis)) != len(phis):
        raise ValueError(f"--phi {args.phi!r}: expected distinct numbers > 0")
    if args.steps < 1:
        raise ValueError(f"--steps {args.steps}: expected an integer >= 1")
    variants = tuple((v[0], tuple(v[1:])) for v in args.variant) or (("base", ()),)
    names = [name for name, _ in variants]
    if len(set(names)) != len(names) or any("=" in name for name in names):
        raise ValueError(f"--variant names {names}: expected distinct names (the first word after --variant)")
    return ProbePlan(phis=phis, steps=args.steps, variants=variants)


def prepare(args) -> tuple[object, ProbePlan, Path]:
    """Validates recipe, overrides, variants and plan before anything starts; writes the resolved
    config and the plan into the output directory."""
    out = Path(args.output_dir)
    cfg = load_config(args.recipe, [*args.overrides, f"output_dir={out}", f"train.steps={args.steps}"])
    plan = plan_of(args)
    for _, overrides in plan.variants:
        variant_config(cfg, overrides)
    print(preflight(cfg))
    out.mkdir(parents=True, exist_ok=True)
    resolved = dump_resolved(cfg)
    (out / PLAN).write_text(json.dumps({"phis": plan.phis, "steps": plan.steps, "variants": plan.variants}))
    return cfg, plan, resolved


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["worker"]:
        return worker(argv[1:])
    args = parse_args(argv)
    try:
        cfg, plan, resolved = prepare(args)
    except (ConfigError, FileNotFoundError, ValueError, ImportError) as err:
        print(f"megatron-gtpo probe: error: {err}", file=sys.stderr)
        return 2
    out = Path(args.output_dir)
    (out / REPORT).unlink(missing_ok=True)
    if cfg.parallel.world_size == 1:
        rc = worker([str(resolved), str(out / PLAN)])
    else:
        rc = train_cli.launch_torchrun(resolved, cfg.parallel.world_size, resume="off",
                                       module="megatron_gtpo.cli.probe", extra=("worker", str(out / PLAN)))
    if rc != 0 or not (out / REPORT).is_file():
        print(f"megatron-gtpo probe: the probe failed (exit {rc}); logs above", file=sys.stderr)
        return rc or 1
    report = json.loads((out / REPORT).read_text())
    plot_probe(report, out / PLOT)
    print(json.dumps(report))
    return 0


def worker(argv: list[str]) -> int:
    """One rank: ``python -m megatron_gtpo.cli.probe CONFIG worker PLAN`` (torchrun passes the config
    first) or, in-process, ``worker CONFIG PLAN``."""
    args = [a for a in argv if a != "worker"]
    config, plan_path = Path(args[0]), Path(args[1])
    data = json.loads(plan_path.read_text())
    plan = ProbePlan(phis=tuple(data["phis"]), steps=data["steps"],
                     variants=tuple((name, tuple(o)) for name, o in data["variants"]))
    cfg = load_config(config)
    report = run_probe(cfg, plan)
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        path = Path(cfg.output_dir) / REPORT
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(report))
        tmp.replace(path)
    return 0


if __name__ == "__main__":
    args = sys.argv[1:]
    raise SystemExit(worker(args) if "worker" in args else main(args))
