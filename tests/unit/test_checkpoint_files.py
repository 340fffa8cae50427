"""Checkpoint folder integrity without torch: manifests, corrupt-step fallback, the resume decision,
stale-save cleanup, pruning that keeps the last intact step, and the launcher's fast refusal."""

from __future__ import annotations

import hashlib
import json
import logging
import time

import pytest

from megatron_gtpo.checkpoint import files as cf
from megatron_gtpo.checkpoint.files import CheckpointError


def fake_step(root, step, *, files=None):
    """A committed step dir with shard-like files and a manifest, as save_checkpoint leaves it."""
    files = files or {"common.pt": b"common" * 10, ".metadata": b"meta" * 50, "__0_0.distcp": bytes(range(256)) * 40,
                      "__1_0.distcp": b"\x07" * 3000, "metadata.json": b"{}"}
    directory = cf.step_dir(root, step)
    directory.mkdir(parents=True)
    for name, data in files.items():
        (directory / name).write_bytes(data)
    cf.write_manifest(directory, step, cf.hash_files(directory, cf.list_files(directory)))
    return directory


def test_manifest_lists_every_file_with_size_and_sha256(tmp_path):
    directory = fake_step(tmp_path, 5)
    body = json.loads((directory / "manifest.json").read_text())
    assert body["step"] == 5 and body["hash"] == "sha256"
    assert set(body["files"]) == {"common.pt", ".metadata", "__0_0.distcp", "__1_0.distcp", "metadata.json"}
    data = (directory / "__0_0.distcp").read_bytes()
    assert body["files"]["__0_0.distcp"] == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert cf.verify(directory, checksums=True) == []


@pytest.mark.parametrize("damage, expected", [
    ("truncate", "__0_0.distcp: truncated: 5000 bytes, the manifest says 10240"),
    ("delete_common", "common.pt: missing"),
    ("delete_shard", "__1_0.distcp: missing"),
    ("delete_manifest", "manifest.json: missing"),
    ("garbage_manifest", "manifest.json: unreadable"),
    ("append", "__1_0.distcp: longer than saved: 3001 bytes"),
])
def test_size_problems_name_the_file(tmp_path, damage, expected):
    directory = fake_step(tmp_path, 7)
    shard = directory / "__0_0.distcp"
    if damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:5000])
    elif damage == "delete_common":
        (directory / "common.pt").unlink()
    elif damage == "delete_shard":
        (directory / "__1_0.distcp").unlink()
    elif damage == "delete_manifest":
        (directory / "manifest.json").unlink()
    elif damage == "garbage_manifest":
        (directory / "manifest.json").write_text('{"files": ')
    else:
        with open(directory / "__1_0.distcp", "ab") as handle:
            handle.write(b"x")
    for checksums in (False, True):  # sizes are always checked
        problems = cf.verify(directory, checksums=checksums)
        assert len(problems) == 1 and expected in problems[0] and str(directory) in problems[0], problems


def test_flipped_bytes_are_found_by_the_checksum_only(tmp_path):
    directory = fake_step(tmp_path, 7)
    shard = directory / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[4000] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert cf.verify(directory, checksums=False) == []
    (problem,) = cf.verify(directory, checksums=True)
    assert f"{shard}: corrupt content: sha256" in problem


def test_manifest_without_a_required_file_is_unusable(tmp_path):
    directory = fake_step(tmp_path, 2, files={".metadata": b"m", "__0_0.distcp": b"x" * 10})
    (problem,) = cf.verify(directory, checksums=True)
    assert "common.pt: not listed in manifest.json" in problem


def test_select_falls_back_to_the_previous_intact_step_with_a_warning(tmp_path, caplog):
    fake_step(tmp_path, 1)
    fake_step(tmp_path, 2)
    bad = fake_step(tmp_path, 3)
    (bad / "common.pt").unlink()
    with caplog.at_level(logging.WARNING, logger="megatron_gtpo"):
        point, problems = cf.select(cf.step_dirs(tmp_path), lambda p: cf.verify(p, checksums=True))
    assert point.step == 2 and point.path == cf.step_dir(tmp_path, 2)
    assert point.skipped == (f"{bad / 'common.pt'}: missing",) and problems == list(point.skipped)
    assert f"checkpoint {bad} is unusable: {bad / 'common.pt'}: missing" in caplog.text


def _corrupt_all(root):
    for _, path in cf.step_dirs(root):
        (path / "common.pt").unlink()


def test_resume_require_without_checkpoints_names_the_run_dir_and_the_fix(tmp_path):
    run_dir = tmp_path / "run"
    with pytest.raises(CheckpointError) as err:
        cf.check_resume(run_dir, True)
    message = str(err.value)
    assert f"run dir {run_dir}" in message and f"{run_dir / 'checkpoints'} does not exist" in message
    assert "without --resume" in message and "--resume=auto" in message
    (run_dir / "checkpoints").mkdir(parents=True)
    with pytest.raises(CheckpointError, match="holds no step_\\* checkpoint"):
        cf.check_resume(run_dir, "require")


def test_resume_auto_starts_fresh_only_without_any_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    assert cf.check_resume(run_dir, "auto") is None
    fake_step(run_dir / "checkpoints", 4)
    assert cf.check_resume(run_dir, "auto").step == 4
    _corrupt_all(run_dir / "checkpoints")
    with pytest.raises(CheckpointError, match="--resume=auto: no usable checkpoint .* every checkpoint is unusable: "
                                              ".*step_00000004/common.pt: missing"):
        cf.check_resume(run_dir, "auto")


def test_resume_require_skips_a_truncated_newest_step(tmp_path):
    root = tmp_path / "run" / "checkpoints"
    fake_step(root, 4)
    shard = fake_step(root, 6) / "__1_0.distcp"
    shard.write_bytes(b"\x07" * 10)
    point = cf.check_resume(tmp_path / "run", "require")
    assert point.step == 4 and point.skipped == (f"{shard}: truncated: 10 bytes, the manifest says 3000",)


def test_fresh_start_over_existing_checkpoints_is_refused(tmp_path):
    run_dir = tmp_path / "run"
    assert cf.check_resume(run_dir, False) is None
    (run_dir / "checkpoints" / ".tmp_step_00000001").mkdir(parents=True)  # no committed step: fine
    assert cf.check_resume(run_dir, "off") is None
    fake_step(run_dir / "checkpoints", 3)
    with pytest.raises(CheckpointError, match="already holds checkpoints \\(newest: step_00000003\\).*--resume"):
        cf.check_resume(run_dir, "off")


def test_resolve_mode_and_cli_options():
    import argparse

    assert [cf.resolve_mode(v) for v in (True, "require", "auto", False, "off")] == \
        ["require", "require", "auto", "off", "off"]
    with pytest.raises(ValueError, match="resume='yes'"):
        cf.resolve_mode("yes")
    parser = argparse.ArgumentParser()
    parser.add_argument("rest", nargs="*")
    cf.add_resume_options(parser)
    assert parser.parse_args([]).resume == "off"
    # ``--resume key=value``: the override stays an override.
    assert vars(parser.parse_args(["--resume", "a.b=1"])) == {"rest": ["a.b=1"], "resume": "require"}
    assert parser.parse_args(["--resume=auto", "a.b=1"]).resume == "auto"


def test_clean_stale_removes_interrupted_saves_with_a_log_line(tmp_path, caplog):
    fake_step(tmp_path, 2)
    for name in (".tmp_step_00000003", ".old_step_00000002"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__0_0.distcp").write_bytes(b"partial")
    (tmp_path / ".tmp_unrelated").mkdir()
    with caplog.at_level(logging.INFO, logger="megatron_gtpo"):
        removed = cf.clean_stale(tmp_path)
    assert [p.name for p in removed] == [".old_step_00000002", ".tmp_step_00000003"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp_unrelated", "step_00000002"]
    assert f"removed {tmp_path / '.tmp_step_00000003'}, left over by an interrupted save" in caplog.text
    assert cf.clean_stale(tmp_path / "missing") == []


def test_pruning_never_counts_a_corrupt_step(tmp_path):
    # Resumed from step 2 over a corrupt step 3, saved step 4 (keep_last=2): the corrupt step goes, step 2 stays.
    for step in (1, 2, 3, 4):
        fake_step(tmp_path, step)
    (cf.step_dir(tmp_path, 3) / "__0_0.distcp").write_bytes(b"short")
    assert [p.name for p in cf.prunable(tmp_path, saved=4, keep_last=2)] == ["step_00000003", "step_00000001"]
    # A corrupt step newer than the one just saved (resumed from 2, saved 3; 5 is corrupt) is
    # neither kept in place of a good one nor deleted (its step is saved again later).
    for step in (5,):
        fake_step(tmp_path, step)
    (cf.step_dir(tmp_path, 5) / "common.pt").unlink()
    assert [p.name for p in cf.prunable(tmp_path, saved=4, keep_last=1)] == \
        ["step_00000003", "step_00000002", "step_00000001"]


def test_share_of_splits_every_file_exactly_once():
    files = {f"__{i}_0.distcp": cf.FileRecord(size=s, digest="") for i, s in enumerate([90, 10, 50, 50, 5, 0, 70])}
    for world in (1, 2, 3, 8):
        parts = [cf.share_of(files, rank, world) for rank in range(world)]
        names = [n for part in parts for n in part]
        assert sorted(names) == sorted(files)
    loads = [sum(r.size for r in cf.share_of(files, rank, 2).values()) for rank in range(2)]
    assert max(loads) - min(loads) <= 10


def test_preempted_marker_is_written_and_cleared(tmp_path, caplog):
    cf.mark_preempted(tmp_path, 7)
    assert (tmp_path / "PREEMPTED").read_text() == "7\n"
    with caplog.at_level(logging.INFO, logger="megatron_gtpo"):
        cf.clear_preempted(tmp_path)
        cf.clear_preempted(tmp_path)  # already gone: nothing to do
    assert not (tmp_path / "PREEMPTED").exists() and caplog.text.count("PREEMPTED") == 1


def test_launcher_refuses_resume_without_checkpoints_in_seconds(tmp_path, capsys, monkeypatch):
    """``megatron-gtpo train --resume`` over a run dir whose checkpoints are gone: exit 2 before
    any rank starts, the run's config.yaml and run_id untouched."""
    from megatron_gtpo.cli import train as train_cli
    from tests.helpers import REPO

    monkeypatch.chdir(REPO)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "run_id").write_text("abc123\n")
    (run_dir / "config.yaml").write_text("old: config\n")
    start = time.perf_counter()
    code = train_cli.main(["configs/tiny.yaml", "--output-dir", str(run_dir), "--resume", "train.steps=3"])
    elapsed = time.perf_counter() - start
    err = capsys.readouterr().err
    assert code == 2 and "--resume: no usable checkpoint in run dir" in err and str(run_dir) in err, err
    assert elapsed < 3, elapsed  # no torch import, no rank, no engine
    assert (run_dir / "run_id").read_text() == "abc123\n" and (run_dir / "config.yaml").read_text() == "old: config\n"
