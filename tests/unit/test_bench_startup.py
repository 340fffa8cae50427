"""bench/startup.py's variants and ratios without starting a run (``run`` replaced by a stand-in):
what ``--against`` and ``--only`` select, and that a ratio is printed only when both of its
variants ran. The real runs are measurements, recorded in docs/performance.md."""

from __future__ import annotations

import json

import pytest

from bench import startup


def fake_runs(monkeypatch) -> list[tuple[str, str]]:
    calls = []
    seconds = {"fork": 10.0, "torchrun": 20.0, "fork_store_migrated": 12.5, "against": 11.0}

    def run(out, variant, *, repo=startup.REPO):
        calls.append((variant, repo))
        return {"startup_s": seconds[variant], "first_step_s": seconds[variant] + 2, "peak_rss_gib": 0.8,
                "wall_s": seconds[variant] + 3}

    monkeypatch.setattr(startup, "run", run)
    return calls


def last_json(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_against_runs_the_other_checkout_beside_fork(monkeypatch, capsys, tmp_path):
    calls = fake_runs(monkeypatch)
    assert startup.main(["--repeats", "2", "--against", str(tmp_path), "--only", "fork,against",
                         "--out", str(tmp_path / "out")]) == 0
    assert calls == [("fork", startup.REPO), ("against", str(tmp_path))] * 2  # alternating, each its own checkout
    got = last_json(capsys)
    assert got["fork_over_against"] == pytest.approx(10 / 11, abs=1e-3)
    assert "fork_over_torchrun" not in got and "copied_over_migrated_store" not in got


def test_all_variants_give_every_ratio(monkeypatch, capsys, tmp_path):
    calls = fake_runs(monkeypatch)
    assert startup.main(["--repeats", "1", "--out", str(tmp_path)]) == 0
    assert [v for v, _ in calls] == ["fork_store_migrated", "torchrun", "fork"]  # the migrating one first
    got = last_json(capsys)
    assert (got["fork_over_torchrun"], got["copied_over_migrated_store"]) == (0.5, 0.8)


def test_only_refuses_an_unknown_variant(monkeypatch, capsys):
    fake_runs(monkeypatch)
    with pytest.raises(SystemExit) as stop:
        startup.main(["--only", "fork,against"])
    assert stop.value.code == 2 and "`against` needs --against CHECKOUT" in capsys.readouterr().err


def test_the_first_step_line_is_recognised_and_no_later_one():
    assert startup.FIRST_STEP.search("12:03:05 [rank0] INFO step 1/2 | reward 0.305 acc 0.00 | len 22.0")
    assert not startup.FIRST_STEP.search("12:03:05 [rank0] INFO step 11/20 | reward 0.305")
    assert not startup.FIRST_STEP.search("ready: 22 prompts, starting at step 0 of 2 (start-up 10.9 s, ...)")
