"""The learner: the Megatron policy (and GRPO's frozen reference), built once, and its step.

    ModelConfig --resolve_model + build_model + load weights--> Policy (chunks [, optimizer, scheduler])
    Batch --Learner.step--> reference log-probs (kl_beta > 0, this rank's rows) --train_step--> metrics

Only the driver (``megatron_gtpo/trainer.py``) builds a Learner; it hands the learner the sub-configs
it needs and nothing else. The weight sync reads ``learner.policy.chunks``; the checkpointer saves
``learner.policy``.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatron_gtpo.checkpoint.store import load_model_weights
from megatron_gtpo.convert.load import load_hf_weights
from megatron_gtpo.models.config import DTYPES, ModelConfig
from megatron_gtpo.models.hf_config import has_hf_weights, read_hf_config
from megatron_gtpo.models.resolve import resolve_model
from megatron_gtpo.parallel.dims import ParallelDims
from megatron_gtpo.train.model import build_model, sequence_multiple
from megatron_gtpo.train.optim import OptimConfig, build_optimizer, wrap_ddp
from megatron_gtpo.train.step import StepSettings, forward_stats, logprob_settings, process_groups, \
    rank_micro_batches, train_step
from megatron_gtpo.types import Batch

log = logging.getLogger("megatron_gtpo")


@dataclass(kw_only=True)
class Policy:
    """Megatron chunks of one model plus what the rest of the run needs next to them."""

    chunks: list[torch.nn.Module]
    """One module per virtual pipeline stage (DDP-wrapped when trainable)."""
    optimizer: Any
    """Megatron optimizer (None for the frozen reference model)."""
    scheduler: Any
    """Megatron OptimizerParamScheduler (None for the reference model)."""
    model_dir: Path
    """Directory with config.json and the tokenizer (the engines are built from it)."""
    hf_config: dict
    """Parsed config.json."""
    has_hf_weights: bool
    """True when model_dir holds HF safetensors (vLLM can load them directly)."""


def build_policy(model: ModelConfig, *, dims: ParallelDims, optim: OptimConfig | None = None,
                 total_steps: int = 1) -> Policy:
    """Builds and loads the model; with ``optim`` also DDP, optimizer and scheduler (``total_steps``
    optimizer steps: the default LR decay length); without, a frozen eval-mode copy."""
    model_dir = resolve_model(model.path)
    hf_config = read_hf_config(model_dir)
    chunks = build_model(hf_config, dims=dims, dtype=DTYPES[model.dtype], overrides=model.megatron,
                         weights_loaded=True, vocab_divisible_by=model.make_vocab_size_divisible_by,
                         lm_head_fp32=model.lm_head_fp32)
    hf = has_hf_weights(model_dir)
    if hf:
        load_hf_weights(chunks, hf_dir=model_dir, hf_config=hf_config, dims=dims)
    else:
        load_model_weights(chunks, model_dir)
    optimizer = scheduler = None
    if optim is not None:
        chunks = wrap_ddp(chunks, optim)
        optimizer, scheduler = build_optimizer(chunks, optim, total_steps=total_steps)
    else:
        for chunk in chunks:
            chunk.requires_grad_(False)
            chunk.eval()
    return Policy(chunks=chunks, optimizer=optimizer, scheduler=scheduler, model_dir=model_dir,
                  hf_config=hf_config, has_hf_weights=hf)


class Learner:
    """Trains the policy on one Batch per rollout step (``spec.mu`` optimizer steps)."""

    def __init__(self, policy: Policy, *, settings: StepSettings, dims: ParallelDims, reference: Policy | None,
                 model: ModelConfig | None = None):
        self.policy, self.settings, self.dims, self.reference = policy, settings, dims, reference
        self.model = model
        """The model's config (the reference model is built from it when a restart first needs one)."""
        self._frozen = reference

    @classmethod
    def build(cls, model: ModelConfig, optim: OptimConfig, *, settings: StepSettings, dims: ParallelDims,
              rollout_steps: int) -> Learner:
        """The policy with its optimizer (LR schedule over ``rollout_steps * mu`` optimizer steps)
        and, when the algorithm has a KL term, a frozen reference copy of the initial model."""
        from megatron.core.utils import get_model_config

        policy = build_policy(model, dims=dims, optim=optim, total_steps=rollout_steps * settings.spec.mu)
        # Every forward (policy, pi_old, reference) pads its micro-batches to what the model's config needs.
        settings = dataclasses.replace(settings, pad_to_multiple=sequence_multiple(get_model_config(policy.chunks[0])))
        learner = cls(policy, settings=settings, dims=dims, reference=None, model=model)
        learner.reference = learner._reference_for(settings)
        return learner

    def _reference_for(self, settings: StepSettings) -> Policy | None:
        """The frozen reference model when ``settings``' algorithm has a KL term (built once)."""
        if not settings.spec.needs_reference:
            return None
        if self._frozen is None:
            log.info("building the frozen reference model for the KL term (kl_beta=%g)", settings.spec.kl_beta)
            self._frozen = build_policy(self.model, dims=self.dims)
        return self._frozen

    def restart(self, optim: OptimConfig, settings: StepSettings, *, rollout_steps: int) -> None:
        """A fresh optimizer and LR schedule (over ``rollout_steps * mu`` updates) and ``settings``
        for the same policy, whose parameters the caller has set (the driver's ``restart``: the
        reward-scale probe's runs). A reference model built once stays for later restarts."""
        policy = self.policy
        policy.optimizer, policy.scheduler = build_optimizer(policy.chunks, optim,
                                                             total_steps=rollout_steps * settings.spec.mu)
        self.settings = dataclasses.replace(settings, pad_to_multiple=self.settings.pad_to_multiple)
        self.reference = self._reference_for(settings)

    def step(self, batch: Batch) -> dict[str, float]:
        """One rollout step's updates; metrics identical on every rank."""
        return train_step(self.policy, batch, self.settings, self.dims, ref_logp=self.reference_logprobs(batch))

    def reference_logprobs(self, batch: Batch) -> torch.Tensor | None:
        """The reference model's log-probs of this rank's rows [local B, T] (last pipeline stage;
        None elsewhere and without a reference model): they never leave the rank that computed them."""
        if self.reference is None:
            return None
        _, mbs = rank_micro_batches(batch, self.settings, self.dims)
        lp_settings = logprob_settings(self.settings, self.dims, process_groups(), self.reference.chunks)
        stats = forward_stats(self.reference.chunks, batch, mbs, lp_settings)
        return None if stats is None else stats.logp
