"""Model FLOPs (models/flops.py) against hand counts, the datasheet peaks and the ``perf/*`` metrics.

The formula is PaLM's (Chowdhery et al. 2022, Appendix B): 6 N + 12 L d S FLOPs per trained token,
N the weights a token meets in a matmul, L layers, d = heads x head_dim, S the sequence length.
"""

from __future__ import annotations

import pytest
import torch

from megatron_gtpo.models.flops import matmul_params, sequence_flops, train_phase_flops
from megatron_gtpo.models.shape import ModelShape
from megatron_gtpo.tracking.perf import PerfConfig, TrainWork, known_peak, peak_tflops, precision_of
from megatron_gtpo.tracking.reporter import step_metrics
from megatron_gtpo.utils.configuration import ConfigError

SMOLLM2 = ModelShape(name="SmolLM2-135M", family="llama", layers=30, hidden=576, ffn=1536, heads=9, kv_heads=3,
                     head_dim=64, vocab=49152, tied_embeddings=True, qkv_bias=False, qk_norm=False,
                     max_positions=8192)
MOE = ModelShape(name="moe", family="qwen3_moe", layers=2, hidden=64, ffn=0, heads=4, kv_heads=2, head_dim=16,
                 vocab=128, tied_embeddings=False, qkv_bias=False, qk_norm=True, max_positions=512, experts=4,
                 top_k=2, expert_ffn=32)


def test_smollm2_flops_per_token_match_a_hand_count():
    """SmolLM2-135M by hand. Per layer: q 576x576, k and v 576x192 each, o 576x576 -> 884,736;
    SwiGLU 3 x 576 x 1536 = 2,654,208; x 30 layers = 106,168,320; the (tied) output layer
    49152 x 576 = 28,311,552; N = 134,479,872. At S = 275: 6N = 806,879,232 and attention
    12 x 30 x 576 x 275 = 57,024,000, so 863,903,232 FLOPs per token.
    Injected bug caught: the attention term left out (6N alone), or counted with the KV width."""
    assert matmul_params(SMOLLM2) == 134_479_872
    assert sequence_flops(SMOLLM2, 275) / 275 == 863_903_232
    # N is every parameter except the norms (30 x 2 x 576 + 576): no matmul touches those
    assert matmul_params(SMOLLM2) == SMOLLM2.params_total() - (30 * 2 * 576 + 576)


def test_moe_counts_the_routed_top_k_experts_only():
    """A token meets top_k = 2 of the 4 experts (and the 4 x 64 router). Per layer: attention
    64 x (64 + 2 x 32) + 64 x 64 = 12,288; router 256; two experts 2 x 3 x 64 x 32 = 12,288; x 2 layers
    = 49,664; output layer 128 x 64 = 8,192; N = 57,856. Injected bug caught: every expert counted."""
    assert matmul_params(MOE) == 57_856


def test_lora_base_has_no_weight_gradient():
    """Frozen base: forward 2N + backward's activation gradient 2N = 4N per token; the adapters
    6 each; attention unchanged. Injected bug caught: 6N kept for the frozen base."""
    n, s, lora = matmul_params(SMOLLM2), 100, 1000
    attention = 12 * 30 * 576 * s
    assert sequence_flops(SMOLLM2, s, lora_params=lora) == (4 * n + 6 * lora) * s + attention * s
    assert sequence_flops(SMOLLM2, s) == 6 * n * s + attention * s


def test_train_phase_sums_attention_per_sequence_and_counts_passes():
    """Attention grows with each sequence's own length (100^2 + 300^2, not 2 x 200^2); mu updates
    and a reference forward (2N + a third of the training attention term) add up.
    Injected bug caught: the reference forward counted as a full training pass."""
    n, per_layer = matmul_params(SMOLLM2), 12 * 30 * 576
    one = 6 * n * 400 + per_layer * (100 ** 2 + 300 ** 2)
    assert train_phase_flops(SMOLLM2, [100, 300]) == one
    assert train_phase_flops(SMOLLM2, [100, 300]) != train_phase_flops(SMOLLM2, [200, 200])
    forward = 2 * n * 400 + per_layer // 3 * (100 ** 2 + 300 ** 2)
    assert train_phase_flops(SMOLLM2, [100, 300], updates=2, forward_passes=1) == 2 * one + forward


def test_train_work_counts_prompt_and_completion_tokens():
    work = TrainWork(shape=SMOLLM2, updates=1)
    tokens, flops = work.of(torch.tensor([20, 30]), torch.tensor([80, 270]))
    assert tokens == 400 and flops == train_phase_flops(SMOLLM2, [100, 300])


def test_known_peaks_from_device_names():
    """NVIDIA datasheets, dense (half the 'with sparsity' figures). Injected bug caught: 'H100'
    matched before 'H100 PCIe' (the PCIe part would get the SXM peak)."""
    assert known_peak("NVIDIA H100 80GB HBM3", "bf16") == 989.5
    assert known_peak("NVIDIA H100 80GB HBM3", "fp8") == 1979.0
    assert known_peak("NVIDIA H100 PCIe", "bf16") == 756.5
    assert known_peak("NVIDIA H100 NVL", "fp8") == 1670.5
    assert known_peak("NVIDIA H200", "bf16") == 989.5
    assert known_peak("NVIDIA H200 NVL", "bf16") == 835.5
    assert known_peak("NVIDIA A100-SXM4-80GB", "bf16") is None
    assert precision_of("bfloat16", {}) == "bf16" and precision_of("float32", {}) == "fp32"
    assert precision_of("bfloat16", {"fp8": "hybrid"}) == "fp8"


def test_peak_is_configured_or_measured():
    assert peak_tflops(PerfConfig(peak_tflops=123.0), precision="bf16") == (123.0, "perf.peak_tflops")
    if not torch.cuda.is_available():
        value, source = peak_tflops(PerfConfig(), precision="fp32")
        assert value > 0 and source.startswith("CPU matmul probe")
    with pytest.raises(ConfigError):
        PerfConfig(peak_tflops=0.0)


def test_perf_metrics_divide_by_the_train_phase_time_and_the_gpus():
    """perf/* are the train phase's: tokens and FLOPs over time/train_s, per GPU, MFU against the
    peak. Injected bug caught: divided by the whole step's time (time/step_s)."""
    times = {"rollout": 6.0, "reward": 1.0, "train": 2.0, "sync": 1.0, "step": 10.0}
    out = step_metrics({}, times=times, completion_tokens=300.0, gpus=4, work=(800.0, 8e12), peak_tflops=0.5)
    assert out["perf/tokens_per_s"] == 400.0
    assert out["perf/tokens_per_gpu_s"] == 100.0
    assert out["perf/tflops_per_gpu"] == 1.0
    assert out["perf/mfu"] == 2.0
    assert out["throughput/tokens_per_gpu_s"] == 7.5  # completion tokens over the step, unchanged
    assert "perf/mfu" not in step_metrics({}, times=times, completion_tokens=1.0)
