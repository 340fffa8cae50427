"""bench/gpu_smoke.py run for real on CPU (gloo, ``--tiny``): the same calls the GPU run makes (train
step API, checkpoint save/load, exporter, fused log-probs), so a change that breaks the smoke fails
here and not first on a GPU. Transformer Engine needs CUDA and is skipped; vLLM is left out to keep
CI short (its push path is covered by test_sync_megatron.py and test_rollout_engine.py)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def test_gpu_smoke_runs_on_cpu(tmp_path):
    out = tmp_path / "smoke.json"
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "bench/gpu_smoke.py", "--device", "cpu", "--tiny", "--skip", "vllm",
                           "--workdir", str(tmp_path), "--json-out", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    parts = result["parts"]
    assert result["ok"] and result["ran"] == ["logprob", "local", "checkpoint", "export"], result
    assert "needs CUDA" in result["skipped"]["te_bf16"] and "needs CUDA" in result["skipped"]["te_fp8"]
    assert "SKIP te_bf16:" in proc.stdout and "SKIP vllm: left out with --skip" in proc.stdout

    local = parts["local"]
    assert len(local["losses"]) == 2 and all(math.isfinite(x) for x in local["losses"])
    assert local["conflict_tokens_per_completion"] >= 4 + 1  # --tiny: shared prefix of 4, then EOS

    ckpt = parts["checkpoint"]
    assert ckpt["params_changed_since_save"] > 0
    assert ckpt["params_restored_exactly"] == 15  # every parameter of the 2-layer model
    assert ckpt["abs_loss_vs_step2"] < 1e-6  # gloo/CPU is deterministic: the repeated step 2 is step 2

    export = parts["export"]
    assert export["checked_against_hf"] and export["numel"] == local["model_params"]
    assert parts["logprob"]["logp_abs_max"] < 1e-4
    assert not list(tmp_path.glob("gpu-smoke-*"))  # the temporary checkpoint folder was removed
