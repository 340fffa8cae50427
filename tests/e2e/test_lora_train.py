"""LoRA through the whole stack from the CLI (issue 25): ``megatron-gtpo train configs/tiny.yaml
model.lora.rank=8`` with real torchrun ranks, colocated vLLM engines and MLflow (the shared run
``run_lora``): adapters on a frozen base, merged weights pushed into vLLM after every step, adapter-only
checkpoints that resume bit-exact, and the exports (``convert --to peft`` loaded by the real ``peft``
onto the HF base, ``--to hf`` merged) giving the same logits."""

from __future__ import annotations

import json
import shutil

import peft
import torch

from megatron_gtpo.checkpoint.adapters import saved_lora
from megatron_gtpo.checkpoint.files import step_dir
from megatron_gtpo.cli import convert
from tests.e2e.runs import LORA, LORA_STEPS, history, per_step, train

STEPS = LORA_STEPS
TRAJECTORY = ("entropy/mean", "optim/grad_norm", "reward/mean", "completion/length_mean", "loss",
              "mismatch/logprob_abs_mean", "mismatch/logprob_abs_max")


def test_lora_run_trains_adapters_and_the_engine_samples_from_the_merged_weights(run_lora):
    """Bugs caught: the push sending the frozen base (the engine would sample from the initial
    policy while the trainer scores with adapters: the engine-vs-trainer log-prob gap grows from
    step 2 on), the adapters not training, the base being trained (the log line and gradients)."""
    out, text = run_lora.out, run_lora.log
    assert "LoRA: 8 adapters of rank 8 (alpha/r = 2)" in text and "the base is frozen" in text, text[-3000:]
    assert all(g > 0 for g in per_step(out, "optim/grad_norm", STEPS))
    entropy = per_step(out, "entropy/mean", STEPS)
    assert abs(entropy[2] - entropy[0]) > 1e-3, entropy  # the adapters move the policy the engine samples from
    # What the engine sampled with vs what the trainer computes for the same tokens, every step:
    assert max(per_step(out, "mismatch/logprob_abs_max", STEPS)) < 1e-4
    assert max(per_step(out, "mismatch/logprob_abs_mean", STEPS)) < 1e-5


def test_lora_checkpoints_hold_the_adapters_and_the_base_identity_only(run_lora):
    from torch.distributed.checkpoint import FileSystemReader

    step = step_dir(run_lora.out / "checkpoints", STEPS)
    record = saved_lora(step)
    assert record["config"]["rank"] == 8 and record["config"]["alpha"] == 16.0
    base = record["base"]
    assert len(base["sha256"]) == 64 and base["files"] == 1
    keys = list(FileSystemReader(str(step)).read_metadata().state_dict_metadata)
    model_keys = [k for k in keys if not k.startswith(("optimizer.", "rng_state"))]
    assert model_keys and all(".lora." in k for k in model_keys), model_keys
    size = sum(p.stat().st_size for p in step.iterdir())
    assert size < base["bytes"], (size, base["bytes"])  # adapters + their Adam state (0.6 MB), not the 1.3 MB base


def test_lora_resume_continues_the_same_trajectory(run_lora, tmp_path):
    """Bugs caught: a LoRA resume that re-initialises the adapters, loses their Adam moments, or
    loads the base from the checkpoint (each changes entropy, grad norm or rewards at step 3)."""
    out = shutil.copytree(run_lora.out, tmp_path / "resumed")
    shutil.rmtree(step_dir(out / "checkpoints", STEPS))
    text = train(out, *LORA, "--resume", steps=STEPS).log
    assert f"resumed from step {STEPS - 1}" in text and f"step {STEPS}/{STEPS} |" in text, text[-3000:]
    for key in TRAJECTORY:
        expected, got = dict(history(run_lora.out, key)), history(out, key)
        assert [s for s, _ in got] == list(range(1, STEPS + 1)), (key, got)
        assert all(value == expected[s] for s, value in got), (key, got, expected)


def _logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def test_lora_exported_adapter_loads_in_peft_with_the_merged_models_logits(run_lora, tmp_path):
    """``convert --to peft`` and ``--to hf`` of the last checkpoint: the real ``peft`` library puts
    the adapter onto the HF base; its logits equal the merged export's, which differ from the base's."""
    import transformers

    step = step_dir(run_lora.out / "checkpoints", STEPS)
    adapter, merged = tmp_path / "adapter", tmp_path / "merged"
    assert convert.main(["--to", "peft", "--input", str(step), "--output", str(adapter)]) == 0
    assert convert.main(["--to", "hf", "--input", str(step), "--output", str(merged)]) == 0
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["lora_alpha"] == 16 and len(config["target_modules"]) == 7
    base_dir = saved_lora(step)["base"]["path"]
    load = transformers.AutoModelForCausalLM.from_pretrained
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    base = load(base_dir, dtype=torch.float32).eval()
    base_logits = _logits(base, ids)
    peft_logits = _logits(peft.PeftModel.from_pretrained(base, str(adapter)).eval(), ids)
    merged_logits = _logits(load(merged, dtype=torch.float32).eval(), ids)
    torch.testing.assert_close(peft_logits, merged_logits, rtol=0, atol=1e-5)
    assert (merged_logits - base_logits).abs().max() > 1e-3  # the trained adapters are in both
