"""GPU smoke: each GPU-facing piece of megatron-gtpo once, on one GPU, in one process (world of 1).

    python bench/gpu_smoke.py                   # CUDA + NCCL, bf16; sized for minutes on one H200 (not yet timed there)
    python bench/gpu_smoke.py --dry             # CPU / CI: arguments, configs, model config, data; prints the plan
    python bench/gpu_smoke.py --device cpu --tiny --skip vllm   # the same code paths on gloo (checks this script)

Parts, in order; each reports its status, seconds and peak GPU memory:

  logprob     train/logprobs.py's fused log-prob/entropy on random bf16 logits, forward and backward,
              against an fp32 log_softmax reference (hard tolerance)
  local       a random Llama-shaped model on Megatron's local (pure PyTorch) layer spec, bf16, Megatron
              DDP + Adam, ``--steps`` GTPO train steps (train/step.py's train_step) on a synthetic
              Batch made by train/batching.py's collate (groups share a prompt, completions share
              ``--shared-prefix`` tokens and end with EOS, so GTPO finds conflicts)
  checkpoint  checkpoint/store.py: saved after step 1, loaded back after the last step; the weights must come
              back bit for bit, then the step is repeated and its loss compared with the original step 2
  optim_state the optimizer-state contract (train/optim_state.py) with the Adam Megatron built here (TE
              FusedAdam where TE imports): distributed optimizer, one step, save, a fresh policy primed
              and loaded, its state in that optimizer's layout, Adam's step 1 read by the D4
              diagnostics, one more step on both (losses reported)
  offload     train/offload.py (rollout.offload_trainer) after a step: the bytes it frees must reach the
              driver (torch.cuda.mem_get_info, >= 80 %), the optimizer state must come back bit for bit
  export      sync/export.py's streaming exporter: every HF tensor, checked against the HF model's
              names and shapes (sync/checks.py, when transformers imports) and the Megatron parameters
  te_bf16     the Transformer Engine layer spec, bf16, loaded with the step-1 weights: |logp - logp_local|
              over the completion tokens (train/step.py's forward_stats) and |loss - loss_local| of one
              train step, same weights and batch
  te_fp8      the same with FP8 (``--fp8-recipe``; needs compute capability >= 9.0)
  te_packed   packed micro-batches (train.micro_batch_tokens) in Megatron's THD format on the TE spec,
              step-1 weights: log-probs, loss and grad norm against the same model's padded run
  vllm        an in-process vLLM engine (dummy weights, no tokenizer) takes the exported weights through
              sync/colocated.py's ColocatedSync.sync (export + checks + push, as the driver calls it);
              vLLM's greedy tokens are compared with Megatron's

Parts that cannot run here (no Transformer Engine, no vLLM, compute capability < 9.0) print one
``SKIP`` line each; every part that ran prints one ``PART {json}`` line. The last line of stdout is one JSON object (also written to ``--json-out``);
the exit status is 1 when a part that ran failed, 2 for bad arguments. The model is built
in-process from a config dict (no hub, no files), so the first six parts need only torch,
megatron-core and this repository (code: bench/gpu_smoke_setup.py, bench/gpu_smoke_parts.py;
docs/gpu.md has the install). Numbers that compare two builds (TE against local, vLLM
against Megatron) are reported, not judged: bf16 kernels differ in rounding.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: megatron_gtpo, bench

from bench.gpu_smoke_setup import (PARTS, TINY, SmokeConfig, absent_reason, hf_config,  # noqa: E402
                                   param_count, step_settings, synthetic_batch)
from megatron_gtpo.utils.configuration import ConfigError  # noqa: E402


def parse_args(argv: list[str] | None) -> tuple[SmokeConfig, argparse.Namespace]:
    """``SmokeConfig`` from the command line (``--tiny`` fills the fields not given); exits 2 on bad values."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    for field in dataclasses.fields(SmokeConfig):
        flag = "--" + field.name.replace("_", "-")
        if field.name == "skip":
            parser.add_argument(flag, default=None, help=f"comma-separated parts to leave out: {','.join(PARTS)}")
        elif field.name == "workdir":
            parser.add_argument(flag, default=None, help="folder for the temporary checkpoint (default: the system's)")
        else:
            parser.add_argument(flag, type=type(field.default), default=None, help=f"default {field.default}")
    parser.add_argument("--tiny", action="store_true", help=f"small model and batch for a CPU: {TINY}")
    parser.add_argument("--dry", action="store_true",
                        help="build configs, model config and data, print the plan and exit 0 (no CUDA call)")
    parser.add_argument("--json-out", default=None, help="also write the JSON result to this file")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder (checkpoint, config.json)")
    opts = parser.parse_args(argv)
    given = {f.name: getattr(opts, f.name) for f in dataclasses.fields(SmokeConfig)}
    values = {**(TINY if opts.tiny else {}), **{k: v for k, v in given.items() if v is not None}}
    if isinstance(values.get("skip"), str):
        values["skip"] = tuple(s.strip() for s in values["skip"].split(",") if s.strip())
    from megatron_gtpo.train.model import check_layout

    try:
        cfg = SmokeConfig(**values)
        check_layout(hf_config(cfg), tp=1, pp=1, vpp=None)  # head/group divisibility, named as config.json fields
        return cfg, opts
    except ConfigError as err:
        parser.exit(2, f"gpu_smoke.py: bad argument: {err}\n")


def dry_run(cfg: SmokeConfig) -> dict:
    """Everything before the first CUDA call: Megatron's TransformerConfig, the algorithm and optimizer
    configs, the synthetic batch and its micro-batches, and which parts would run given the installed
    packages."""
    from megatron_gtpo.train.batching import micro_batches
    from megatron_gtpo.train.model import transformer_config_from_hf
    from megatron_gtpo.train.optim import OptimConfig

    hf = hf_config(cfg)
    config = transformer_config_from_hf(hf, tp=1, pp=1, vpp=None, dtype=torch.bfloat16,
                                        overrides={"init_method_std": cfg.init_std})
    settings = step_settings(cfg)
    OptimConfig(optimizer={**OptimConfig().optimizer, "lr": cfg.lr})
    batch = synthetic_batch(cfg)
    mbs = micro_batches(batch, slice(None), micro_batch_size=settings.micro_batch_size, common_length=False,
                        pad_to_multiple=settings.pad_to_multiple)
    plan = {part: absent_reason(part, cfg, dry=True) for part in PARTS}
    return {"dry": True, "would_run": [p for p, why in plan.items() if why is None],
            "would_skip": {p: why for p, why in plan.items() if why is not None},
            "note": "te_fp8 also needs compute capability >= 9.0; te_* and vllm are decided again at run time",
            "config": dataclasses.asdict(cfg), "model_params": param_count(hf),
            "megatron": {"num_layers": config.num_layers, "hidden_size": config.hidden_size,
                         "ffn_hidden_size": config.ffn_hidden_size, "num_query_groups": config.num_query_groups,
                         "kv_channels": config.kv_channels},
            "algo": {"name": settings.spec.name, "agg_mode": settings.spec.agg_mode, "mu": settings.spec.mu,
                     "entropy_threshold": settings.spec.entropy_threshold},
            "batch": {"rows": batch.size, "seq": int((batch.prompt_lengths + batch.lengths).max()),
                      "groups": int(batch.group_ids.max()) + 1, "completion_tokens": int(batch.lengths.sum()),
                      "completion_width": batch.token_ids.shape[1],
                      "micro_batch_shapes": sorted({tuple(mb.input_ids.shape) for mb in mbs})}}


def environment() -> dict:
    """Versions and the device, for the JSON line."""
    import megatron.core

    out = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
           "megatron_core": getattr(megatron.core, "__version__", None)}
    for name in ("transformer_engine", "vllm", "transformers"):
        module = sys.modules.get(name)
        out[name] = getattr(module, "__version__", None) if module else None
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name()
        out["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
    return out


def summary(parts: dict[str, dict], cfg: SmokeConfig, seconds: float) -> dict:
    """The JSON line: what ran, failed or was skipped, the headline numbers, then every part's report."""
    ran = [n for n, p in parts.items() if p["status"] in ("ok", "fail")]
    failed = [n for n, p in parts.items() if p["status"] in ("fail", "not_run")]
    out = {"smoke": "megatron-gtpo gpu", "ok": not failed, "ran": ran, "failed": failed,
           "skipped": {n: p["reason"] for n, p in parts.items() if p["status"] == "skip"},
           "seconds": round(seconds, 1), "loss_local": parts.get("local", {}).get("losses")}
    peaks = [p["peak_mem_gib"] for p in parts.values() if "peak_mem_gib" in p]
    out["peak_mem_gib"] = max(peaks) if peaks else None
    for name in ("te_bf16", "te_fp8"):
        if parts.get(name, {}).get("status") == "ok":
            out[f"loss_{name}"] = parts[name]["loss"]
            out[f"abs_loss_{name}_vs_local"] = parts[name]["abs_loss_vs_local"]
    out.update(env=environment(), config=dataclasses.asdict(cfg), parts=parts)
    return out


def emit(result: dict, json_out: str | None) -> None:
    line = json.dumps(result, default=str)
    if json_out:
        Path(json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(json_out).write_text(line + "\n")
    print(line, flush=True)


def main(argv: list[str] | None = None) -> int:
    cfg, opts = parse_args(argv)
    if opts.dry:
        result = dry_run(cfg)
        for part, why in result["would_skip"].items():
            print(f"SKIP {part}: {why}")
        print(f"would run: {', '.join(result['would_run'])}")
        emit(result, opts.json_out)
        return 0
    if cfg.workdir is not None and not Path(cfg.workdir).is_dir():
        print(f"gpu_smoke.py: --workdir {cfg.workdir} is not an existing directory; create it or leave the option out",
              file=sys.stderr)
        return 2
    if cfg.device == "cuda" and not torch.cuda.is_available():
        print("gpu_smoke.py: CUDA is not available; use --dry (plan only) or --device cpu (CPU check)", file=sys.stderr)
        return 2
    from bench.gpu_smoke_parts import Smoke
    from megatron_gtpo.parallel.dims import init_distributed

    start = time.perf_counter()
    workdir = Path(tempfile.mkdtemp(prefix="gpu-smoke-", dir=cfg.workdir))
    try:
        smoke = Smoke(cfg, init_distributed(tp=1, pp=1, seed=cfg.seed), workdir)
        smoke.run_all()
    finally:
        if not opts.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    result = summary(smoke.parts, cfg, time.perf_counter() - start)
    emit(result, opts.json_out)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    # A normal exit: os._exit would orphan the checkpoint writer's multiprocessing worker, which keeps
    # stdout open and stalls any `| tee` after the smoke.
    sys.exit(main())
