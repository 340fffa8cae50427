"""The RL driver: one screen, each stage called once per step.

    prompts -> rollout (vLLM) -> reward -> advantage + loss + optimizer (Megatron) -> weight sync

Runs on every rank of a torchrun world (``megatron-gtpo train`` launches it); rank 0 alone logs to
MLflow and prints. A checkpoint holds model, optimizer, RNG, data cursor, LR schedule and the
MLflow run id, so ``--resume`` continues the same run. SIGTERM / SIGUSR1 make the run checkpoint
after the current step and exit 0 (SLURM preemption); SIGKILL loses at most the steps since the
last checkpoint, which is written atomically.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

from megatron_gtpo.utils.configuration import require

log = logging.getLogger("megatron_gtpo")


@dataclass(kw_only=True)
class TrainConfig:
    """Length of the run, batch geometry, checkpoints and periodic evaluation (the ``train:`` block)."""

    steps: int = 100
    """Rollout steps (each: generate, score, mu optimizer steps, weight push)."""
    prompts_per_step: int = 1
    """Prompts per rollout step; the global batch is prompts_per_step * rollout.n completions.
    1 as the GTPO reference code (spec 5.10)."""
    micro_batch_size: int = 8
    """Completions per micro-batch on one DP rank (Megatron's micro-batch)."""
    seed: int = 1234
    """Seed of model init, dropout RNG and sampling."""
    checkpoint_every: int = 10
    """Save a training checkpoint every N steps (and at the end, and on SIGTERM/SIGUSR1)."""
    keep_last: int = 2
    """Checkpoints kept on disk (older ones are deleted after a successful save)."""
    eval_every: int = 0
    """Greedy accuracy on held-out prompts every N steps (0 = never)."""
    eval_benchmark: str = "gsm8k"
    """Held-out benchmark for the periodic evaluation (test split names of data.benchmarks)."""
    eval_prompts: int = 16
    """Held-out prompts per periodic evaluation."""

    def __post_init__(self):
        for name in ("steps", "prompts_per_step", "micro_batch_size", "checkpoint_every", "keep_last",
                     "eval_prompts"):
            require(getattr(self, name) >= 1, name, getattr(self, name), "an integer >= 1")
        require(self.eval_every >= 0, "eval_every", self.eval_every, "0 (off) or an integer >= 1")


def run(cfg, *, resume: bool | str = False) -> dict[str, float]:
    """Trains ``cfg`` (a RunConfig) to ``cfg.train.steps``; returns the last step's metrics.
    ``resume``: True/"require" (``--resume``), "auto" (``--resume=auto``) or False (see
    ``checkpoint.prepare_resume``)."""
    from megatron_gtpo import session
    from megatron_gtpo.stages import collate, collect_groups, rollout_metrics
    from megatron_gtpo.train.step import train_on_batch

    s = session.open_session(cfg, resume=resume)
    algo_cfg, tc = cfg.algo.resolved(), cfg.train
    metrics: dict[str, float] = {}
    for step in range(s.start_step, tc.steps):
        t0 = time.perf_counter()
        result = collect_groups(s.rollout, s.dataset, s.scorer, prompts_per_step=tc.prompts_per_step,
                                sampling=cfg.rollout.sampling(), dynamic_sampling=algo_cfg.dynamic_sampling,
                                metric=algo_cfg.dynamic_sampling_metric,
                                max_tries=algo_cfg.dynamic_sampling_max_tries, rank=s.dims.rank,
                                seed=cfg.rollout.seed * 1_000_003 + step * 1_009, group_multiple=s.group_multiple)
        if not result.groups:  # DAPO's dynamic sampling kept nothing within its tries: skip the update
            session.report_skipped(s, step + 1, rollout_metrics(result))
            if session.should_stop(s, step + 1, cfg):
                break
            continue
        batch = collate(result.groups, pad_id=s.pad_id, std_scale=algo_cfg.adv_std_scale, adv_eps=algo_cfg.adv_eps)
        t1 = time.perf_counter()
        ref_logp = session.reference_logprobs(s, batch, cfg) if s.reference is not None else None
        train = train_on_batch(s.policy.chunks, s.policy.optimizer, s.policy.scheduler, batch,
                               algo_name=algo_cfg.name, prepare_kwargs=algo_cfg.prepare_kwargs(),
                               loss_kwargs=algo_cfg.loss_kwargs(max_completion_tokens=cfg.rollout.max_tokens),
                               micro_batch_size=tc.micro_batch_size, mu=algo_cfg.mu,
                               temperature=cfg.rollout.temperature, dims=s.dims, ref_logp=ref_logp)
        t2 = time.perf_counter()
        sync = session.push_weights(s, cfg, version=step + 1)
        t3 = time.perf_counter()
        metrics = session.step_metrics(rollout_metrics(result), train, sync, batch=batch, times={
            "rollout": result.rollout_s, "reward": result.reward_s, "train": t2 - t1, "sync": t3 - t2,
            "step": t3 - t0})
        session.report(s, cfg, step + 1, metrics, result.groups)
        if tc.eval_every and (step + 1) % tc.eval_every == 0:
            metrics.update(session.periodic_eval(s, cfg, step + 1))
        if session.should_stop(s, step + 1, cfg):
            break
    session.close_session(s, cfg, metrics)
    return metrics


def main(argv: list[str] | None = None) -> int:
    """Worker entry point (one per rank): ``python -m megatron_gtpo.trainer CONFIG.yaml [--resume | --resume=auto]``."""
    import argparse

    from megatron_gtpo.checkpoint_files import add_resume_options
    from megatron_gtpo.config import load_config

    parser = argparse.ArgumentParser(prog="megatron_gtpo.trainer",
                                     description="One training rank; normally started by `megatron-gtpo train`.")
    parser.add_argument("config", help="resolved config YAML (written by `megatron-gtpo train`)")
    add_resume_options(parser)
    args = parser.parse_args(argv)
    metrics = run(load_config(args.config), resume=args.resume)
    log.info("final metrics: %s", json.dumps({k: round(v, 4) for k, v in metrics.items()
                                              if k.startswith(("reward/", "time/step"))}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
