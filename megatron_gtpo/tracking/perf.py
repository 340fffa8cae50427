"""The denominator of MFU: a device's peak FLOP rate (``perf.peak_tflops``), and the train phase's work.

    PerfConfig.peak_tflops --None--> detected: KNOWN_PEAKS by CUDA device name and precision,
                                     or on CPU a matmul probe (cpu_matmul_tflops)
    TrainWork(shape, updates, ..., peak).of(lengths) -> (tokens, FLOPs) of one train phase (models/flops.py)

``tracking.reporter.step_metrics`` turns these and the train phase's time into ``perf/*``.
Peaks are NVIDIA's datasheet figures for dense math (the datasheets print BF16/FP8 "with sparsity",
twice the dense rate; FP32 is the non-tensor-core rate that fp32 training without TF32 gets).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import torch

from megatron_gtpo.models.flops import train_phase_flops
from megatron_gtpo.models.shape import ModelShape
from megatron_gtpo.train.lora import adapter_params
from megatron_gtpo.utils.configuration import require

# Dense TFLOPS per GPU. Sources: NVIDIA H100 Tensor Core GPU datasheet (SXM / PCIe / NVL columns;
# FP32 67 / 51 / 60, BF16 1979 / 1513 / 1671 and FP8 3958 / 3026 / 3341 with sparsity) and the H200
# datasheet (SXM / NVL: FP32 67 / 60, BF16 1979 / 1671, FP8 3958 / 3341 with sparsity).
KNOWN_PEAKS: dict[str, dict[str, float]] = {
    "H200 NVL": {"fp32": 60.0, "bf16": 835.5, "fp8": 1670.5},
    "H200": {"fp32": 67.0, "bf16": 989.5, "fp8": 1979.0},
    "H100 NVL": {"fp32": 60.0, "bf16": 835.5, "fp8": 1670.5},
    "H100 PCIe": {"fp32": 51.0, "bf16": 756.5, "fp8": 1513.0},
    "H100": {"fp32": 67.0, "bf16": 989.5, "fp8": 1979.0},
}
"""Device-name marker -> precision -> dense peak TFLOPS. Matched in this order (the first marker the
CUDA device name contains): "NVIDIA H100 80GB HBM3" is the SXM part, "NVIDIA H100 PCIe" is not."""


@dataclass(kw_only=True)
class PerfConfig:
    """How MFU is computed (``perf/mfu``; the ``perf:`` block)."""

    peak_tflops: float | None = None
    """Peak dense TFLOPS of one trainer device in the training precision, the denominator of
    ``perf/mfu``. None: detected once at start, from the CUDA device name and the precision
    (``KNOWN_PEAKS``: H100 / H200 in FP32, BF16 and FP8), on CPU by a matmul probe of the
    model's dtype (a measured figure, noisy on a shared machine; set it to compare runs)."""

    plan_mfu: float = 0.4
    """The MFU the dry-run assumes to turn a step's FLOPs into expected train seconds and
    tokens/s/GPU (0.4: about what Megatron-LM reports for dense models on H100 in BF16)."""

    def __post_init__(self):
        require(self.peak_tflops is None or self.peak_tflops > 0, "peak_tflops", self.peak_tflops,
                "a number > 0, or null (detected)")
        require(0 < self.plan_mfu <= 1, "plan_mfu", self.plan_mfu, "a fraction 0 < x <= 1")


def precision_of(dtype: str, megatron: dict) -> str:
    """``fp8`` when ``model.megatron`` turns FP8 on, else ``bf16`` or ``fp32`` from ``model.dtype``."""
    if megatron.get("fp8"):
        return "fp8"
    return "bf16" if dtype == "bfloat16" else "fp32"


def known_peak(device_name: str, precision: str) -> float | None:
    """The datasheet peak of a device name (``torch.cuda.get_device_name``), None when unknown."""
    for marker, peaks in KNOWN_PEAKS.items():
        if marker in device_name:
            return peaks[precision]
    return None


def peak_tflops(config: PerfConfig, *, precision: str) -> tuple[float, str]:
    """The peak of this process's device and where it comes from (shown with the first step)."""
    if config.peak_tflops is not None:
        return config.peak_tflops, "perf.peak_tflops"
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        value = known_peak(name, precision)
        if value is None:
            raise ValueError(f"no known peak for {name!r} in {precision}: set perf.peak_tflops (its datasheet's dense "
                             "TFLOPS)")
        return value, f"{name} {precision} datasheet"
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    return cpu_matmul_tflops(dtype), f"CPU matmul probe ({dtype}, {torch.get_num_threads()} threads)"


@functools.lru_cache(maxsize=None)
def cpu_matmul_tflops(dtype: torch.dtype = torch.float32, *, size: int = 1024, repeats: int = 5) -> float:
    """This process's matmul rate on CPU in TFLOPS: the best of ``repeats`` square matmuls of
    ``size`` (2 size^3 FLOPs each) after one warm-up; measured once per process."""
    a = torch.randn(size, size, dtype=dtype)
    b = torch.randn(size, size, dtype=dtype)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * size ** 3 / best / 1e12


@dataclass(frozen=True, kw_only=True)
class TrainWork:
    """What one train phase computes per Batch, for ``perf/*``."""

    shape: ModelShape
    """The policy's shape."""
    updates: int
    """Forward + backward passes over the batch (``algo.mu``)."""
    forward_passes: int = 0
    """No-grad forwards over the batch (1 with a KL reference model)."""
    lora_params: int = 0
    """Adapter parameters (0: full fine-tuning)."""
    peak_tflops: float | None = None
    """One trainer device's peak (``peak_tflops``): the denominator of ``perf/mfu`` (None: no MFU)."""

    @classmethod
    def of_run(cls, shape: ModelShape, *, spec, lora, peak_tflops: float | None = None) -> TrainWork:
        """A run's train phase: ``spec.mu`` forward + backward passes, a no-grad forward when the KL
        reference is on, ``lora``'s adapters (``spec``: the resolved AlgoSpec; ``lora``: LoraConfig).
        The driver's ``perf/*`` and the dry-run's plan both count it here."""
        return cls(shape=shape, updates=spec.mu, forward_passes=int(spec.needs_reference),
                   lora_params=adapter_params(lora, shape), peak_tflops=peak_tflops)

    def of(self, prompt_lengths: torch.Tensor, completion_lengths: torch.Tensor) -> tuple[float, float]:
        """(tokens, model FLOPs) of a batch whose rows have these prompt and completion lengths [B]."""
        lengths = (prompt_lengths + completion_lengths).tolist()
        flops = train_phase_flops(self.shape, lengths, updates=self.updates, forward_passes=self.forward_passes,
                                  lora_params=self.lora_params)
        return float(sum(lengths)), flops
