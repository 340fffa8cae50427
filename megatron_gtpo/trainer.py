"""The RL driver: builds the parts of a run once, then one loop of a few calls per step.

    prompts --collector.collect--> RolloutBatch --collate--> Batch --learner.step--> metrics
            --weight_sync.sync--> engines serve the new version --reporter / checkpointer

This is the only module that sees the whole config: every part gets its own sub-config or the
values it needs. It runs on every rank of a torchrun world (``megatron-gtpo train`` launches it);
rank 0 alone logs to MLflow and prints. SIGTERM / SIGUSR1 make the run checkpoint after the current
step and exit 0 (SLURM preemption); SIGKILL loses at most the steps since the last checkpoint,
which is written atomically. ``docs/architecture.md`` draws the data path of one step.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_gtpo.algo.config import filter_rule
from megatron_gtpo.checkpoint.adapters import lora_start
from megatron_gtpo.checkpoint.store import Checkpointer, prepare_resume
from megatron_gtpo.data.dataset import build_dataset
from megatron_gtpo.models.shape import shape_from_hf_config
from megatron_gtpo.parallel.dims import init_distributed
from megatron_gtpo.parallel.control import barrier
from megatron_gtpo.plan.recipe import plan_engine_memory
from megatron_gtpo.reward.functions import OverlongPunishment
from megatron_gtpo.reward.score import RewardScorer
from megatron_gtpo.rollout.collector import DynamicSampling, OffPolicy, RolloutCollector, rollout_metrics
from megatron_gtpo.rollout.memory import Choreography
from megatron_gtpo.rollout.placement import build_engines
from megatron_gtpo.sync import ExportPlan, WeightSync
from megatron_gtpo.sync.build import build_weight_sync
from megatron_gtpo.tracking import Reporter, step_metrics
from megatron_gtpo.tracking.perf import TrainWork, peak_tflops, precision_of
from megatron_gtpo.train.batching import collate
from megatron_gtpo.train.learner import Learner
from megatron_gtpo.train.offload import TrainerOffload
from megatron_gtpo.train.snapshot import ParamSnapshot
from megatron_gtpo.train.step import StepSettings
from megatron_gtpo.utils.configuration import to_dict
from megatron_gtpo.utils.runtime import PreemptionFlag, setup_logging, signals_blocked, startup_report

log = logging.getLogger("megatron_gtpo")


def run(cfg, *, resume: bool | str = False) -> dict[str, float]:
    """Trains ``cfg`` (a RunConfig) to ``cfg.train.steps``; returns the last step's metrics.
    ``resume``: True/"require" (``--resume``), "auto" (``--resume=auto``) or False (see
    ``checkpoint.prepare_resume``)."""
    parts = build(cfg, resume=resume)
    try:
        metrics = _loop(cfg, parts)
    except BaseException as err:  # the MLflow run ends FAILED with the reason; the error goes on
        parts.reporter.finish("FAILED", reason=repr(err)[:500])
        raise
    close(parts, status="KILLED" if parts.checkpointer.preempt.set else "FINISHED")
    return metrics


def _loop(cfg, parts: Parts) -> dict[str, float]:
    """Steps ``start_step + 1 .. train.steps`` (or up to a preemption); the last step's metrics."""
    checkpointer, reporter = parts.checkpointer, parts.reporter
    tc, metrics = cfg.train, {}
    for step in range(parts.start_step + 1, tc.steps + 1):
        record = one_step(parts, step, version=step, prompts_per_step=tc.prompts_per_step)
        if record.metrics is None:  # DAPO's dynamic sampling kept nothing within its tries: no update
            reporter.skipped(step, rollout_metrics(record.rollout), record.rollout)
        else:
            metrics = record.metrics
            reporter.step(step, metrics, record.rollout)
        if tc.eval_every and step % tc.eval_every == 0:
            metrics.update(_evaluate(parts, step, seed=tc.seed))
        # a save reads the optimizer state, offloaded since the push: back on the device meanwhile
        stop = checkpointer.after_step(step, run_id=reporter.run_id, on_device=parts.memory.trainer_on_device)
        reporter.commit(checkpointer.last_saved)  # steps up to the last checkpoint are final in MLflow
        if stop:
            break
    return metrics


@dataclass(kw_only=True)
class StepRecord:
    """What one step of the loop did."""

    rollout: object
    """The step's RolloutBatch."""
    train: dict[str, float] | None
    """The learner's metrics; None when the step trained on nothing."""
    metrics: dict[str, float] | None
    """Every metric of the step as logged (rollout, train, sync, times); None when it trained on nothing."""


def one_step(parts: Parts, step: int, *, version: int, prompts_per_step: int, after_train=None) -> StepRecord:
    """The body of the loop: collect -> train -> push ``version``, with the memory calls around them.
    ``after_train(parts)``: called right after the update, while the trainer's state is on the device
    (the reward-scale probe reads the optimizer state there)."""
    learner, collector, weight_sync = parts.learner, parts.collector, parts.weight_sync
    t0 = time.perf_counter()
    rollout = collector.collect(step, prompts_per_step=prompts_per_step)
    if not rollout.groups:
        return StepRecord(rollout=rollout, train=None, metrics=None)
    batch = collate(rollout.groups, pad_id=parts.pad_id)
    parts.memory.after_rollout()  # colocated engines sleep; the trainer gets the GPU memory back
    t1, train_start = time.perf_counter(), time.time()  # wall clock: compared with the servers' (rollout/overlap.py)
    if learner.settings.spec.entropy_threshold is None:  # GTPO's entropy_threshold: auto, decided once
        decide_entropy_filter(parts, batch)
    train = learner.step(batch)
    if after_train is not None:
        after_train(parts)
    t2, train_end = time.perf_counter(), time.time()
    parts.memory.before_push()  # engine weights awake, KV cache still free
    sync = weight_sync.sync(learner.policy.chunks, version=version)
    collector.pushed(version)
    parts.memory.after_push()  # trainer releases its step memory, then the KV cache comes back
    t3 = time.perf_counter()
    overlap = collector.engines.overlap(train_start, train_end)  # after the push: it drained the call in flight
    times = {"rollout": rollout.rollout_s, "reward": rollout.reward_s, "train": t2 - t1, "sync": t3 - t2,
             "step": t3 - t0}
    return StepRecord(rollout=rollout, train=train, metrics=step_metrics(
        rollout_metrics(rollout), overlap, train, sync, times=times, completion_tokens=float(batch.lengths.sum()),
        gpus=learner.dims.world, work=parts.work.of(batch.prompt_lengths, batch.lengths),
        peak_tflops=parts.work.peak_tflops))


@dataclass(kw_only=True)
class Parts:
    """What ``build`` made: the run's parts, built once."""

    learner: Learner
    collector: RolloutCollector
    weight_sync: WeightSync
    checkpointer: Checkpointer
    reporter: Reporter
    memory: Choreography
    """Sleep/wake of colocated engines and the trainer's offload around rollout and push."""
    scorer: RewardScorer | None
    held_out: list
    """Held-out prompts of the periodic evaluation (empty when it is off)."""
    pad_id: int
    start_step: int
    work: TrainWork
    """Tokens and model FLOPs of a batch's train phase and the device's peak (``perf/*``)."""


def build(cfg, *, resume: bool | str) -> Parts:
    """Builds every part in an order that fails fast: groups, the checkpoint to resume (verified),
    policy, engines, data, reward, tracking; then pushes the (restored) weights into the engines."""
    preempt = PreemptionFlag()  # first: a preemption signal during start-up must not kill the job
    dims = init_distributed(tp=cfg.parallel.tp, pp=cfg.parallel.pp, vpp=cfg.parallel.vpp, cp=cfg.parallel.cp,
                            seed=cfg.train.seed, timeout_s=cfg.parallel.timeout_s, ep=cfg.parallel.ep,
                            etp=cfg.parallel.etp)
    setup_logging(dims.rank)
    point = prepare_resume(cfg.output_dir, resume)  # before the expensive parts: a bad resume fails in seconds
    base = lora_start(cfg.model, point and point.path)  # LoRA: rank fits, base hashed, a resume's adapters match it
    spec = cfg.algorithm
    scorer = None
    with signals_blocked():  # reward worker processes must not die of a preemption signal
        if dims.rank == 0:  # started now: the workers import and warm up while the policy and engines build
            scorer = RewardScorer(cfg.reward, overlong=overlong_punishment(spec))
            scorer.start()
    log.info("building the policy (%s, tp=%d cp=%d pp=%d dp=%d)", cfg.model.path, dims.tp, dims.cp, dims.pp, dims.dp)
    learner = Learner.build(cfg.model, cfg.optim, settings=step_settings(cfg), dims=dims, rollout_steps=cfg.train.steps,
                            seed=cfg.train.seed, base=base)
    policy = learner.policy
    rollout_cfg, budget = engine_rollout_config(cfg, model_dir=str(policy.model_dir), world=dims.world,
                                                hf_weights=policy.has_hf_weights)
    offload = _trainer_offload(cfg, policy)
    if offload is not None:  # engines start on the memory the trainer gives up while they generate
        offload.offload()
    log.info("starting %s rollout engine(s)", cfg.sync.transport)
    engines = build_engines(rollout_cfg, cfg.sync.placement(), model_dir=str(policy.model_dir), budget=budget)
    export = ExportPlan(hf_config=policy.hf_config, dims=dims, bucket_bytes=cfg.sync.bucket_size)
    weight_sync = build_weight_sync(cfg.sync, export, engines.engine)
    memory = Choreography(engines, offload, colocated=cfg.sync.transport == "colocated")
    if offload is not None:  # a restore writes into the optimizer state: back on the device, engines asleep
        memory.after_rollout()
    dataset = build_dataset(cfg.data, tokenizer=engines.tokenizer, progress=dims.rank == 0)
    rows_unit = dims.dp * cfg.train.rows_per_micro_batch
    collector = RolloutCollector(
        engines, dataset, scorer, sampling=cfg.rollout.sampling(), seed=cfg.rollout.seed,
        dynamic=dynamic_sampling(spec), group_multiple=rows_unit // math.gcd(cfg.rollout.n, rows_unit),
        off_policy=OffPolicy(staleness=cfg.rollout.staleness, last_step=cfg.train.steps))
    checkpointer = Checkpointer(Path(cfg.output_dir) / "checkpoints", policy=policy, dataset=collector.cursor,
                                every=cfg.train.checkpoint_every, keep_last=cfg.train.keep_last,
                                total_steps=cfg.train.steps, preempt=preempt)
    start_step, run_id = checkpointer.restore(point) if point is not None else (0, None)
    if "entropy_threshold" in checkpointer.run_state:  # an auto filter decided before the restart stays
        set_entropy_threshold(learner, checkpointer.run_state["entropy_threshold"])
    reporter = Reporter(cfg.tracking, run_dir=Path(cfg.output_dir), rank=dims.rank, total_steps=cfg.train.steps,
                        run_id=run_id, resume_step=start_step if resume else None)
    reporter.start(to_dict(cfg))
    reporter.dataset(dataset.stats, fresh=start_step == 0)
    memory.before_push()  # the weights of sleeping engines awake (nothing to do for awake ones)
    weight_sync.sync(policy.chunks, version=start_step)
    collector.pushed(start_step)
    memory.after_push()  # as after every push: the trainer gives up its rollout-time memory
    tokenizer = engines.tokenizer
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    held_out = _held_out_prompts(cfg, tokenizer) if cfg.train.eval_every else []
    log.info("ready: %d prompts, starting at step %d of %d (%s)", len(dataset), start_step, cfg.train.steps,
             startup_report())
    return Parts(learner=learner, collector=collector, weight_sync=weight_sync, checkpointer=checkpointer,
                 reporter=reporter, memory=memory, scorer=scorer, held_out=held_out, pad_id=int(pad_id),
                 start_step=start_step, work=train_work(cfg, policy))


def train_work(cfg, policy) -> TrainWork:
    """What a train phase of ``cfg`` computes per batch (the policy's shape, mu updates, the KL
    reference's forward, the LoRA adapters) and one device's peak TFLOPS: ``perf/*``'s inputs."""
    spec = cfg.algorithm
    shape = shape_from_hf_config(policy.hf_config, name=str(cfg.model.path))
    peak, source = peak_tflops(cfg.perf, precision=precision_of(cfg.model.dtype, cfg.model.megatron))
    work = TrainWork.of_run(shape, spec=spec, lora=cfg.model.lora, peak_tflops=peak)
    row = work.of(torch.tensor([cfg.longest_row]), torch.tensor([0]))[1] / cfg.longest_row
    log.info("MFU: %.3g GFLOP per token of a %d-token row (6N + attention, %d update(s)%s) against %.3g TFLOPS per "
             "device (%s)", row / 1e9, cfg.longest_row, work.updates,
             " + a reference forward" if work.forward_passes else "", peak, source)
    return work


def decide_entropy_filter(parts: Parts, batch) -> None:
    """GTPO's ``algo.entropy_threshold: auto``: the authors' rule (``algo.config.filter_rule``) on
    <H>_ini, the initial policy's mean <H>_i over the first batch; logged, tagged in MLflow and kept in
    the checkpoints' run state, so a resume never decides again."""
    initial = parts.learner.mean_entropy(batch)
    threshold = filter_rule(initial)
    parts.checkpointer.run_state.update(entropy_threshold=threshold, initial_mean_entropy=initial)
    set_entropy_threshold(parts.learner, threshold)
    parts.reporter.decision("gtpo.entropy_threshold",
                            f"entropy_threshold auto: initial mean entropy {initial:.3f} nats "
                            f"{'>' if threshold == math.inf else '<='} ln 2 = 0.693, so "
                            f"{'no filter' if threshold == math.inf else 'threshold ln 2'} (the authors' rule)")


def set_entropy_threshold(learner: Learner, threshold: float) -> None:
    """The learner's algorithm with its GTPO filter threshold decided."""
    spec = dataclasses.replace(learner.settings.spec, entropy_threshold=float(threshold))
    learner.settings = dataclasses.replace(learner.settings, spec=spec)


@dataclass(frozen=True, kw_only=True)
class StartPoint:
    """Where every run of a multi-run job starts (the reward-scale probe's runs): the parameters and
    the prompt cursor right after ``build``."""

    params: ParamSnapshot
    cursor: dict


def start_point(parts: Parts) -> StartPoint:
    return StartPoint(params=ParamSnapshot(parts.learner.policy.chunks), cursor=parts.collector.cursor.state_dict())


def restart(parts: Parts, cfg, start: StartPoint, *, steps: int, reward_scale: float, version: int) -> None:
    """Puts the built run back at ``start`` for a new run of ``steps`` steps of ``cfg`` (the same model,
    engines and data; ``algo.*`` and ``optim.*`` may differ from the config it was built with): the
    parameters, a fresh optimizer and LR schedule, the algorithm's step settings, dynamic sampling
    and overlong punishment, rewards times ``reward_scale``, the prompt cursor; then the weights are
    pushed as ``version``. The memory calls are those of a training step, so an offloaded trainer
    (``rollout.offload_trainer``) is back on the device while its state is replaced."""
    spec, learner = cfg.algorithm, parts.learner
    parts.memory.after_rollout()  # engines asleep, the trainer's grads and optimizer state on the device
    start.params.restore()
    learner.restart(cfg.optim, step_settings(cfg), rollout_steps=steps)
    parts.memory = Choreography(parts.collector.engines, _trainer_offload(cfg, learner.policy),
                                colocated=cfg.sync.transport == "colocated")
    parts.collector.dynamic = dynamic_sampling(spec)
    parts.collector.cursor.load_state_dict(start.cursor)  # batches in flight from the last run are dropped
    if parts.scorer is not None:  # rank 0 scores
        parts.scorer.config = dataclasses.replace(cfg.reward, scale=reward_scale)
        parts.scorer.overlong = overlong_punishment(spec)
    parts.memory.before_push()
    parts.weight_sync.sync(learner.policy.chunks, version=version)
    parts.collector.pushed(version)  # the collector checks every completion's version tag
    parts.memory.after_push()


def step_settings(cfg) -> StepSettings:
    """How the run's batches become updates (the learner adds the model's padding multiple)."""
    return StepSettings(spec=cfg.algorithm, micro_batch_size=cfg.train.micro_batch_size,
                        temperature=cfg.rollout.temperature, micro_batch_tokens=cfg.token_budget)


def dynamic_sampling(spec) -> DynamicSampling | None:
    """DAPO's dynamic sampling of an AlgoSpec (None when it is off)."""
    if not spec.dynamic_sampling:
        return None
    return DynamicSampling(metric=spec.dynamic_sampling_metric, max_tries=spec.dynamic_sampling_max_tries)


def engine_rollout_config(cfg, *, model_dir: str, world: int, hf_weights: bool):
    """The rollout config (and memory budget) the job's engines start with: the memory plan's
    settings, then the rule every engine shares (``RolloutConfig.for_engines``: the fp32 head of
    ``model.lm_head_fp32``, ...). A function of its own so tests/e2e/test_fp32_head_engine.py checks
    the kwargs this build gives the engines, not a copy of them."""
    rollout_cfg, budget = plan_engine_memory(cfg, model_dir=model_dir, world=world)
    return rollout_cfg.for_engines(lm_head_fp32=cfg.model.lm_head_fp32, hf_weights=hf_weights), budget


def _trainer_offload(cfg, policy) -> TrainerOffload | None:
    return TrainerOffload(policy.chunks, policy.optimizer) if cfg.rollout.offload_trainer else None


def overlong_punishment(spec) -> OverlongPunishment | None:
    """DAPO's soft overlong punishment of an AlgoSpec (None when its buffer is 0)."""
    if not spec.overlong_buffer_len:
        return None
    return OverlongPunishment(max_tokens=spec.overlong_max_tokens, cache_tokens=spec.overlong_buffer_len,
                              factor=spec.overlong_penalty_factor)


def _held_out_prompts(cfg, tokenizer) -> list:
    """The periodic evaluation's prompts: the first ``train.eval_prompts`` of ``train.eval_benchmark``."""
    data = dataclasses.replace(cfg.data, benchmarks=[cfg.train.eval_benchmark], paths=[],
                               limit=cfg.train.eval_prompts, shuffle=False)
    return build_dataset(data, tokenizer=tokenizer, progress=False).prompts


def _evaluate(parts: Parts, step: int, *, seed: int) -> dict[str, float]:
    out = parts.collector.evaluate(parts.held_out, seed=seed)
    parts.reporter.evaluation(step, out, num_prompts=len(parts.held_out))
    return out


def close(parts: Parts, *, status: str) -> None:
    """Finishes the MLflow run and stops scorers and engines. The process groups stay up: vLLM's
    own exit hook tears down the groups it joined, and would fail on an already destroyed world."""
    parts.reporter.finish(status)
    if parts.scorer is not None:
        parts.scorer.close()
    parts.weight_sync.close()
    parts.collector.engines.close()
    reporter = parts.reporter
    log.info("done. run dir: %s | checkpoints: %s | MLflow run %s | status %s", reporter.run_dir.resolve(),
             parts.checkpointer.root.resolve(), reporter.run_id, status)
    barrier()
