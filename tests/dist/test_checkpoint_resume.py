"""Training checkpoints: atomic save, keep_last, resume at the same and at another DP size.

Three launches of tests/dist/scripts/ckpt_resume.py (Megatron DDP + distributed optimizer, fp32):
DP=2 reference + same-layout resume, DP=2 -> DP=1 resume (saving again), DP=1 -> DP=2 resume.
"""

from __future__ import annotations

import json

import pytest
import torch

from megatron_gtpo.cli.convert import main as convert_main
from megatron_gtpo.convert.hf_io import HFReader
from tests.helpers import REPO, torchrun
from tests.dist.scripts.ckpt_resume import model_config

SCRIPT = REPO / "tests/dist/scripts/ckpt_resume.py"


def _extra(step):
    return {"cursor": {"epoch": 0, "index": step * 4}, "run_id": "run-42"}


@pytest.mark.slow
def test_resume_matches_uninterrupted_run(tmp_path):
    first = torchrun(SCRIPT, 2, str(tmp_path), "train")
    ref = [r for r in first if r["mode"] == "reference"]
    assert len(ref) == 2 and ref[0]["losses"] == ref[1]["losses"]
    ref = ref[0]
    losses = ref["losses"]
    assert len(set(losses.values())) == 4  # training moves: a resume that restores nothing would differ
    # keep_last=2 pruned step 1; the leftover temp dir of a "crashed" save is never a step.
    assert ref["kept"] == [".tmp_step_00000009", "step_00000002", "step_00000003"] and ref["latest"] == 3
    assert ref["empty"] is None

    same = [r for r in first if r["mode"] == "same_layout"]
    dp1 = torchrun(SCRIPT, 1, str(tmp_path), "dp1")
    dp2 = torchrun(SCRIPT, 2, str(tmp_path), "dp2")
    refused = [r for r in dp2 if r["mode"] == "tp2"]
    dp2 = [r for r in dp2 if r["mode"] == "dp2_from_dp1"]
    assert len(same) == 2 and len(dp1) == 1 and len(dp2) == 2 and len(refused) == 2
    for r in refused:
        assert "'tp': 1" in r["error"] and "'tp': 2" in r["error"] and "same TP/PP/VPP" in r["error"], r
    for r in same + dp1:
        assert r["step"] == 2 and r["extra"] == _extra(2), r
        assert r["rand"] == ref["rand"], r  # RNG restored: the same draws as right after the save
        # fp32 on CPU: the resumed trajectory is the uninterrupted one, bit for bit (Adam step,
        # moments and main params restored; the DP size only changes how the batch is split).
        assert r["losses"] == {"3": losses["3"], "4": losses["4"]}, (r, losses)
    assert {r["dp"] for r in same} == {2} and dp1[0]["dp"] == 1
    for r in dp2:
        assert r["dp"] == 2 and r["step"] == 3 and r["extra"] == _extra(3), r
        assert r["losses"] == {"4": losses["4"]}, (r, losses)

    # A training step dir (model + distributed-optimizer state) exports straight to HF safetensors.
    config_dir = tmp_path / "config"
    config_dir.mkdir()
    (config_dir / "config.json").write_text(json.dumps(model_config()))
    assert convert_main(["--to", "hf", "--input", str(tmp_path / "b" / "step_00000003"),
                         "--hf-config", str(config_dir), "--output", str(tmp_path / "hf")]) == 0
    exported = HFReader(tmp_path / "hf")
    assert len(exported.names()) == 51 and "lm_head.weight" in exported.names()
    assert exported.shape("model.layers.3.self_attn.k_proj.weight") == [32, 64]
    assert torch.isfinite(exported.get("model.layers.0.mlp.up_proj.weight")).all()
