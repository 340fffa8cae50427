"""Checkpoint manifests on real Megatron saves (2 gloo ranks): each kind of damage to the newest
step is reported naming the file, and the previous intact step is restored instead."""

from __future__ import annotations

import pytest

from tests.helpers import REPO, torchrun

SCRIPT = REPO / "tests/dist/scripts/ckpt_manifest.py"
# The damage done to step 3 of a copy (see the script) -> what the warning must say about which file.
EXPECTED = {
    "truncate": "step_00000003/__1_0.distcp: truncated: ",
    "delete_common": "step_00000003/common.pt: missing",
    "delete_metadata": "step_00000003/.metadata: missing",
    "flip_bytes": "step_00000003/__0_0.distcp: corrupt content: sha256 ",
    "no_manifest": "step_00000003/manifest.json: missing",
}


def _extra(step):
    return {"cursor": {"epoch": 0, "index": step * 4}, "run_id": "run-42"}


def _one(results, mode, rank=0, **match):
    found = [r for r in results if r["mode"] == mode and r["rank"] == rank
             and all(r.get(k) == v for k, v in match.items())]
    assert len(found) == 1, (mode, rank, match, results)
    return found[0]


@pytest.mark.slow
def test_damaged_newest_checkpoint_falls_back_to_the_previous_one(tmp_path):
    results = torchrun(SCRIPT, 2, str(tmp_path))
    saved = _one(results, "saved")
    assert saved["problems"] == [[], [], []]
    committed = [line for line in saved["logs"] if "committed" in line]
    # 2 ranks x 2 shard files, .metadata, metadata.json, common.pt
    assert len(committed) == 3 and all("7 files" in line and "sha256 in" in line for line in committed), saved["logs"]
    assert any(line.startswith("INFO checkpoint: saving step 1 into ") for line in saved["logs"])
    prints = saved["prints"]
    assert prints["2"] != prints["3"]

    for kind, expected in EXPECTED.items():
        for rank in (0, 1):
            r = _one(results, "fallback", rank, kind=kind)
            assert r["step"] == 2 and r["extra"] == _extra(2), r
            # The weights are step 2's (a fresh model with other weights was loaded into).
            assert r["print"] == pytest.approx(prints["2"], rel=1e-12), (kind, r["print"], prints)
            assert len(r["skipped"]) == 1 and expected in r["skipped"][0], r
        warnings = [line for line in _one(results, "fallback", 0, kind=kind)["logs"] if line.startswith("WARNING")]
        assert len(warnings) == 2, warnings
        assert "step_00000003 is unusable: " in warnings[0] and expected in warnings[0], warnings
        assert "resuming from " in warnings[1] and "step_00000002, the newest intact checkpoint" in warnings[1]
        assert not [x for x in _one(results, "fallback", 1, kind=kind)["logs"] if x.startswith("WARNING")]

    for rank in (0, 1):
        load = _one(results, "load", rank)
        assert load["step"] == 2, load
        assert load["error"].startswith("checkpoint ") and EXPECTED["truncate"] in load["error"], load
        resaved = _one(results, "resaved", rank)
        # Step 3 saved again over the damaged one; keep_last=2 dropped step 1; step 2 (intact) stays.
        assert resaved["kept"] == ["step_00000002", "step_00000003"] and resaved["problems"] == [], resaved
        assert resaved["print"] == pytest.approx(prints["3"], rel=1e-12)  # fp32 CPU: same trajectory

        bad = _one(results, "all_bad", rank)["errors"]
        assert bad["require"].startswith("--resume: no usable checkpoint in run dir ") and "all_bad" in bad["require"]
        for step in (1, 2, 3):
            assert f"step_0000000{step}/__1_0.distcp: truncated" in bad["require"], bad
        assert bad["auto"].startswith("--resume=auto: no usable checkpoint"), bad

        stale = _one(results, "stale", rank)
        assert stale["step"] == 3 and stale["left"] == ["step_00000001", "step_00000002", "step_00000003"], stale
        assert stale["preempted"] is False
        assert _one(results, "fresh", rank)["point"] is None
    stale_logs = _one(results, "stale")["logs"]
    assert any(".tmp_step_00000004, left over by an interrupted save" in line for line in stale_logs), stale_logs
    assert any("PREEMPTED: the run continues" in line for line in stale_logs), stale_logs
    assert any("--resume=auto: no checkpoint under" in line for line in _one(results, "fresh")["logs"])
