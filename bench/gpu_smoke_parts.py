"""The parts of ``bench/gpu_smoke.py`` (see its docstring): one method each, run in order by
:class:`Smoke`, each returning the numbers it reports or raising :class:`SmokeFailure`.
"""

from __future__ import annotations

import dataclasses
import gc
import importlib.util
import json
import math
import time
import traceback
from pathlib import Path

import torch

from bench.gpu_smoke_setup import (NEEDS, PARTS, Policy, SmokeConfig, absent_reason, build_policy, next_token_logits,
                                   gtpo_train_step, hf_config, param_count, step_settings, synthetic_batch, token_stats)


class SmokeFailure(RuntimeError):
    """A hard check of a part failed (the message says which and by how much)."""


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn):
    _sync()
    start = time.perf_counter()
    out = fn()
    _sync()
    return out, time.perf_counter() - start


def _state_keys(inner, rules) -> list[str]:
    """The per-parameter state keys of ``inner``; SmokeFailure for any its rules do not allow."""
    keys = sorted({k for state in inner.state.values() for k in state})
    allowed = set(rules.keys) | ({"step"} if rules.step_per_param else set())
    if not keys or set(keys) - allowed:
        raise SmokeFailure(f"{rules.name} holds per-parameter state {keys}; its rules allow {sorted(allowed)}")
    return keys


NEAR_TIE = 0.1
"""vLLM's greedy token may lose to Megatron's best by at most this share of the logits' scale (the
smallest gap between a position's best and median logit): a near-tie flipped by bf16 rounding."""


def greedy_against_megatron(tokens: list[list[int]], logits: list[torch.Tensor], prompt_lengths: list[int]) -> dict:
    """vLLM's greedy continuations judged by Megatron's logits on the same sequences (teacher
    forcing, so one flipped near-tie does not derail the rest): at each generated position how far
    Megatron's best logit lies above that of vLLM's token (0 where they agree), and for scale how far
    it lies above the median logit. A token chosen from the same weights up to bf16 rounding is
    within rounding of the best; one chosen from other weights is typically near the median."""
    gaps, spreads, agree = [], [], []
    for toks, rows_all, n in zip(tokens, logits, prompt_lengths):
        rows = rows_all[n - 1:n - 1 + len(toks)]  # row j predicts generated token j
        best = rows.max(dim=-1).values
        chosen = rows.gather(1, torch.tensor(toks, dtype=torch.long)[:, None])[:, 0]
        gaps.append(float((best - chosen).max()))
        spreads.append(float((best - rows.median(dim=-1).values).min()))
        argmax = rows.argmax(dim=-1).tolist()
        agree.append(next((j for j, (a, b) in enumerate(zip(toks, argmax)) if a != b), len(toks)))
    return {"greedy_tokens_agreeing": agree, "logit_gap_max": max(gaps), "logit_spread_min": min(spreads)}


def _masked_abs(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    """(max, mean) of |a - b| over ``mask`` (the Batch's mask lives on the CPU, the statistics on the device)."""
    diff = (a.float() - b.float()).abs()[mask.bool().to(a.device)]
    return float(diff.max()), float(diff.mean())


class Smoke:
    """Runs the parts in order; each one's report lands in ``self.parts[name]``."""

    def __init__(self, cfg: SmokeConfig, dims, workdir: Path):
        self.cfg, self.dims, self.workdir = cfg, dims, workdir
        self.hf = hf_config(cfg)
        self.batch = synthetic_batch(cfg)  # the completion view; model inputs are [micro_batch, seq]
        self.settings = step_settings(cfg)
        self.parts: dict[str, dict] = {}
        self.local: Policy | None = None
        self.losses: list[float] = []
        self.step1: dict = {}  # step-1 checkpoint dir, save time and weight snapshot (or the save error)
        self.stats_local = None  # ForwardStats of the local model at the step-1 weights

    def run_all(self) -> None:
        for name in PARTS:
            self.run(name, getattr(self, f"part_{name}"))

    def run(self, name: str, fn) -> None:
        missing = [n for n in NEEDS.get(name, ()) if self.parts.get(n, {}).get("status") != "ok"]
        reason = None if missing else absent_reason(name, self.cfg, dry=False)
        if missing:
            self.parts[name] = {"status": "not_run", "reason": f"needs {', '.join(missing)}, which did not pass"}
            return
        if reason:
            print(f"SKIP {name}: {reason}", flush=True)
            self.parts[name] = {"status": "skip", "reason": reason}
            return
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        try:
            entry = {"status": "ok", **fn()}
        except Exception as err:  # noqa: BLE001 - a failed part is reported, the others still run
            traceback.print_exc()
            entry = {"status": "fail", "error": f"{type(err).__name__}: {err}"[:500]}
        _sync()
        entry["seconds"] = round(time.perf_counter() - start, 2)
        if torch.cuda.is_available():
            entry["peak_mem_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
        print(f"{name}: {entry['status']} in {entry['seconds']} s", flush=True)
        print("PART " + json.dumps({"part": name, **entry}, default=str), flush=True)  # one JSON line per part
        self.parts[name] = entry

    @property
    def device(self) -> torch.device:
        from megatron_gtpo.parallel.collectives import comm_device

        return comm_device()

    def part_logprob(self) -> dict:
        """Fused log-prob/entropy (temperature 0.7) against log_softmax in fp32: values and gradients."""
        from megatron_gtpo.train.logprobs import vocab_parallel_logprob_entropy

        n, v, temp = min(self.cfg.rows * self.cfg.seq, 8192), self.cfg.vocab, 0.7
        g = torch.Generator(device=self.device).manual_seed(self.cfg.seed)
        logits = (3 * torch.randn(n, v, generator=g, device=self.device)).to(torch.bfloat16)
        target = torch.randint(0, v, (n,), generator=g, device=self.device)
        g_lp, g_h = torch.randn(n, generator=g, device=self.device), torch.randn(n, generator=g, device=self.device)

        def fused():
            x = logits.clone().requires_grad_()
            lp, h = vocab_parallel_logprob_entropy(x, target, temperature=temp)
            (lp * g_lp + h * g_h).sum().backward()
            return lp.detach(), h.detach(), x.grad

        def reference():
            x = logits.clone().requires_grad_()
            z = torch.log_softmax(x.float() / temp, dim=-1)
            lp, h = z.gather(1, target[:, None])[:, 0], -(z.exp() * z).sum(-1)
            (lp * g_lp + h * g_h).sum().backward()
            return lp.detach(), h.detach(), x.grad

        (lp, h, grad), fused_s = _timed(fused)
        (lp_ref, h_ref, grad_ref), ref_s = _timed(reference)
        errors = {"logp_abs_max": float((lp - lp_ref).abs().max()), "entropy_abs_max": float((h - h_ref).abs().max()),
                  "grad_rel_max": float((grad.float() - grad_ref.float()).abs().max() / grad_ref.float().abs().max())}
        limits = {"logp_abs_max": 2e-3, "entropy_abs_max": 2e-3, "grad_rel_max": 2e-2}
        bad = {k: v for k, v in errors.items() if not v <= limits[k]}
        if bad:
            raise SmokeFailure(f"fused log-prob/entropy off the fp32 reference: {bad} (limits {limits})")
        return {"tokens": n, "vocab": v, **errors, "fused_fwd_bwd_s": round(fused_s, 4),
                "reference_fwd_bwd_s": round(ref_s, 4)}

    def part_local(self) -> dict:
        """``steps`` GTPO steps of the local-spec bf16 model; the step-1 state is checkpointed."""
        cfg = self.cfg
        self.local = build_policy(cfg, self.hf, self.dims, use_te=False)
        steps = []
        for step in range(1, cfg.steps + 1):
            metrics, seconds = _timed(lambda: gtpo_train_step(self.local, self.batch, self.settings, self.dims))
            steps.append({"loss": metrics["loss"], "grad_norm": metrics["optim/grad_norm"], "s": seconds,
                          "update_ok": metrics["optim/update_ok"],
                          "conflicts": metrics["gtpo/conflict_tokens_per_completion"]})
            if step == 1:
                self._save_step1()
        self.losses = [s["loss"] for s in steps]
        bad = [i + 1 for i, s in enumerate(steps)
               if not (math.isfinite(s["loss"]) and math.isfinite(s["grad_norm"]) and s["update_ok"] == 1.0)]
        if bad:
            raise SmokeFailure(f"steps {bad}: non-finite loss or grad norm, or a skipped update: {steps}")
        step_s = [s["s"] for s in steps]
        return {"model_params": param_count(self.hf), "losses": self.losses,
                "grad_norms": [s["grad_norm"] for s in steps], "step_s": [round(s, 4) for s in step_s],
                "tokens_per_s": round(self.batch.size * cfg.seq / min(step_s[1:]), 1),
                "conflict_tokens_per_completion": steps[0]["conflicts"]}

    def _save_step1(self) -> None:
        """Checkpoint after step 1 and a copy of the weights it holds; an error is kept for part_checkpoint."""
        from megatron_gtpo.checkpoint.store import save_checkpoint
        from megatron_gtpo.train.model import unwrap

        try:
            path, seconds = _timed(lambda: save_checkpoint(
                self.workdir / "ckpt", step=1, model_chunks=self.local.chunks, optimizer=self.local.optimizer,
                extra_state={"smoke_seed": self.cfg.seed}, keep_last=1))
        except Exception as err:  # noqa: BLE001 - reported by the checkpoint part
            traceback.print_exc()
            self.step1 = {"error": f"{type(err).__name__}: {err}"[:500]}
            return
        weights = {n: p.detach().clone() for n, p in unwrap(self.local.chunks[0]).named_parameters()}
        self.step1 = {"dir": path, "save_s": seconds, "weights": weights}

    def part_checkpoint(self) -> dict:
        """Load the step-1 checkpoint after the last step: weights bit for bit, then step 2 again."""
        from megatron_gtpo.checkpoint.store import load_checkpoint
        from megatron_gtpo.train.model import unwrap

        if "error" in self.step1:
            raise SmokeFailure(f"save after step 1 failed: {self.step1['error']}")
        params = dict(unwrap(self.local.chunks[0]).named_parameters())
        saved = self.step1.pop("weights")
        changed = sum(not torch.equal(p, saved[n]) for n, p in params.items())
        if changed == 0:
            raise SmokeFailure("no parameter changed after step 1, so reloading it would prove nothing; raise --lr")
        (step, extra), load_s = _timed(lambda: load_checkpoint(
            self.workdir / "ckpt", model_chunks=self.local.chunks, optimizer=self.local.optimizer, step=1))
        differ = [n for n, p in params.items() if not torch.equal(p, saved[n])]
        if step != 1 or extra != {"smoke_seed": self.cfg.seed} or differ:
            raise SmokeFailure(f"reload of step 1 gave step {step}, extra_state {extra}, "
                               f"{len(differ)} parameters not restored (e.g. {differ[:3]})")
        del saved
        self.stats_local = token_stats(self.local.chunks, self.batch, self.settings, self.dims)
        metrics = gtpo_train_step(self.local, self.batch, self.settings, self.dims)
        mask = self.batch.mask.to(self.stats_local.logp.device)
        disk = sum(f.stat().st_size for f in Path(self.step1["dir"]).rglob("*") if f.is_file())
        return {"save_s": round(self.step1["save_s"], 3), "load_s": round(load_s, 3), "bytes_on_disk": disk,
                "params_changed_since_save": changed, "params_restored_exactly": len(params),
                "loss_after_reload": metrics["loss"], "abs_loss_vs_step2": abs(metrics["loss"] - self.losses[1]),
                "logp_local_mean": float(self.stats_local.logp[mask].mean()),
                "logp_local_std": float(self.stats_local.logp[mask].std())}

    def part_optim_state(self) -> dict:
        """The optimizer-state contract (train/optim_state.py) with the Adam Megatron built on this machine
        (TE's FusedAdam where TE imports, apex's, else torch's AdamW), under the distributed optimizer
        of the GPU recipes: one step, save, a fresh policy primed and loaded (the resume that crashed
        with TE: KeyError 'step'), its state in that optimizer's own layout with Adam's step 1, the
        D4 diagnostics reading it, then one step on both (losses reported, steps judged)."""
        from megatron_gtpo.checkpoint.store import load_checkpoint, save_checkpoint
        from megatron_gtpo.train import optim_state
        from megatron_gtpo.train.diagnostics import adam_step, small_v_fraction

        saved, fresh = (build_policy(self.cfg, self.hf, self.dims, use_te=False, distributed_optimizer=True)
                        for _ in range(2))
        try:
            inner = saved.optimizer.optimizer
            rules = optim_state.adam_rules(inner)
            if rules is None:
                raise SmokeFailure(f"Megatron built {type(inner).__name__}: no Adam state rules for it")
            first = gtpo_train_step(saved, self.batch, self.settings, self.dims)
            save_checkpoint(self.workdir / "optim", step=1, model_chunks=saved.chunks, optimizer=saved.optimizer,
                            extra_state={}, keep_last=1)
            load_checkpoint(self.workdir / "optim", model_chunks=fresh.chunks, optimizer=fresh.optimizer, step=1)
            keys = _state_keys(fresh.optimizer.optimizer, rules)
            loaded, before = adam_step(fresh.optimizer), adam_step(saved.optimizer)
            small_v = small_v_fraction(fresh.optimizer)
            losses = [gtpo_train_step(p, self.batch, self.settings, self.dims)["loss"] for p in (saved, fresh)]
            steps = [adam_step(p.optimizer).step for p in (saved, fresh)]
        finally:
            del saved, fresh
            gc.collect()  # DDP hooks form reference cycles
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        if loaded is None or (loaded.step, before.step) != (1, 1) or steps != [2, 2]:
            raise SmokeFailure(f"Adam's step after the load {loaded and loaded.step} (saved {before.step}), after one "
                               f"more step {steps}: expected 1, 1 and [2, 2]")
        return {"optimizer": f"{type(inner).__module__}.{type(inner).__qualname__}", "rules": rules.name,
                "step_in": "per parameter" if rules.step_per_param else "param group", "state_keys": keys,
                "loss_step1": first["loss"], "adam_norm_saved": before.norm, "adam_norm_loaded": loaded.norm,
                "small_v_fraction": small_v, "loss_step2": losses[0], "loss_step2_resumed": losses[1],
                "abs_loss_resumed_vs_uninterrupted": abs(losses[0] - losses[1])}

    def part_offload(self) -> dict:
        """``rollout.offload_trainer`` (train/offload.py) on this device, distributed optimizer, after a
        step: the bytes an offload frees must reach the driver (``mem_get_info``, what vLLM and the
        engine-start check read: issue 33's N1a), the state must come back bit for bit, and a step must
        run on it. On CPU the driver's free memory is not measured (reported as None)."""
        from megatron_gtpo.train.offload import TrainerOffload

        policy = build_policy(self.cfg, self.hf, self.dims, use_te=False, distributed_optimizer=True)
        cuda = torch.cuda.is_available()
        try:
            gtpo_train_step(policy, self.batch, self.settings, self.dims)
            offload = TrainerOffload(policy.chunks, policy.optimizer)
            state = [t.clone() for s in policy.optimizer.optimizer.state.values() for t in s.values()
                     if torch.is_tensor(t) and t.numel() > 1]
            held, free = offload.nbytes, torch.cuda.mem_get_info()[0] if cuda else None
            offload.offload()
            freed = torch.cuda.mem_get_info()[0] - free if cuda else None
            offload.reload()
            after = [t for s in policy.optimizer.optimizer.state.values() for t in s.values()
                     if torch.is_tensor(t) and t.numel() > 1]
            exact = len(state) == len(after) and all(torch.equal(a, b) for a, b in zip(state, after))
            loss = gtpo_train_step(policy, self.batch, self.settings, self.dims)["loss"]
        finally:
            del policy
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
        if not exact or not math.isfinite(loss) or (cuda and freed < 0.8 * held):
            raise SmokeFailure(f"offload: {held} bytes held, {freed} reached the driver, state exact {exact}, "
                               f"loss after reload {loss}")
        return {"offload_bytes": held, "driver_free_gain_bytes": freed, "state_restored_exactly": exact,
                "loss_after_reload": loss}

    def hf_dir(self) -> Path:
        """A folder holding only the model's ``config.json`` (what WeightSpec and vLLM read)."""
        path = self.workdir / "hf"
        if not (path / "config.json").is_file():
            path.mkdir(parents=True, exist_ok=True)
            (path / "config.json").write_text(json.dumps(self.hf, indent=1))
        return path

    def part_export(self) -> dict:
        """Streams every HF tensor (``Exporter``, full mode: what a colocated engine of TP=1 gets);
        checks the plan against the HF model's names and shapes, the stream against the plan, and
        the sizes against Megatron."""
        from megatron_gtpo.sync.export import Exporter
        from megatron_gtpo.train.model import unwrap

        params = dict(unwrap(self.local.chunks[0]).named_parameters())
        exporter = Exporter(self.local.chunks, hf_config=self.hf, dims=self.dims)
        metas = exporter.metas("full")
        dtype = params["embedding.word_embeddings.weight"].dtype
        checked = importlib.util.find_spec("transformers") is not None
        if checked:
            from megatron_gtpo.sync.checks import WeightSpec, check_plan

            check_plan(WeightSpec.from_model_dir(self.hf_dir(), dtype=dtype), metas, version=1)
        counts = {"tensors": 0, "bytes": 0, "numel": 0}
        embed_equal = None

        def drain():
            nonlocal embed_equal
            from megatron_gtpo.sync.checks import checked_stream

            for name, tensor in checked_stream(exporter.tensors("full"), metas, dtype=dtype):
                counts["tensors"] += 1
                counts["bytes"] += tensor.nbytes
                counts["numel"] += tensor.numel()
                if name == "model.embed_tokens.weight":
                    embed_equal = torch.equal(tensor, params["embedding.word_embeddings.weight"])

        _, seconds = _timed(drain)
        megatron_numel = sum(p.numel() for p in params.values())
        if counts["numel"] != megatron_numel or not embed_equal:
            raise SmokeFailure(f"export holds {counts['numel']} elements, the model {megatron_numel}; "
                               f"embedding equal: {embed_equal}")
        return {**counts, "gb_per_s": round(counts["bytes"] / seconds / 1e9, 3),
                "checked_against_hf": checked, **self._pack_memory()}

    def _pack_memory(self) -> dict:
        """The rollout pool's sender path (``Exporter.pack``) into one device buffer of 16 MiB
        buckets: its peak extra memory must stay within one bucket plus the largest tensor."""
        from megatron_gtpo.sync.export import Exporter
        from megatron_gtpo.utils.memory import PeakMemory

        exporter = Exporter(self.local.chunks, hf_config=self.hf, dims=self.dims)
        plan = exporter.buckets(16 << 20)
        largest = max(m.numel * torch.empty((), dtype=getattr(torch, m.dtype.removeprefix("torch."))).element_size()
                      for b in plan for m in b.tensors)
        with PeakMemory() as peak:
            buffer = torch.empty(max(b.nbytes for b in plan), dtype=torch.uint8, device=self.device)
            for bucket in plan:
                exporter.pack(bucket, buffer)
            del buffer
        bound = max(b.nbytes for b in plan) + largest
        if peak.extra_bytes > bound + (1 << 20):
            raise SmokeFailure(f"packing {len(plan)} buckets peaked {peak.extra_bytes} bytes above the start, "
                               f"over one bucket + the largest tensor = {bound}")
        return {"pack_buckets": len(plan), "pack_peak_extra_mb": round(peak.extra_bytes / 2**20, 1),
                "pack_bound_mb": round(bound / 2**20, 1)}

    def part_te_bf16(self) -> dict:
        return self._te_part(overrides=None)

    def part_te_fp8(self) -> dict:
        overrides = {"fp8": "hybrid", "fp8_recipe": self.cfg.fp8_recipe}
        if self.cfg.fp8_recipe == "delayed":
            overrides.update(fp8_amax_history_len=16, fp8_amax_compute_algo="max")
        return self._te_part(overrides=overrides)

    def _te_part(self, *, overrides: dict | None) -> dict:
        """TE-spec model with the step-1 weights: log-probs and one step against the local model's."""
        from megatron_gtpo.checkpoint.store import load_model_weights

        policy = build_policy(self.cfg, self.hf, self.dims, use_te=True, overrides=overrides)
        try:
            load_model_weights(policy.chunks, self.step1["dir"])
            if overrides:  # first FP8 pass: delayed scaling has no amax history yet
                token_stats(policy.chunks, self.batch, self.settings, self.dims)
            stats = token_stats(policy.chunks, self.batch, self.settings, self.dims)
            metrics, seconds = _timed(lambda: gtpo_train_step(policy, self.batch, self.settings, self.dims))
        finally:
            del policy
            gc.collect()  # DDP hooks form reference cycles
            torch.cuda.empty_cache()
        if not math.isfinite(metrics["loss"]):
            raise SmokeFailure(f"non-finite loss {metrics['loss']}")
        mask = self.batch.mask
        logp_max, logp_mean = _masked_abs(stats.logp, self.stats_local.logp, mask)
        _, ent_mean = _masked_abs(stats.entropy, self.stats_local.entropy, mask)
        return {"loss": metrics["loss"], "loss_local": self.losses[1],
                "abs_loss_vs_local": abs(metrics["loss"] - self.losses[1]),
                "logp_abs_max_vs_local": logp_max, "logp_abs_mean_vs_local": logp_mean,
                "entropy_abs_mean_vs_local": ent_mean, "grad_norm": metrics["optim/grad_norm"],
                "step_s": round(seconds, 4)}

    def part_te_packed(self) -> dict:
        """Packed micro-batches in Megatron's THD format (train/model_input.py: PackedSeqParams into
        TE attention) on the TE spec with the step-1 weights, against the same model's padded
        micro-batches: log-probs and one train step's loss and grad norm (bf16: reported, not judged)."""
        from megatron_gtpo.checkpoint.store import load_model_weights
        from megatron_gtpo.train.batching import row_tokens
        from megatron_gtpo.train.model_input import uses_te_attention
        from megatron_gtpo.train.step import rank_micro_batches

        budget = 2 * int(row_tokens(self.batch).max())  # two of the longest rows: 2-4 rows per packed row
        packed = dataclasses.replace(self.settings, micro_batch_tokens=budget)
        policy = build_policy(self.cfg, self.hf, self.dims, use_te=True)
        try:
            if not uses_te_attention(policy.chunks[0]):
                raise SmokeFailure("the TE-spec model does not use TEDotProductAttention: THD is not exercised")
            out = {}
            for name, settings in (("padded", self.settings), ("packed", packed)):
                load_model_weights(policy.chunks, self.step1["dir"])
                stats = token_stats(policy.chunks, self.batch, settings, self.dims)
                metrics = gtpo_train_step(policy, self.batch, settings, self.dims)
                out[name] = (stats, metrics, len(rank_micro_batches(self.batch, settings, self.dims)[1]))
        finally:
            del policy
            gc.collect()
            torch.cuda.empty_cache()
        (stats, metrics, count), (ref, ref_metrics, ref_count) = out["packed"], out["padded"]
        if not (math.isfinite(metrics["loss"]) and math.isfinite(metrics["optim/grad_norm"])):
            raise SmokeFailure(f"packed step: loss {metrics['loss']}, grad norm {metrics['optim/grad_norm']}")
        logp_max, logp_mean = _masked_abs(stats.logp, ref.logp, self.batch.mask)
        return {"budget": budget, "micro_batches": count, "micro_batches_padded": ref_count,
                "loss": metrics["loss"], "loss_padded": ref_metrics["loss"],
                "grad_norm": metrics["optim/grad_norm"], "grad_norm_padded": ref_metrics["optim/grad_norm"],
                "logp_abs_max_vs_padded": logp_max, "logp_abs_mean_vs_padded": logp_mean}

    def part_vllm(self) -> dict:
        """Exported weights into an in-process vLLM engine through the driver's weight-sync call
        (``WeightSync.sync``: export + checks + push), then greedy tokens against Megatron's."""
        from megatron_gtpo.rollout import RolloutEngine
        from megatron_gtpo.rollout.config import Sampling
        from megatron_gtpo.sync import ColocatedSync, ExportPlan
        from megatron_gtpo.types import Prompt

        engine = RolloutEngine(model_dir=str(self.hf_dir()), seed=self.cfg.seed, vllm_kwargs=self._vllm_kwargs())
        try:
            sync = ColocatedSync(engine, ExportPlan(hf_config=self.hf, dims=self.dims, bucket_bytes=64 << 20))
            push = sync.sync(self.local.chunks, version=1)
            itemsize = torch.empty((), dtype=engine.dtype).element_size()
            prompts = [Prompt(uid=f"p{i}", token_ids=self.batch.prompt_ids[i * self.cfg.group, :8].tolist())
                       for i in range(2)]
            got = engine.generate(prompts, Sampling(n=1, temperature=0.0, max_tokens=16))
        finally:
            engine.close()
        push_bytes, want_bytes = round(push["sync/gigabytes"] * 1e9), itemsize * param_count(self.hf)
        if push["sync/version"] != 1 or [c.weight_version for c in got] != [1, 1] or push_bytes != want_bytes:
            raise SmokeFailure(f"push reports version {push['sync/version']} and {push_bytes} bytes (the model "
                               f"has {want_bytes} in the engine dtype), the engine serves "
                               f"{[c.weight_version for c in got]}; expected version 1 everywhere and every byte")
        greedy = greedy_against_megatron(
            [c.token_ids for c in got],
            next_token_logits(self.local.chunks, [p.token_ids + list(c.token_ids) for p, c in zip(prompts, got)],
                              self.dims, vocab_size=self.cfg.vocab), [len(p.token_ids) for p in prompts])
        if greedy["logit_gap_max"] > NEAR_TIE * greedy["logit_spread_min"]:
            raise SmokeFailure(f"vLLM's greedy tokens are not Megatron's: at one position Megatron's best logit "
                               f"is {greedy['logit_gap_max']:.4f} above that of vLLM's token, more than {NEAR_TIE} "
                               f"of the smallest top-to-median spread ({greedy['logit_spread_min']:.4f}): "
                               f"the engine serves other weights than the trainer's")
        return {"push_s": round(push["sync/seconds"], 3), "push_bytes": push_bytes, **greedy,
                "greedy_vllm": [list(c.token_ids) for c in got]}

    def _vllm_kwargs(self) -> dict:
        """A small engine next to the trainer: dummy weights (the push brings the real ones), no
        tokenizer, eager mode, 1 GiB of KV cache. vLLM refuses to start unless ``gpu_memory_utilization``
        of the whole card is free, even with ``kv_cache_memory_bytes`` set, so it asks for half of
        what is free now (the trainer's model and optimizer stay resident)."""
        kwargs = {"dtype": "bfloat16", "load_format": "dummy", "skip_tokenizer_init": True,
                  "max_model_len": self.cfg.seq, "enforce_eager": True}
        if self.cfg.device != "cuda":
            return {**kwargs, "kv_cache_memory_bytes": 64 << 20}
        gc.collect()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        return {**kwargs, "kv_cache_memory_bytes": 1 << 30, "gpu_memory_utilization": round(0.5 * free / total, 3)}
