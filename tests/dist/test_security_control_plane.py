"""The trainer ranks' control plane carries data, not pickles (issue #34, S5), on 2 real gloo ranks
(tests/dist/scripts/control_data.py). The encoding itself: tests/unit/test_security_control_objects.py;
that the package calls no object collective: tests/unit/test_security_sweep.py."""

from __future__ import annotations

import pytest

from tests.helpers import REPO, torchrun

SCRIPT = REPO / "tests/dist/scripts/control_data.py"


@pytest.fixture(scope="module")
def ckpt_results(tmp_path_factory):
    """One 2-rank launch for both tests (its checks run in sequence)."""
    marker_dir = tmp_path_factory.mktemp("markers")
    return torchrun(SCRIPT, 2, str(marker_dir)), marker_dir


def test_security_control_plane_round_trips_data_and_refuses_a_pickle_from_a_peer(ckpt_results):
    """Every payload kind the package sends arrives equal on both ranks, through a broadcast and an
    all-gather. A pickle sent on the control group in the control plane's framing (what a process
    in a peer's place could send) is refused by rank 1 and runs nothing. Injected:
    ``control.broadcast_data`` on ``dist.broadcast_object_list`` again -> rank 1 unpickles it, the
    marker file appears and the test fails."""
    results, tmp_path = ckpt_results
    trips = [r for r in results if r["check"] == "round_trip"]
    assert len(trips) == 2 * 19 and all(r["broadcast"] and r["gathered"] for r in trips), \
        [r for r in trips if not (r["broadcast"] and r["gathered"])]
    outcome = {r["rank"]: r for r in results if r["check"] == "pickle"}
    assert outcome[1]["outcome"].startswith("refused:"), outcome
    assert not (tmp_path / "ran").exists() and not any(r["ran"] for r in outcome.values()), outcome


def test_security_checkpoint_object_collectives_build_data_and_refuse_code(ckpt_results):
    """The object collectives that Megatron's and torch's distributed checkpointing still call
    (pickles over the same gloo pairs) go through the guarded unpickler (parallel/unpickle.py): a
    checkpoint plan and a bf16 tensor arrive equal; a pickle that would create a file is refused
    by rank 1 with an UnpicklingError naming what it called, and the file never appears. Injected:
    ``unpickle.install()`` taken out of ``init_distributed`` -> rank 1 "accepted", ``ran2``
    created, the test fails."""
    results, marker_dir = ckpt_results
    assert [r["equal"] for r in results if r["check"] == "plan"] == [True, True], results
    outcome = {r["rank"]: r for r in results if r["check"] == "object_collective"}
    assert outcome[1]["outcome"].startswith("refused: refused to unpickle pathlib"), outcome
    assert not (marker_dir / "ran2").exists() and not any(r["ran"] for r in outcome.values()), outcome
