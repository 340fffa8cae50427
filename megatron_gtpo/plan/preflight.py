"""Cheap checks of a RunConfig before any rank, engine or model starts (``train`` and ``--dry-run``).

Each check raises ConfigError / FileNotFoundError naming the key path or file and the fix:
the output directory, the vLLM engine arguments, the model and parallel layout, the context length,
the prompts (tokenised with the model's own tokenizer, as the run will) and the reward function.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

from megatron_gtpo.data.dataset import build_prompts, load_examples
from megatron_gtpo.models.config import DTYPES
from megatron_gtpo.models.hf_config import read_hf_config
from megatron_gtpo.models.hub import METADATA
from megatron_gtpo.models.resolve import resolve_model
from megatron_gtpo.plan.engine_args import check_vllm_kwargs, context_problem
from megatron_gtpo.reward.functions import resolve_reward
from megatron_gtpo.rollout.pool import server_addresses
from megatron_gtpo.tracking import check_tracking_uri, resolve_uri
from megatron_gtpo.train.model import transformer_config_from_hf
from megatron_gtpo.utils.configuration import ConfigError


def preflight(cfg) -> str:
    """Validates everything that can be checked without starting a rank; returns a summary."""
    check_output_dir(cfg.output_dir)
    tc = cfg.tracking  # early: a tracking server that does not answer fails in seconds, not after engine start
    tracking = check_tracking_uri(resolve_uri(tc.uri, cfg.output_dir), tc.request_timeout_s) \
        if tc.enabled and "mlflow" in tc.backends else "MLflow off"
    if tc.enabled and set(tc.backends) - {"mlflow"}:
        tracking += "; also " + ", ".join(b for b in tc.backends if b != "mlflow")
    elif not tc.enabled:
        tracking = "off"
    check_vllm_kwargs(cfg.rollout.vllm)
    on_gpu = torch.cuda.is_available()
    check_rollout_servers(cfg.sync, on_gpu=on_gpu)
    check_fusions(cfg.model.megatron, on_gpu=on_gpu)
    par = cfg.parallel
    model_dir = resolve_model(cfg.model.path, hub_files=METADATA)  # a hub id: shape and tokenizer, no weights
    hf_config = read_hf_config(model_dir)
    try:
        transformer_config_from_hf(hf_config, tp=par.tp, pp=par.pp, vpp=par.vpp, dtype=DTYPES[cfg.model.dtype],
                                   overrides=cfg.model.megatron, cp=par.cp)
    except ConfigError as err:
        raise ConfigError(f"model {model_dir} at parallel.tp={par.tp} cp={par.cp} pp={par.pp} vpp={par.vpp}: "
                          f"{err}") from None
    context = check_context(cfg, hf_config)
    stats = check_prompts(cfg.data, tokenizer_dir=cfg.rollout.vllm.get("tokenizer") or model_dir)
    try:
        resolve_reward(cfg.reward.fn)
    except (ImportError, AttributeError, ValueError) as err:
        raise ConfigError(f"reward.fn={cfg.reward.fn!r}: {err}") from None
    return _summary(cfg, model_dir=model_dir, hf_config=hf_config, context=context, stats=stats) + \
        f"\ntracking   {tracking}"


def check_rollout_servers(sync, *, on_gpu: bool) -> None:
    """``sync.transport: separate`` on GPUs needs rollout servers on GPUs of their own. With no
    address known (``sync.servers``, or ``MGTPO_ROLLOUT_HOSTS`` from ``ROLLOUT_NODES``), trainer rank
    0 would start one on its own node, on the GPUs its trainer ranks hold, and vLLM refuses to start
    there (it needs its share of the GPU free): refused now, in seconds, instead."""
    if sync.transport != "separate" or not on_gpu or server_addresses(sync):
        return
    raise ConfigError(
        "sync.transport=separate on GPUs, but no rollout server is known: submit with ROLLOUT_NODES=N "
        "(slurm/train.sbatch starts one `megatron-gtpo rollout-server` on each of the last N nodes and exports "
        "MGTPO_ROLLOUT_HOSTS), or set sync.servers=[host:port, ...] to running servers; without either, trainer "
        "rank 0 would start the server on its own node, on GPUs the trainer ranks hold, where vLLM refuses to start")


def check_fusions(megatron: dict, *, on_gpu: bool) -> None:
    """Fusions Megatron-Core 0.16.1 can only build with a kernel it imports: refused here, naming the
    setting, instead of at model build. ``gradient_accumulation_fusion`` needs apex's
    ``fused_weight_gradient_mlp_cuda`` even with Transformer Engine: the output layer is Megatron's own
    ``ColumnParallelLinear`` (tensor_parallel/layers.py), which raises without it; TE's linears fuse the
    wgrad accumulation themselves. (``apply_rope_fusion`` needs TE >= 1.4: TransformerConfig checks it.)"""
    if not megatron.get("gradient_accumulation_fusion"):
        return
    from megatron.core.tensor_parallel import layers

    if not (on_gpu and layers._grad_accum_fusion_available):
        raise ConfigError(
            "model.megatron.gradient_accumulation_fusion=true needs apex's fused_weight_gradient_mlp_cuda "
            "extension (apex built with --cpp_ext --cuda_ext, not in requirements/gpu.lock) and a GPU: Megatron's "
            "output layer refuses to build without it; remove the setting")


def check_output_dir(output_dir: str) -> None:
    """The run directory must be a directory (or creatable) and writable. Creates nothing: a file
    made and removed in the nearest existing ancestor proves that the run can write there."""
    path = Path(output_dir).expanduser()
    if path.exists() and not path.is_dir():
        raise ConfigError(f"output_dir={output_dir!r} is an existing file, not a directory; pass another "
                          f"--output-dir (or move the file away)")
    ancestor = path
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ConfigError(f"output_dir={output_dir!r} cannot be created: {ancestor} is a file, not a directory; "
                          f"pass another --output-dir")
    try:
        fd, probe = tempfile.mkstemp(prefix=".megatron-gtpo-write-test-", dir=ancestor)
    except OSError as err:
        what = "is not writable" if ancestor == path else f"cannot be created: {ancestor} is not writable"
        raise ConfigError(f"output_dir={output_dir!r} {what} ({err.strerror}); pass a writable --output-dir") from None
    os.close(fd)
    os.unlink(probe)


def check_context(cfg, hf_config: dict) -> int:
    """Prompt + completion budget against the engine's context; returns the context length.

    The context is ``rollout.vllm.max_model_len`` when set, else the model's max_position_embeddings
    (vLLM's own default). Prompts longer than data.max_prompt_tokens are dropped before rollout, so
    this bound also covers the longest prompt actually kept."""
    explicit, positions = cfg.rollout.vllm.get("max_model_len"), hf_config.get("max_position_embeddings")
    if explicit is not None and positions and int(explicit) > int(positions) \
            and os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN") != "1":
        raise ConfigError(f"rollout.vllm.max_model_len={explicit} exceeds the model's max_position_embeddings="
                          f"{positions}: vLLM refuses to start such an engine (positions past it are not trained); "
                          f"set rollout.vllm.max_model_len <= {positions} and keep data.max_prompt_tokens + "
                          f"rollout.max_tokens within it")
    if explicit is not None:
        context, source = int(explicit), "rollout.vllm.max_model_len"
    elif hf_config.get("max_position_embeddings"):
        context, source = int(hf_config["max_position_embeddings"]), "the model's max_position_embeddings"
    else:
        return 0  # vLLM derives it from other fields: nothing to check against here
    problem = context_problem(context=context, source=source, max_prompt_tokens=cfg.data.max_prompt_tokens,
                              max_tokens=cfg.rollout.max_tokens)
    if problem:
        raise ConfigError(problem)
    return context


def check_prompts(data_cfg, *, tokenizer_dir):
    """Renders and tokenises every prompt as the run will (same template, same tokenizer, same
    length filter) and returns the DatasetStats; ConfigError when no prompt is left."""
    from transformers import AutoTokenizer

    examples = load_examples(data_cfg)
    if not examples:
        raise ConfigError("data: the configured benchmarks/paths hold no rows")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    except (OSError, ValueError) as err:
        raise ConfigError(f"no Hugging Face tokenizer in {tokenizer_dir} ({err}); the model directory must hold "
                          f"the tokenizer files, or set rollout.vllm.tokenizer") from None
    try:
        _, stats = build_prompts(examples, tokenizer=tokenizer, template=data_cfg.template,
                                 system_prompt=data_cfg.system_prompt, use_chat_template=data_cfg.use_chat_template,
                                 max_prompt_tokens=data_cfg.max_prompt_tokens)
    except ValueError as err:
        raise ConfigError(f"data: {err}") from None
    if not stats.num_prompts:
        raise ConfigError(
            f"data: all {stats.num_rows} prompts are longer than data.max_prompt_tokens={data_cfg.max_prompt_tokens} "
            f"tokens after the template (longest {stats.longest_tokens} tokens); raise data.max_prompt_tokens "
            f"(and rollout.vllm.max_model_len to fit prompt + rollout.max_tokens) or use a shorter data.template")
    return stats


def _summary(cfg, *, model_dir, hf_config: dict, context: int, stats) -> str:
    par = cfg.parallel
    algo = cfg.algorithm
    rows = cfg.train.prompts_per_step * cfg.rollout.n
    per_rank = rows // par.dp
    return "\n".join([
        f"model      {model_dir} ({hf_config.get('architectures', ['?'])[0]}, {hf_config['num_hidden_layers']} layers, "
        f"{hf_config['num_attention_heads']} heads / {hf_config.get('num_key_value_heads')} kv, "
        f"vocab {hf_config['vocab_size']}), dtype {cfg.model.dtype}",
        f"layout     tp={par.tp} cp={par.cp} pp={par.pp} vpp={par.vpp} dp={par.dp} -> {par.world_size} rank(s), "
        f"{'CUDA' if torch.cuda.is_available() else 'CPU/gloo'}" + _cp_note(par.cp),
        f"algorithm  {algo.name}: agg={algo.agg_mode} adv_std_scale={algo.adv_std_scale} kl_beta={algo.kl_beta} mu={algo.mu}"
        + (f" W={algo.conflict_weight} overlap={algo.conflict_overlap} "
           f"H*={'auto (the authors rule, decided at step 1)' if algo.entropy_threshold is None else algo.entropy_threshold} "
           f"gamma={algo.entropy_gamma:g} (reward {cfg.reward.fn}) norm={algo.gtpo_normalization}"
           if algo.conflict_aware else ""),
        f"batch      {cfg.train.prompts_per_step} prompts x {cfg.rollout.n} completions = {rows} rows; "
        f"{per_rank} per DP rank " + (f"packed into micro-batches of <= {cfg.token_budget} tokens" if cfg.token_budget
                                      else f"in {per_rank // cfg.train.micro_batch_size} micro-batch(es) of "
                                           f"{cfg.train.micro_batch_size}"),
        f"rollout    vLLM ({cfg.sync.transport}), T={cfg.rollout.temperature} top_p={cfg.rollout.top_p} "
        f"max_tokens={cfg.rollout.max_tokens}" + (f", context {context} tokens" if context else ""),
        f"data       {cfg.data.benchmarks + cfg.data.paths}: {stats.summary()}",
        f"reward     {cfg.reward.fn}, " + (f"{cfg.reward.num_workers} worker process(es)" if cfg.reward.num_workers
                                            else "in the training process (num_workers=0: no crash protection)"),
        f"run        {cfg.train.steps} steps -> {cfg.output_dir}",
    ])


def _cp_note(cp: int) -> str:
    if cp == 1:
        return ""
    attention = "Transformer Engine's CP attention" if torch.cuda.is_available() else \
        "the exact CPU stand-in for TE's CP attention"
    return f"; context parallel over {cp} ranks with {attention}"
