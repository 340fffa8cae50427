"""Strict device groups (parallel/strict.py), the control plane (parallel/control.py) and
``parallel.timeout_s``, in gloo worlds of 1 and 2 ranks (tests/dist/scripts/strict_groups.py).

``torchrun`` (tests/helpers.py) turns strict mode on by default, so every multi-rank test runs
with it; the one launch here with it off shows that plain gloo accepts the bug patterns, which is
why strict mode exists.
"""

from __future__ import annotations

import pytest

from megatron_gtpo.parallel.strict import ENV
from tests.helpers import REPO, torchrun

SCRIPT = REPO / "tests/dist/scripts/strict_groups.py"

# What NCCL on a GPU would refuse (or what the project's control-plane rule forbids)
MUST_RAISE = {
    "host_allreduce_default",  # parallel/objects.py::any_rank before this change: torch.tensor([1.0]) on WORLD
    "broadcast_object_list_tp",  # a pickle through a device group
    "all_gather_object_default",
    "host_allreduce_tp",
    "host_after_cuda_copy",  # .cuda() returns a device copy; the original stays on the host
    "cpu_of_device",
    "host_derived",
    "device_all_gather_on_control",  # gloo takes GPU tensors only for broadcast/all_reduce
}


def _by_check(records: list[dict], nproc: int) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in records:
        out.setdefault(r["check"], []).append(r)
    assert all(len(v) == nproc for v in out.values()), {k: len(v) for k, v in out.items()}
    return out


@pytest.mark.parametrize("nproc", [1, 2])
def test_strict_mode_refuses_host_data_on_device_groups(nproc):
    checks = _by_check(torchrun(SCRIPT, nproc, "checks"), nproc)
    assert len(checks) == 23
    assert all(r["value"] is True for r in checks.pop("strict_active"))
    for name, results in checks.items():
        for r in results:
            if name in MUST_RAISE:
                assert not r["ok"] and r["error"].startswith("strict device groups:"), (name, r)
            else:
                assert r["ok"], (name, r)
    last, ranks = nproc - 1, list(range(nproc))
    values = {name: results[0]["value"] for name, results in checks.items()}
    assert all(r["value"] == values[name] for name, results in checks.items() for r in results)
    assert values["control_any_rank"] is True
    assert values["control_broadcast_data"] == {"rank": last}
    assert values["control_all_gather_data"] == ranks
    assert values["control_reduce_floats"] == [[0.0, -last], [last, 0.0], [sum(ranks), -sum(ranks)]]
    assert values["control_twin_dp"] == [1.0]  # TP = world: DP groups of one rank
    assert values["device_allreduce_tp"] == [nproc] * 3
    assert values["host_allreduce_gloo"] == [2.0 * nproc]


def test_plain_gloo_accepts_the_bug_patterns():
    checks = _by_check(torchrun(SCRIPT, 1, "checks", env={ENV: "0"}), 1)
    assert checks.pop("strict_active")[0]["value"] is False
    assert all(r["ok"] for results in checks.values() for r in results), checks


def test_timeout_applies_to_default_control_and_megatron_groups():
    """parallel.timeout_s = 3: a collective that one rank enters alone fails after ~3 s on every
    kind of group (the default would wait 30 min)."""
    records = {r["check"]: r for r in torchrun(SCRIPT, 2, "timeout") if r["rank"] == 1}
    assert set(records) == {"timeout_default", "timeout_control", "timeout_megatron_tp"}
    for r in records.values():
        assert not r["ok"] and "Timed out" in r["error"], r
        assert 2.5 <= r["value"] < 30, r
