"""CPU shims that let megatron-core 0.16.1 run on a CPU-only torch with gloo.

Every shim here replaces one CUDA assumption inside megatron-core. They are installed once per
process by :func:`install`, and only when ``torch.cuda.is_available()`` is False: on a GPU machine
this module does nothing and Megatron runs untouched. Each shim's docstring names the CUDA
assumption it replaces; with all of them in place TP/PP/VPP, DDP, the distributed
optimizer and dist-checkpointing give the same fp32 numbers as a single-process reference.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

_INSTALLED = False

ACCELERATOR = torch.device("cpu")
"""What ``torch.cuda.current_device()`` and ``collectives.comm_device()`` return on a CPU build: a
CPU device like any other, but one fixed object, so strict mode (strict.py) can tell by identity
that a tensor placed on it stands for a device tensor."""


def is_cuda_device(device) -> bool:
    """True for ``"cuda"``, ``"cuda:0"``, ``torch.device("cuda")`` and bare ints (cuda:<i>)."""
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


class CudaToCpuMode(TorchFunctionMode):
    """Redirects ``device="cuda"``, ``.cuda()`` and ``.to("cuda")`` to CPU and makes
    ``Tensor.type()`` answer ``torch.cuda.*``.

    On CUDA, Megatron's schedules, grad-norm/clip helpers and dist-checkpointing allocate small
    scratch tensors with a hard-coded ``device="cuda"``; its mixed-precision and distributed
    optimizers dispatch on ``param.type() == "torch.cuda.FloatTensor"``. Safe because on a CPU
    build every tensor lives on CPU anyway: the redirect only restores what the code means, and
    the faked type string is read by Megatron's dispatch alone (torch never parses it). Pinned
    host memory (``pin_memory=True``, which a CPU build cannot allocate) becomes plain host memory:
    Megatron pins only staging tensors for a non-blocking copy to the GPU (e.g. the chunk indices of
    context-parallel RoPE, ``rope_utils.get_pos_emb_on_this_cp_rank``), and on CPU there is no copy.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        if "device" in kwargs and is_cuda_device(kwargs["device"]):
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to and len(args) > 1 and is_cuda_device(args[1]):
            args = (args[0], "cpu") + tuple(args[2:])
        return func(*args, **kwargs)


class _NullEvent:
    """Stands in for ``torch.cuda.Event``: CPU ops are synchronous, so every wait is a no-op."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, *args, **kwargs):
        pass

    def wait(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


class _NullStream(_NullEvent):
    """Stands in for ``torch.cuda.Stream``: Megatron only orders work with it, CPU needs no ordering."""

    def wait_event(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def record_event(self, event=None):
        return event or _NullEvent()


def _install_torch_cuda_stubs() -> None:
    """``torch.cuda.current_device`` -> cpu (RoPE buffers, global memory buffer, TP gathers);
    ``synchronize`` and streams become no-ops (batched p2p, checkpoint D2H copies, DDP)."""
    torch.cuda.current_device = lambda: ACCELERATOR
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_stream = lambda *a, **k: _NullStream()
    torch.cuda.default_stream = lambda *a, **k: _NullStream()
    torch.cuda.Stream, torch.cuda.Event = _NullStream, _NullEvent
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()


def _install_causal_mask() -> None:
    """Megatron builds the default causal mask with ``device="cuda"`` when ``attention_mask`` is
    None; the CPU version is the same boolean upper triangle (True = masked)."""
    import megatron.core.fusions.fused_softmax as fused_softmax

    fused_softmax.get_default_causal_mask = lambda sq: torch.triu(
        torch.ones(sq, sq, dtype=torch.bool), diagonal=1
    )


def install_rng_tracker(seed: int) -> None:
    """Replaces ``tensor_parallel.model_parallel_cuda_manual_seed``.

    Megatron forks a CUDA RNG state for dropout (even p=0) and saves/restores it around activation
    recompute. Here each named state is a CPU generator state, seeded exactly as Megatron seeds the
    CUDA ones (model-parallel seed offset 2718 + TP rank), so recompute stays bit-identical.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as mrandom

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_ or name in self.states_:
                raise RuntimeError(f"RNG state {name!r} / seed {seed} already added")
            self.seeds_.add(seed)
            saved = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(saved)

        @contextlib.contextmanager
        def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            saved = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(saved)

    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    tracker = CpuRNGStatesTracker()
    mrandom._CUDA_RNG_STATE_TRACKER = tracker
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    torch.manual_seed(seed)
    tracker.add(mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + ps.get_tensor_model_parallel_rank())
    tracker.add(
        mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME,
        seed + 1024 + 100 * ps.get_expert_model_parallel_rank() + ps.get_expert_tensor_parallel_rank(),
    )


def install(*, device_mode: bool = True) -> bool:
    """Installs the process-wide shims (idempotent). Returns True when they were needed.

    Call after ``torch.distributed.init_process_group`` and before building Megatron models; then
    call :func:`install_rng_tracker` after ``parallel_state.initialize_model_parallel``.
    ``device_mode=False`` leaves the device redirect to strict mode's own torch-function mode
    (``strict.install``, a subclass of :class:`CudaToCpuMode`).
    """
    global _INSTALLED
    if torch.cuda.is_available():
        return False
    if not _INSTALLED:
        _install_torch_cuda_stubs()
        if device_mode:
            CudaToCpuMode().__enter__()  # stays active for the life of the process
        _install_causal_mask()
        _INSTALLED = True
    return True
