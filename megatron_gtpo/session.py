"""Everything the driver sets up once and the per-step side work around its stages.

``open_session`` builds (in this order, so a bad config or data fails before the expensive parts
where possible): process groups, policy (+ reference when kl_beta > 0), rollout engines and
syncer, prompt dataset, reward scorer, checkpoint restore, tracker, and the first weight push.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_gtpo.parallel.dims import ParallelDims
from megatron_gtpo.parallel.control import any_rank, barrier, broadcast_object
from megatron_gtpo.utils.atomic import write_text_atomic
from megatron_gtpo.utils.runtime import PreemptionFlag, setup_logging, signals_blocked, start_checkpoint_helpers

log = logging.getLogger("megatron_gtpo")

# train_on_batch's names -> the metric names documented in the README (others pass through as is).
RENAMES = {
    "batch/entropy_mean": "entropy/mean", "batch/filtered_frac": "gtpo/filtered_frac",
    "batch/conflict_tokens_per_seq": "gtpo/conflict_tokens_per_completion",
    "batch/lambda_zero_frac": "gtpo/lambda_zero_share", "batch/lambda_ge2_frac": "gtpo/lambda_ge2_share",
    "mismatch/logp_abs_diff": "mismatch/logprob_abs_mean", "mismatch/logp_abs_diff_max": "mismatch/logprob_abs_max",
    "train/clip_frac_low": "clip/low_frac", "train/clip_frac_high": "clip/high_frac",
}


@dataclass(kw_only=True)
class Session:
    """The live objects of one training run on one rank."""

    dims: ParallelDims
    policy: Any
    reference: Any
    rollout: Any
    syncer: Any
    dataset: Any
    scorer: Any
    tracker: Any
    pad_id: int
    start_step: int
    run_dir: Path
    preempt: PreemptionFlag
    group_multiple: int = 1
    """Groups per usable batch unit: rows (groups x rollout.n) must split over DP x micro-batch."""
    run_id: str | None = None
    last_saved: int = -1


def open_session(cfg, *, resume: bool) -> Session:
    from megatron_gtpo.data.dataset import build_dataset
    from megatron_gtpo.parallel.dims import init_distributed
    from megatron_gtpo.policy import build_policy
    from megatron_gtpo.sync.placement import build_rollout

    par, tc = cfg.parallel, cfg.train
    dims = init_distributed(tp=par.tp, pp=par.pp, vpp=par.vpp, seed=tc.seed, timeout_s=par.timeout_s)
    setup_logging(dims.rank)
    preempt = PreemptionFlag()
    run_dir = Path(cfg.output_dir)
    algo_cfg = cfg.algo.resolved()
    log.info("building the policy (%s, tp=%d pp=%d dp=%d)", cfg.model.path, dims.tp, dims.pp, dims.dp)
    policy = build_policy(cfg.model, dims=dims, optim=cfg.optim, total_steps=tc.steps * algo_cfg.mu)
    reference = build_policy(cfg.model, dims=dims) if algo_cfg.kl_beta > 0 else None
    rollout_cfg = cfg.rollout
    if not policy.has_hf_weights:  # Megatron checkpoint: the engine starts empty, the first push fills it
        rollout_cfg = dataclasses.replace(rollout_cfg, vllm={"load_format": "dummy", **rollout_cfg.vllm})
    log.info("starting %s rollout engine(s)", cfg.sync.transport)
    rollout, syncer = build_rollout(rollout_cfg, cfg.sync, model_dir=policy.model_dir)
    tokenizer = rollout.tokenizer
    dataset = build_dataset(cfg.data, tokenizer=tokenizer, progress=dims.rank == 0)
    with signals_blocked():  # reward worker processes must not die of a preemption signal
        scorer = _scorer(cfg, algo_cfg) if dims.rank == 0 else None
    start_checkpoint_helpers()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    s = Session(dims=dims, policy=policy, reference=reference, rollout=rollout, syncer=syncer, dataset=dataset,
                scorer=scorer, tracker=None, pad_id=int(pad_id), start_step=0, run_dir=run_dir, preempt=preempt)
    rows_unit = dims.dp * tc.micro_batch_size
    s.group_multiple = rows_unit // math.gcd(cfg.rollout.n, rows_unit)
    if resume:
        _restore(s)
    s.tracker = _tracker(cfg, s)
    push_weights(s, cfg, version=s.start_step)
    log.info("ready: %d prompts, starting at step %d of %d", len(dataset), s.start_step, tc.steps)
    return s


def _scorer(cfg, algo_cfg):
    from megatron_gtpo.reward.score import RewardScorer

    reward_cfg = cfg.reward
    if algo_cfg.overlong_buffer_len:  # DAPO's soft overlong punishment (spec 4.4): L_max = rollout max_tokens
        reward_cfg = dataclasses.replace(reward_cfg, overlong_max_tokens=cfg.rollout.max_tokens,
                                         overlong_cache_tokens=algo_cfg.overlong_buffer_len,
                                         overlong_factor=algo_cfg.overlong_penalty_factor)
    return RewardScorer(reward_cfg)


def _restore(s: Session) -> None:
    from megatron_gtpo.checkpoint import load_checkpoint

    loaded = load_checkpoint(s.run_dir / "checkpoints", model_chunks=s.policy.chunks, optimizer=s.policy.optimizer)
    if loaded is None:
        log.warning("--resume: no checkpoint under %s, starting from step 0", s.run_dir / "checkpoints")
        return
    s.start_step, extra = loaded
    s.dataset.load_state_dict(extra["data"])
    s.policy.scheduler.load_state_dict(extra["scheduler"])
    s.run_id = extra.get("run_id")
    s.last_saved = s.start_step
    log.info("resumed from step %d (MLflow run %s)", s.start_step, s.run_id)


def _tracker(cfg, s: Session):
    from megatron_gtpo.config import dump_resolved
    from megatron_gtpo.tracking import Tracker, resolve_uri
    from megatron_gtpo.utils.configuration import to_dict

    tc = cfg.tracking
    tracker = None
    if s.dims.rank == 0:
        s.run_dir.mkdir(parents=True, exist_ok=True)
        tracker = Tracker(enabled=tc.enabled, uri=resolve_uri(tc.uri, s.run_dir), experiment=tc.experiment,
                          run_name=tc.run_name or s.run_dir.resolve().name, artifact_dir=s.run_dir / "mlartifacts",
                          run_id=s.run_id)
        if s.run_id is None and tc.enabled:
            tracker.log_params(to_dict(cfg))
            tracker.log_artifact(dump_resolved(cfg))
        if tracker.run_id:
            write_text_atomic(s.run_dir / "run_id", tracker.run_id)
    s.run_id = broadcast_object(tracker.run_id if tracker else None)
    return tracker


def push_weights(s: Session, cfg, *, version: int) -> dict[str, float]:
    """Exports the policy (TP gather, PP collect, HF names) and pushes it as ``version``."""
    from megatron_gtpo.convert.export import export_hf_weights

    buckets = export_hf_weights(s.policy.chunks, hf_config=s.policy.hf_config, dims=s.dims,
                                bucket_bytes=cfg.sync.bucket_bytes, dst_ranks=s.syncer.dst_ranks)
    return s.syncer.push(buckets, version=version).as_metrics()


def reference_logprobs(s: Session, batch, cfg):
    """GRPO's KL term: the frozen reference model's log-probs of the batch [B, S]."""
    from megatron_gtpo.train.step import compute_logprobs

    return compute_logprobs(s.reference.chunks, batch, dims=s.dims, micro_batch_size=cfg.train.micro_batch_size,
                            temperature=cfg.rollout.temperature).logp


def step_metrics(rollout: dict, train: dict, sync: dict, *, batch, times: dict[str, float]) -> dict[str, float]:
    """One flat dict: rollout + train (renamed to the README names) + sync + time/* + throughput."""
    out = dict(rollout)
    out.update({RENAMES.get(k, k): v for k, v in train.items()})
    out.update(sync)
    out.update({f"time/{k}_s": v for k, v in times.items()})
    tokens = float(batch.loss_mask.sum())
    out["throughput/completion_tokens"] = tokens
    out["throughput/tokens_per_s"] = tokens / max(times["step"], 1e-9)
    return out


def report(s: Session, cfg, step: int, metrics: dict[str, float], groups) -> None:
    """Rank 0: MLflow metrics, a one-line summary, and every N steps a sample-completions table."""
    if s.dims.rank != 0:
        return
    s.tracker.log_metrics(metrics, step)
    get = lambda k: metrics.get(k, float("nan"))  # noqa: E731
    log.info("step %d/%d | reward %.3f acc %.2f | len %.1f | H %.3f | conflicts %.2f | gnorm %.3f | "
             "rollout %.1fs reward %.1fs train %.1fs sync %.1fs = %.1fs", step, cfg.train.steps, get("reward/mean"),
             get("reward/accuracy"), get("completion/length_mean"), get("entropy/mean"),
             get("gtpo/conflict_tokens_per_completion"), get("optim/grad_norm"), get("time/rollout_s"),
             get("time/reward_s"), get("time/train_s"), get("time/sync_s"), get("time/step_s"))
    every = cfg.tracking.samples_every
    if every and (step % every == 0 or step == 1):
        from megatron_gtpo.stages import sample_table

        s.tracker.log_json(sample_table(groups, limit=cfg.tracking.num_samples), f"samples/step_{step:06d}.json")


def report_skipped(s: Session, step: int, metrics: dict[str, float]) -> None:
    """A step whose dynamic sampling kept no group: no update, the counters are still logged."""
    if s.dims.rank == 0:
        s.tracker.log_metrics({**metrics, "rollout/skipped_step": 1.0}, step)
        log.warning("step %d: dynamic sampling kept no group in %d tries (all-equal %s); no update this step",
                    step, int(metrics["rollout/tries"]), "groups")


def periodic_eval(s: Session, cfg, step: int) -> dict[str, float]:
    """Greedy accuracy on ``train.eval_prompts`` held-out prompts of ``train.eval_benchmark``."""
    from megatron_gtpo.data.dataset import build_dataset
    from megatron_gtpo.stages import _score_on_rank0

    data_cfg = dataclasses.replace(cfg.data, benchmarks=[cfg.train.eval_benchmark], paths=[],
                                   limit=cfg.train.eval_prompts, shuffle=False)
    prompts = build_dataset(data_cfg, tokenizer=s.rollout.tokenizer, progress=False).prompts
    completions = s.rollout.generate(prompts, n=1, temperature=0.0, top_p=1.0, max_tokens=cfg.rollout.max_tokens,
                                     stop=list(cfg.rollout.stop) or None, seed=cfg.train.seed)
    scored = _score_on_rank0(prompts, completions, s.scorer, rank=s.dims.rank)
    correct = [c for g in scored.groups for c in g.correct]
    rewards = [r for g in scored.groups for r in g.rewards]
    out = {"eval/accuracy": sum(correct) / max(len(correct), 1), "eval/reward_mean": sum(rewards) / max(len(rewards), 1)}
    if s.dims.rank == 0:
        s.tracker.log_metrics(out, step)
        s.tracker.log_json({"step": step, **out, "prompts": len(prompts)}, f"eval/step_{step:06d}.json")
        log.info("eval at step %d: accuracy %.3f on %d held-out prompts", step, out["eval/accuracy"], len(prompts))
    return out


def should_stop(s: Session, step: int, cfg) -> bool:
    """Checkpoints when due (every N steps, at the end, on a preemption signal); True = stop now."""
    preempted = any_rank(s.preempt.set)
    if step % cfg.train.checkpoint_every == 0 or step == cfg.train.steps or preempted:
        save(s, cfg, step)
    if preempted:
        if s.dims.rank == 0:
            write_text_atomic(s.run_dir / "PREEMPTED", f"{step}\n")
            log.warning("preempted: checkpoint of step %d saved, exiting (resume with --resume)", step)
        return True
    return False


def save(s: Session, cfg, step: int) -> None:
    from megatron_gtpo.checkpoint import save_checkpoint

    if s.last_saved == step:
        return
    extra = {"data": s.dataset.state_dict(), "scheduler": s.policy.scheduler.state_dict(), "run_id": s.run_id}
    path = save_checkpoint(s.run_dir / "checkpoints", step=step, model_chunks=s.policy.chunks,
                           optimizer=s.policy.optimizer, extra_state=extra, keep_last=cfg.train.keep_last)
    s.last_saved = step
    log.info("checkpoint: %s", path)


def close_session(s: Session, cfg, metrics: dict[str, float]) -> None:
    """Finishes the MLflow run and stops scorers and engines. The process groups stay up: vLLM's
    own exit hook tears down the groups it joined, and would fail on an already destroyed world."""
    if s.tracker is not None:
        s.tracker.finish("KILLED" if s.preempt.set else "FINISHED")
    if s.scorer is not None:
        s.scorer.close()
    s.syncer.close()
    s.rollout.close()
    if s.dims.rank == 0:
        log.info("done. run dir: %s | checkpoints: %s | MLflow: %s (run %s)", s.run_dir.resolve(),
                 (s.run_dir / "checkpoints").resolve(), getattr(s.tracker, "uri", "-"), s.run_id)
    barrier()

