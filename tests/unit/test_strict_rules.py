"""The rule strict device groups enforce (parallel/strict.py predicted_error), as measured on an
H200 with bench/gpu_nccl_rules.py (docs/gpu.md): NCCL refuses host tensors for every op; gloo is
allowed device tensors only for broadcast and all_reduce (conservative: torch 2.11's gloo accepted
them for the other ops too, in a world of one)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from megatron_gtpo.parallel.strict import predicted_error
from tests.helpers import REPO

OPS = ("all_reduce", "broadcast", "all_gather_into_tensor", "all_gather", "reduce_scatter_tensor", "reduce", "gather")


@pytest.mark.parametrize("op", OPS)
def test_nccl_refuses_host_tensors_and_takes_device_ones(op):
    assert predicted_error(op, group_kind="device", host=True)
    assert not predicted_error(op, group_kind="device", host=False)


@pytest.mark.parametrize("op", OPS)
def test_gloo_takes_host_tensors_and_device_ones_only_for_broadcast_and_all_reduce(op):
    assert not predicted_error(op, group_kind="host", host=True)
    assert predicted_error(op, group_kind="host", host=False) == (op not in ("broadcast", "all_reduce"))


def test_unclassified_groups_are_never_refused():  # vLLM's own groups and ones made before install
    assert not predicted_error("all_reduce", group_kind=None, host=True)


def test_gpu_rules_bench_has_help_and_refuses_to_run_without_cuda():
    ok = subprocess.run([sys.executable, str(REPO / "bench/gpu_nccl_rules.py"), "--help"], capture_output=True, text=True)
    assert ok.returncode == 0 and "strict device groups" in ok.stdout
    no_gpu = subprocess.run([sys.executable, str(REPO / "bench/gpu_nccl_rules.py")], capture_output=True, text=True)
    assert no_gpu.returncode == 2 and "needs CUDA" in no_gpu.stderr
