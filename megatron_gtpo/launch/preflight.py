"""Cheap checks of a RunConfig before any rank, engine or model starts (``train`` and ``--dry-run``).

Each check raises ConfigError / FileNotFoundError naming the key path or file and the fix.
"""

from __future__ import annotations

import torch

from megatron_gtpo.utils.configuration import ConfigError


def preflight(cfg) -> str:
    """Validates tracking URI, model, layout, Megatron pass-through fields, data and reward; returns a summary."""
    from megatron_gtpo.data.dataset import load_examples
    from megatron_gtpo.models.tiny import resolve_model_path
    from megatron_gtpo.policy import DTYPES
    from megatron_gtpo.reward.functions import resolve_reward
    from megatron_gtpo.tracking import check_tracking_uri, resolve_uri
    from megatron_gtpo.train.model import hf_config_from_dir, transformer_config_from_hf

    tc = cfg.tracking  # first: a tracking server that does not answer fails in seconds, not after engine start
    tracking = check_tracking_uri(resolve_uri(tc.uri, cfg.output_dir), tc.request_timeout_s) if tc.enabled else "off"
    par = cfg.parallel
    model_dir = resolve_model_path(cfg.model.path)
    hf_config = hf_config_from_dir(model_dir)
    try:
        transformer_config_from_hf(hf_config, tp=par.tp, pp=par.pp, vpp=par.vpp, dtype=DTYPES[cfg.model.dtype],
                                   overrides=cfg.model.megatron)
    except ConfigError as err:
        raise ConfigError(f"model {model_dir} at parallel.tp={par.tp} pp={par.pp} vpp={par.vpp}: {err}") from None
    examples = load_examples(cfg.data)
    if not examples:
        raise ConfigError("data: the configured benchmarks/paths hold no rows")
    try:
        resolve_reward(cfg.reward.fn)
    except (ImportError, AttributeError, ValueError) as err:
        raise ConfigError(f"reward.fn={cfg.reward.fn!r}: {err}") from None
    algo = cfg.algo.resolved()
    rows = cfg.train.prompts_per_step * cfg.rollout.n
    per_rank = rows // par.dp
    lines = [
        f"model      {model_dir} ({hf_config.get('architectures', ['?'])[0]}, {hf_config['num_hidden_layers']} layers, "
        f"{hf_config['num_attention_heads']} heads / {hf_config.get('num_key_value_heads')} kv, "
        f"vocab {hf_config['vocab_size']}), dtype {cfg.model.dtype}",
        f"layout     tp={par.tp} pp={par.pp} vpp={par.vpp} dp={par.dp} -> {par.world_size} rank(s), "
        f"{'CUDA' if torch.cuda.is_available() else 'CPU/gloo'}",
        f"algorithm  {algo.name}: agg={algo.agg_mode} std_scale={algo.adv_std_scale} kl_beta={algo.kl_beta} mu={algo.mu}"
        + (f" W={algo.conflict_weight} overlap={algo.conflict_overlap} H*={algo.entropy_threshold} "
           f"gamma={algo.entropy_gamma} norm={algo.gtpo_normalization}" if algo.name == "gtpo" else ""),
        f"batch      {cfg.train.prompts_per_step} prompts x {cfg.rollout.n} completions = {rows} rows; "
        f"{per_rank} per DP rank in {per_rank // cfg.train.micro_batch_size} micro-batch(es) of "
        f"{cfg.train.micro_batch_size}",
        f"rollout    vLLM ({cfg.sync.transport}), T={cfg.rollout.temperature} top_p={cfg.rollout.top_p} "
        f"max_tokens={cfg.rollout.max_tokens}",
        f"data       {len(examples)} rows from {cfg.data.benchmarks + cfg.data.paths}; reward {cfg.reward.fn}",
        f"run        {cfg.train.steps} steps -> {cfg.output_dir}",
        f"tracking   {tracking}",
    ]
    return "\n".join(lines)
