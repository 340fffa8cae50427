"""``RunConfig``: one recipe, composed of the sub-configs that live next to the code they configure.

    load_config("configs/gtpo.yaml", ["algo.entropy_threshold=0.7"]) -> RunConfig (validated)

A recipe is YAML (``base:`` inherits another file); overrides are dotted ``key.path=value`` pairs
parsed as YAML. Unknown keys, wrong types and out-of-range values raise :class:`ConfigError`
naming the key path, the value and what is allowed. ``megatron-gtpo config`` prints every field.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from pathlib import Path

from megatron_gtpo.algo.config import AlgoConfig
from megatron_gtpo.algo.spec import AlgoSpec
from megatron_gtpo.data.config import DataConfig
from megatron_gtpo.models.config import ModelConfig
from megatron_gtpo.parallel.cp_index import cp_padded_length
from megatron_gtpo.parallel.dims import ParallelConfig
from megatron_gtpo.parallel.layout import batch_split_problem, cp_packing_problem
from megatron_gtpo.reward.config import RewardConfig, reward_range
from megatron_gtpo.rollout.config import RolloutConfig
from megatron_gtpo.rollout.routing import replay_problem
from megatron_gtpo.rollout.staleness import staleness_problem
from megatron_gtpo.sync.config import SyncConfig
from megatron_gtpo.tracking import TrackingConfig
from megatron_gtpo.tracking.perf import PerfConfig
from megatron_gtpo.train.batching import token_budget_problem
from megatron_gtpo.train.optim import OptimConfig
from megatron_gtpo.train.config import TrainConfig
from megatron_gtpo.utils.secret import private_directory
from megatron_gtpo.utils.configuration import (ConfigError, apply_overrides, build, load_recipe, to_dict,
                                               write_yaml_atomic)

__all__ = ["RunConfig", "load_config", "ConfigError", "dump_resolved"]


@dataclass(kw_only=True)
class RunConfig:
    """A whole training run."""

    output_dir: str = "runs/default"
    """Run directory: resolved config, checkpoints, MLflow SQLite store, plots, logs."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy model (see megatron_gtpo/models/config.py)."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Trainer TP / PP / VPP / DP layout."""
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    """Algorithm and its hyper-parameters (GTPO, GRPO, Dr. GRPO, DAPO)."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Sampling of G completions per prompt with vLLM (native vLLM settings under rollout.vllm)."""
    sync: SyncConfig = field(default_factory=SyncConfig)
    """Weight transport from the trainer into the engines."""
    data: DataConfig = field(default_factory=DataConfig)
    """Training prompts."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Reward function and scoring workers."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Megatron optimizer, DDP and LR schedule (native Megatron fields)."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Steps, batch sizes, checkpoints, periodic evaluation."""
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    """MLflow tracking."""
    perf: PerfConfig = field(default_factory=PerfConfig)
    """MFU's peak FLOP rate (``perf/mfu``) and the dry-run's throughput assumption."""

    def __post_init__(self):
        spec = self.algorithm
        if spec.overlong_buffer_len > self.rollout.max_tokens:
            raise ConfigError(f"algo.overlong_buffer_len={spec.overlong_buffer_len} is not allowed: expected "
                              f"<= rollout.max_tokens ({self.rollout.max_tokens}), the L_max of DAPO's punishment")
        if problem := staleness_problem(self.rollout.staleness, self.algo.mismatch_correction):
            raise ConfigError(problem)
        if self.rollout.partial != "off" and self.sync.transport != "separate":
            raise ConfigError(f"rollout.partial={self.rollout.partial} is not allowed with sync.transport="
                              f"{self.sync.transport}: colocated engines generate every batch inside the trainer's "
                              f"processes before the step trains, so no request is generating when weights are "
                              f"pushed; set rollout.partial=off, or sync.transport=separate (a pool of rollout servers)")
        if self.model.moe_routing_replay == "rollout" and (
                problem := replay_problem(transport=self.sync.transport, vllm=self.rollout.vllm)):
            raise ConfigError(problem)
        if self.rollout.n < 2:
            raise ConfigError(f"rollout.n={self.rollout.n} is not allowed: group-relative advantages need >= 2 "
                              "completions per prompt")
        problem = batch_split_problem(self.train.prompts_per_step * self.rollout.n, dp=self.parallel.dp,
                                      rows_per_micro_batch=self.train.rows_per_micro_batch)
        problem = problem or token_budget_problem(
            self.token_budget, self.longest_row, "the longest possible row, data.max_prompt_tokens + rollout.max_tokens")
        problem = problem or cp_packing_problem(self.model.megatron.get("cp_comm_type"), cp=self.parallel.cp,
                                                packed=self.token_budget > 0)
        if problem:
            raise ConfigError(problem)

    @functools.cached_property
    def algorithm(self) -> AlgoSpec:
        """The algorithm of the run, resolved once (at construction): ``algo``'s None fields take the
        chosen algorithm's defaults, rollout.max_tokens is Dr. GRPO's L and DAPO's L_max, the reward's
        range x reward.scale turns GTPO's entropy_gamma_relative into gamma. Every part of
        the run receives this record, never ``algo`` itself. Not a field: it is not written to the
        resolved config.yaml (the recipe's own values are)."""
        spread = reward_range(self.reward.fn, self.reward.range)
        return self.algo.resolve(max_completion_tokens=self.rollout.max_tokens,
                                 reward_range=None if spread is None else spread * self.reward.scale)

    @property
    def longest_row(self) -> int:
        """Tokens of the longest possible training row: a prompt of data.max_prompt_tokens and a
        completion of rollout.max_tokens, padded to a multiple of 2 x parallel.cp under context
        parallelism (every sequence of a packed row is)."""
        return cp_padded_length(self.data.max_prompt_tokens + self.rollout.max_tokens, self.parallel.cp)

    @property
    def token_budget(self) -> int:
        """``train.micro_batch_tokens`` resolved: the packed micro-batch budget, 0 for padded."""
        return self.train.token_budget(self.longest_row)


def load_config(recipe: str | os.PathLike | None, overrides: list[str] | None = None) -> RunConfig:
    """Reads a recipe (None = all defaults), applies dotted overrides and validates the result."""
    data = load_recipe(recipe) if recipe is not None else {}
    data = apply_overrides(data, list(overrides or []))
    return build(RunConfig, data)


def dump_resolved(cfg: RunConfig, path: str | os.PathLike | None = None) -> Path:
    """Writes the fully resolved config (defaults filled in) atomically; default <output_dir>/config.yaml."""
    if not path:
        private_directory(cfg.output_dir)  # the run directory: owner only (docs/security.md)
    path = Path(path) if path else Path(cfg.output_dir) / "config.yaml"
    return write_yaml_atomic(to_dict(cfg), path)
