"""This process's resident set and its peak (utils/runtime.py), as the converter reports them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from megatron_gtpo.utils.runtime import host_peak_rss_bytes, host_rss_bytes, reset_host_peak_rss
from tests.helpers import REPO, leave_freed_resident_heap, resident_block

CHILD = """
import json, resource
from megatron_gtpo.utils.runtime import host_peak_rss_bytes, reset_host_peak_rss
inherited = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
before = reset_host_peak_rss()
print(json.dumps({"ru_maxrss": inherited, "before": before, "peak": host_peak_rss_bytes()}))
"""


def test_peak_follows_an_allocation_and_resets():
    pin = leave_freed_resident_heap(200)  # a long test process's heap: must not hide the block
    before = reset_host_peak_rss()
    block = resident_block(128 * 2**20)
    assert host_peak_rss_bytes() - before >= 120 * 2**20
    block.close()
    now = reset_host_peak_rss()
    assert host_peak_rss_bytes() - now < 16 * 2**20 and abs(host_rss_bytes() - now) < 16 * 2**20
    del pin


def test_a_child_of_a_large_parent_measures_its_own_peak():
    """Linux carries ru_maxrss over fork + exec (why the converter's stats once showed the pytest
    process's size, after tests/dist had grown it): the reset peak is the child's own."""
    block = bytearray(512 * 2**20)
    block[::4096] = b"\x01" * len(block[::4096])
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, cwd=REPO, timeout=120,
                         env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}, check=True).stdout
    child = json.loads(out)
    del block
    assert child["ru_maxrss"] >= 500 * 2**20  # the kernel's carried-over figure: the parent's size
    assert child["peak"] - child["before"] < 32 * 2**20 and child["peak"] < 300 * 2**20, child


def test_peak_of_another_process_is_its_own():
    """What bench/memory_meter.py reads for the reward workers and other children of a rank."""
    child = subprocess.Popen([sys.executable, "-c", "b = bytearray(64 * 2**20); b[::4096] = b'1' * len(b[::4096]); "
                              "print('ok', flush=True); input()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    try:
        assert child.stdout.readline().strip() == "ok"
        assert 64 * 2**20 <= host_peak_rss_bytes(child.pid) < 160 * 2**20  # the block + a bare interpreter
    finally:
        child.communicate("\n", timeout=60)
    with pytest.raises(OSError):
        host_peak_rss_bytes(child.pid)  # reaped: gone
