"""bench/gpu_smoke.py without a GPU: ``--dry`` as CI runs it (the real script, in a subprocess), the
argument checks, and the synthetic batch and model-size helpers the GPU run relies on."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.gpu_smoke_setup import (PARTS, TINY, SmokeConfig, absent_reason, hf_config, param_count, step_settings,
                                   synthetic_batch)
from megatron_gtpo.utils.configuration import ConfigError

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "gpu_smoke.py"


def smoke(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)


def installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def test_dry_prints_the_plan_and_exits_0(tmp_path):
    proc = smoke("--dry", "--json-out", str(tmp_path / "plan.json"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == json.loads((tmp_path / "plan.json").read_text())
    te, vllm = installed("transformer_engine"), installed("vllm")
    want = [p for p in PARTS if (te or not p.startswith("te_")) and (vllm or p != "vllm")]
    assert result["dry"] is True and result["would_run"] == want
    assert set(result["would_skip"]) == set(PARTS) - set(want)
    for part in result["would_skip"]:
        assert f"SKIP {part}:" in proc.stdout
    # the default GPU size: Megatron's config and the batch are built, not just echoed
    assert result["megatron"] == {"num_layers": 8, "hidden_size": 1024, "ffn_hidden_size": 4096,
                                  "num_query_groups": 4, "kv_channels": 64}
    assert result["model_params"] == param_count(hf_config(SmokeConfig()))
    assert result["batch"]["rows"] == 32 and result["batch"]["seq"] == 1024 and result["batch"]["groups"] == 8
    assert result["batch"]["completion_width"] == 1024 - 128
    assert result["batch"]["micro_batch_shapes"] == [[4, 1024]]  # every model input is [micro_batch, seq]
    assert result["algo"] == {"name": "gtpo", "agg_mode": "seq-mean-token-mean", "mu": 1, "entropy_threshold": 777.0}


def test_bad_arguments_exit_2_naming_the_field(capsys):
    from bench import gpu_smoke

    with pytest.raises(SystemExit) as exc:
        gpu_smoke.main(["--dry", "--rows", "30"])
    assert exc.value.code == 2
    assert "rows=30" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gpu_smoke.main(["--dry", "--skip", "vllm,nope"])
    assert "skip='nope'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gpu_smoke.main(["--dry", "--heads", "16", "--kv-heads", "3"])
    assert "num_key_value_heads=3" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only answer")
def test_without_cuda_the_real_run_refuses_and_points_to_dry(capsys):
    from bench import gpu_smoke

    assert gpu_smoke.main(["--tiny"]) == 2
    assert "--dry" in capsys.readouterr().err


def test_a_missing_workdir_is_refused_before_any_work(capsys, tmp_path):
    from bench import gpu_smoke

    assert gpu_smoke.main(["--tiny", "--device", "cpu", "--workdir", str(tmp_path / "absent")]) == 2
    assert "--workdir" in capsys.readouterr().err


def test_greedy_check_tells_a_flipped_near_tie_from_other_weights():
    """The vllm part's judgement (bench/gpu_smoke_parts.py): vLLM's greedy tokens against Megatron's
    logits of the same sequences. A near-tie flipped by rounding passes; tokens chosen by other
    weights (what a failed or partial push serves) do not."""
    from bench.gpu_smoke_parts import NEAR_TIE, greedy_against_megatron

    gen = torch.Generator().manual_seed(0)
    logits = [torch.randn(12, 50, generator=gen) for _ in range(2)]  # prompts of 4, 8 generated tokens
    best = [lg[3:11].argmax(dim=-1).tolist() for lg in logits]
    same = greedy_against_megatron(best, logits, [4, 4])
    assert same["greedy_tokens_agreeing"] == [8, 8] and same["logit_gap_max"] == 0.0

    flipped = [best[0][:], best[1]]
    runner_up = int(logits[0][3 + 5].topk(2).indices[1])
    logits[0][3 + 5, runner_up] = logits[0][3 + 5].max() - 1e-3  # a near-tie at position 5, vLLM took the other
    flipped[0][5] = runner_up
    near = greedy_against_megatron(flipped, logits, [4, 4])
    assert near["greedy_tokens_agreeing"] == [5, 8] and 0 < near["logit_gap_max"] <= NEAR_TIE * near["logit_spread_min"]

    other = [torch.randn(12, 50, generator=gen) for _ in range(2)]  # the engine's own, unrelated weights
    wrong = greedy_against_megatron([lg[3:11].argmax(dim=-1).tolist() for lg in other], logits, [4, 4])
    assert wrong["logit_gap_max"] > NEAR_TIE * wrong["logit_spread_min"], wrong


def test_tiny_dry_uses_the_tiny_sizes_and_honours_skip(capsys):
    from bench import gpu_smoke

    assert gpu_smoke.main(["--dry", "--tiny", "--skip", "export,vllm"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert {k: result["config"][k] for k in TINY} == TINY
    assert result["would_skip"]["export"] == result["would_skip"]["vllm"] == "left out with --skip"
    assert "export" not in result["would_run"] and "local" in result["would_run"]


@pytest.mark.parametrize("bad", [dict(rows=30), dict(micro_batch=3), dict(steps=1), dict(seq=100),
                                 dict(hidden=100), dict(shared_prefix=224), dict(device="tpu"),
                                 dict(fp8_recipe="mxfp8"), dict(skip=("nope",))])
def test_config_rejects(bad):
    field = next(iter(bad))
    with pytest.raises(ConfigError, match=field):
        SmokeConfig(**bad)


def test_absent_reason_skip_and_missing_packages():
    cfg = SmokeConfig(skip=("vllm",))
    assert absent_reason("vllm", cfg, dry=True) == "left out with --skip"
    assert absent_reason("local", cfg, dry=True) is None
    want = None if installed("transformer_engine") else "transformer_engine is not installed"
    assert absent_reason("te_fp8", cfg, dry=True) == want
    assert "needs CUDA" in absent_reason("te_bf16", SmokeConfig(device="cpu"), dry=False)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_synthetic_batch_has_groups_conflicts_and_full_length_micro_batches(device):
    from megatron_gtpo import algo
    from megatron_gtpo.train.batching import micro_batches

    cfg = SmokeConfig(**TINY, device=device)
    settings = step_settings(cfg)
    assert settings.pad_to_multiple == (16 if device == "cuda" else 1)  # FP8 tensorwise at TP=1 (padding_multiple)
    batch = synthetic_batch(cfg)
    assert (batch.prompt_lengths == cfg.seq // 8).all() and batch.token_ids.shape == (cfg.rows, cfg.seq - cfg.seq // 8)
    for g in range(cfg.rows // cfg.group):
        rows = slice(g * cfg.group, (g + 1) * cfg.group)
        assert (batch.prompt_ids[rows] == batch.prompt_ids[rows][0]).all()  # one prompt per group
        assert (batch.group_ids[rows] == g).all()
        assert set(batch.rewards[rows].tolist()) == {0.0, 1.0}
    last = batch.token_ids.gather(1, (batch.lengths - 1)[:, None])[:, 0]
    assert (last == hf_config(cfg)["eos_token_id"]).all()
    assert (batch.token_ids[~batch.mask] == batch.pad_id).all()
    assert (batch.sampler_logprobs[batch.mask] == -1.0).all() and (batch.sampler_logprobs[~batch.mask] == 0).all()
    # every micro-batch's model input is cut to the full sequence (FP8 needs multiples of 16)
    mbs = micro_batches(batch, slice(None), micro_batch_size=cfg.micro_batch, common_length=False,
                        pad_to_multiple=settings.pad_to_multiple)
    assert len(mbs) == cfg.rows // cfg.micro_batch
    assert {tuple(mb.input_ids.shape) for mb in mbs} == {(cfg.micro_batch, cfg.seq)}
    prepared = algo.prepare_batch(settings.spec, token_ids=batch.token_ids, mask=batch.mask, rewards=batch.rewards,
                                  group_ids=batch.group_ids, mean_entropy=torch.full((cfg.rows,), 10.0))
    assert (prepared.runs.fwd >= cfg.shared_prefix).all() and (prepared.runs.bwd >= 1).all()
    assert (prepared.delta == 1).all()  # threshold 777: even <H>_i = 10 nats passes the entropy filter


@pytest.mark.parametrize("sizes", [TINY, {}])
def test_param_count_matches_the_hf_model(sizes):
    import transformers

    hf = hf_config(SmokeConfig(**sizes))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**hf))
    assert param_count(hf) == sum(p.numel() for p in model.parameters())
