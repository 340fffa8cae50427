"""Memory in use and its peak, on GPU (the CUDA allocator) or CPU (the resident set), and
giving cached memory back.

:class:`PeakMemory` measures the extra memory of a block (the push): the CUDA allocator's peak on
GPU; on CPU the process's peak resident set (``VmHWM``, reset through ``/proc/self/clear_refs``
when the block starts), which counts every allocation the block touches, ours and vLLM's.
"""

from __future__ import annotations

import functools

import torch

from megatron_gtpo.utils.runtime import host_peak_rss_bytes, host_rss_bytes, reset_host_peak_rss


class PeakMemory:
    """``with PeakMemory() as peak: ...`` then ``peak.extra_bytes``: the block's peak memory above
    what was in use when it started (see the module docstring for what is counted on CPU/GPU).
    ``peak.before`` is the peak of the process (since the last reset) up to the block's start, read
    before the block resets it, so a caller that meters consecutive blocks still gets the whole
    run's peak."""

    def __enter__(self) -> PeakMemory:
        self.extra_bytes = 0
        self.before = peak_bytes()
        reset_peak()
        self._base = in_use_bytes()
        return self

    def __exit__(self, *exc) -> None:
        self.extra_bytes = peak_bytes() - self._base

    @property
    def peak(self) -> int:
        """The block's own peak (absolute bytes in use), after it ended."""
        return self._base + self.extra_bytes


def release_cached_memory() -> None:
    """Gives the memory the allocator keeps free back: CUDA's cache on GPU, glibc's heap on CPU."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    else:
        release_host_memory()


def release_host_memory() -> int:
    """Hands the memory the C allocator holds free back to the OS (glibc ``malloc_trim(0)``) and
    returns the bytes the resident set shrank by; 0 where there is no glibc.

    On CPU a train step's activations (a few MB each: below glibc's mmap threshold, which grows to
    32 MB once large blocks were freed) live in the heap; freed, they stay in the process. Measured
    with bench/memory.py (SmolLM2-135M, micro-batches of 2 x ~320 tokens): 1.6-1.9 GB held after
    the second and third train steps, all of it returned by this call (live tensors unchanged). The
    CPU counterpart of ``torch.cuda.empty_cache()``: the next step faults the pages back in
    (well under a second per GB)."""
    trim = _malloc_trim()
    if trim is None:
        return 0
    before = in_use_bytes()
    trim(0)
    return max(before - in_use_bytes(), 0)


@functools.cache  # find_library runs ldconfig in a subprocess (~3 ms): once, not at every push
def _malloc_trim():
    import ctypes
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (macOS, musl)
        return None


def in_use_bytes() -> int:
    """Memory in use now: tensors allocated on the GPU (CUDA), else the resident set (``VmRSS``)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated()
    return host_rss_bytes()


def peak_bytes() -> int:
    """The peak of :func:`in_use_bytes` since the last :func:`reset_peak` (or the process start)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()
    return host_peak_rss_bytes()


def reset_peak() -> None:
    """Restarts :func:`peak_bytes` from what is in use now."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    else:
        reset_host_peak_rss()
