"""The trainer ranks' control plane carries data, not pickles (issue #34, S5), on 2 real gloo ranks
(tests/dist/scripts/control_data.py). The encoding itself: tests/unit/test_security_control_objects.py;
that the package calls no object collective: tests/unit/test_security_sweep.py."""

from __future__ import annotations

from tests.helpers import REPO, torchrun

SCRIPT = REPO / "tests/dist/scripts/control_data.py"


def test_security_control_plane_round_trips_data_and_refuses_a_pickle_from_a_peer(tmp_path):
    """Every payload kind the package sends arrives equal on both ranks, through a broadcast and an
    all-gather. A pickle sent on the control group in the control plane's framing (what a process
    in a peer's place could send) is refused by rank 1 and runs nothing. Injected:
    ``control.broadcast_data`` on ``dist.broadcast_object_list`` again -> rank 1 unpickles it, the
    marker file appears and the test fails."""
    results = torchrun(SCRIPT, 2, str(tmp_path))
    trips = [r for r in results if r["check"] == "round_trip"]
    assert len(trips) == 2 * 19 and all(r["broadcast"] and r["gathered"] for r in trips), \
        [r for r in trips if not (r["broadcast"] and r["gathered"])]
    outcome = {r["rank"]: r for r in results if r["check"] == "pickle"}
    assert outcome[1]["outcome"].startswith("refused:"), outcome
    assert not (tmp_path / "ran").exists() and not any(r["ran"] for r in outcome.values()), outcome
