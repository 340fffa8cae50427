"""The learner: the Megatron policy (and GRPO's frozen reference), built once, and its step.

    ModelConfig --resolve_model + build_model + load weights [+ LoRA adapters]--> Policy (chunks [, optimizer,
        scheduler])
    Batch --Learner.step--> reference log-probs (kl_beta > 0, this rank's rows) --train_step--> metrics

LoRA (``model.lora.rank > 0``): the adapters are attached after the base weights load and before
Megatron's DDP wraps the chunks, so the frozen base gets no gradient buffer and the (distributed)
optimizer holds the adapters only; GRPO's KL reference is the same chunks with the adapters
disabled (the base), not a second model.

Only the driver (``megatron_gtpo/trainer.py``) builds a Learner; it hands the learner the sub-configs
it needs and nothing else. The weight sync reads ``learner.policy.chunks``; the checkpointer saves
``learner.policy``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_gtpo.checkpoint.adapters import BaseIdentity
from megatron_gtpo.checkpoint.store import load_model_weights
from megatron_gtpo.convert.load import load_hf_weights
from megatron_gtpo.models.config import DTYPES, ModelConfig
from megatron_gtpo.models.hf_config import has_hf_weights, read_hf_config
from megatron_gtpo.models.resolve import resolve_model
from megatron_gtpo.models.shape import shape_from_hf_config
from megatron_gtpo.parallel import collectives
from megatron_gtpo.parallel.dims import ParallelDims
from megatron_gtpo.train.lora import LoraConfig, check_rank_fits
from megatron_gtpo.train.lora_layers import apply_lora, lora_disabled
from megatron_gtpo.train.model import build_model, sequence_multiple
from megatron_gtpo.train.routing import attach
from megatron_gtpo.train.optim import OptimConfig, build_optimizer, wrap_ddp
from megatron_gtpo.train.step import StepSettings, forward_stats, logprob_settings, process_groups, \
    rank_micro_batches, train_step
from megatron_gtpo.types import Batch
from megatron_gtpo.utils.configuration import ConfigError

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
    lora: LoraConfig | None = None
    """The LoRA adapters' settings; None: full fine-tuning (or a frozen copy)."""
    base: BaseIdentity | None = None
    """The frozen base's identity (LoRA runs: recorded in every checkpoint)."""


def build_policy(model: ModelConfig, *, dims: ParallelDims, optim: OptimConfig | None = None, total_steps: int = 1,
                 seed: int = 0, base: BaseIdentity | None = None) -> Policy:
    """Builds and loads the model; with ``optim`` also DDP, optimizer and scheduler (``total_steps``
    optimizer steps: the default LR decay length); without, a frozen eval-mode copy. With
    ``model.lora`` on and ``optim``, LoRA adapters (initialised from ``seed``) on the frozen base
    (``base``: its identity, for the checkpoints)."""
    model_dir = resolve_model(model.path)
    hf_config = read_hf_config(model_dir)
    lora = model.lora if model.lora.enabled and optim is not None else None
    if lora is not None:  # before the model is built: a rank that cannot fit fails in seconds
        check_rank_fits(lora, shape_from_hf_config(hf_config, name=str(model.path)))
    chunks = build_model(hf_config, dims=dims, dtype=DTYPES[model.dtype], overrides=model.megatron,
                         weights_loaded=True, vocab_divisible_by=model.make_vocab_size_divisible_by,
                         lm_head_fp32=model.lm_head_fp32)
    hf = has_hf_weights(model_dir)
    if hf:
        load_hf_weights(chunks, hf_dir=model_dir, hf_config=hf_config, dims=dims)
    else:
        load_model_weights(chunks, model_dir)
    if lora is not None:  # after the base weights load (the loader knows no adapters), before DDP
        count = apply_lora(chunks, lora, seed=seed)
        log.info("LoRA: %d adapters of rank %d (alpha/r = %g) on %s; the base is frozen", count, lora.rank,
                 lora.scale, ", ".join(t.name for t in lora.targets()))
    optimizer = scheduler = None
    if optim is not None:
        chunks = wrap_ddp(chunks, optim)
        optimizer, scheduler = build_optimizer(chunks, optim, total_steps=total_steps)
    else:
        for chunk in chunks:
            chunk.requires_grad_(False)
            chunk.eval()
    return Policy(chunks=chunks, optimizer=optimizer, scheduler=scheduler, model_dir=model_dir,
                  hf_config=hf_config, has_hf_weights=hf, lora=lora, base=base)


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
              rollout_steps: int, seed: int = 0, base: BaseIdentity | None = None) -> Learner:
        """The policy with its optimizer (LR schedule over ``rollout_steps * mu`` optimizer steps)
        and, when the algorithm has a KL term, a frozen reference copy of the initial model (with
        LoRA: the base, i.e. the policy with its adapters disabled). ``seed``, ``base``: the LoRA
        adapters' initialisation seed and the base's identity (``build_policy``)."""
        from megatron.core.utils import get_model_config

        policy = build_policy(model, dims=dims, optim=optim, total_steps=rollout_steps * settings.spec.mu, seed=seed,
                              base=base)
        # Every forward (policy, pi_old, reference) pads its micro-batches to what the model's config needs.
        config = get_model_config(policy.chunks[0])
        settings = dataclasses.replace(settings, pad_to_multiple=sequence_multiple(config),
                                       moe=bool(config.num_moe_experts))
        if config.num_moe_experts:  # router metrics; the engine's routing replayed with moe_routing_replay: rollout
            attach(policy.chunks, replay=model.moe_routing_replay == "rollout", layers=config.num_layers)
        elif model.moe_routing_replay != "none":
            raise ConfigError(f"model.moe_routing_replay={model.moe_routing_replay!r} needs a mixture-of-experts model; "
                              f"{model.path} is dense: set model.moe_routing_replay: none")
        learner = cls(policy, settings=settings, dims=dims, reference=None, model=model)
        learner.reference = learner._reference_for(settings)
        return learner

    def _reference_for(self, settings: StepSettings) -> Policy | None:
        """The frozen reference model when ``settings``' algorithm has a KL term (built once)."""
        if not settings.spec.needs_reference:
            return None
        if self.policy.lora is not None:  # the base is the initial model: the policy without its adapters
            log.info("KL reference: the frozen base with the LoRA adapters disabled (no second model)")
            return self.policy
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
        self.settings = dataclasses.replace(settings, pad_to_multiple=self.settings.pad_to_multiple,
                                            moe=self.settings.moe)
        self.reference = self._reference_for(settings)

    def step(self, batch: Batch) -> dict[str, float]:
        """One rollout step's updates; metrics identical on every rank."""
        return train_step(self.policy, batch, self.settings, self.dims, ref_logp=self.reference_logprobs(batch))

    def mean_entropy(self, batch: Batch) -> float:
        """The policy's mean <H>_i over every completion of ``batch`` (GTPO's filter statistic: its
        probability floor and temperature), on every rank: one no-grad forward of this rank's rows,
        then one all-reduce of (sum, count) over the world. Every row is counted by each of its
        TP x CP ranks on the last pipeline stage alike, so the ratio is the batch mean. The driver's
        ``entropy_threshold: auto`` rule reads it once per run."""
        spec = self.settings.spec
        _, mbs = rank_micro_batches(batch, self.settings, self.dims)
        chunks = self.policy.chunks
        lp_settings = logprob_settings(self.settings, self.dims, process_groups(), chunks)
        stats = forward_stats(chunks, batch, mbs, lp_settings, entropy_prob_floor=spec.entropy_prob_floor,
                              entropy_temperature=spec.entropy_temperature(self.settings.temperature))
        totals = torch.zeros(2, dtype=torch.float64, device=collectives.comm_device())
        if stats is not None:
            totals[0], totals[1] = stats.mean_entropy.double().sum(), stats.mean_entropy.numel()
        if dist.is_initialized():
            dist.all_reduce(totals)
        return float(totals[0] / totals[1])

    def reference_logprobs(self, batch: Batch) -> torch.Tensor | None:
        """The reference model's log-probs of this rank's rows [local B, T] (last pipeline stage;
        None elsewhere and without a reference model): they never leave the rank that computed them."""
        if self.reference is None:
            return None
        _, mbs = rank_micro_batches(batch, self.settings, self.dims)
        chunks = self.reference.chunks
        lp_settings = logprob_settings(self.settings, self.dims, process_groups(), chunks)
        base = lora_disabled(chunks) if self.reference is self.policy else contextlib.nullcontext()
        with base:
            stats = forward_stats(chunks, batch, mbs, lp_settings)
        return None if stats is None else stats.logp
