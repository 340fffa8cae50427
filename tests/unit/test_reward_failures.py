"""User reward failures made visible, with real scoring worker processes: each distinct error logged
once with its traceback (and handed out for the artifact), timeouts, a function that kills its
worker (a clear stop, no process left behind), the more-than-half warning and the all-failed stop."""

from __future__ import annotations

import dataclasses
import logging
import time

import psutil
import pytest

from megatron_gtpo.reward import (RewardConfig, RewardFunctionCrashed, RewardFunctionFailing, RewardScorer,
                                  ScoringPool, score_groups)
from megatron_gtpo.types import Completion, Prompt

PLUGIN = "tests.unit.reward_plugins"


@pytest.fixture
def reward_log(caplog):
    """Records of the megatron_gtpo.reward loggers, whether or not the driver's logging (which stops
    propagation to the root logger) was set up in this process."""
    logger = logging.getLogger("megatron_gtpo.reward")
    saved = logger.level, logger.propagate
    logger.addHandler(caplog.handler)
    logger.setLevel(logging.WARNING)
    logger.propagate = False  # each record once (caplog's handler also sits on the root logger)
    yield caplog
    logger.removeHandler(caplog.handler)
    logger.level, logger.propagate = saved


def _scorer(fn: str, **kw) -> RewardScorer:
    # fork keeps these protocol tests fast; test_worker_that_kills_itself_* uses the spawn default.
    return RewardScorer(RewardConfig(fn=f"{PLUGIN}.{fn}", **{"num_workers": 2, "timeout_s": 1.0,
                                                              "start_method": "fork", "chunk_size": 2, **kw}))


def _batch(texts: list[str]) -> tuple[list[Prompt], list[Completion]]:
    prompts = [Prompt(uid="p0", token_ids=[1, 2], gold="#### 1", task="gsm8k")]
    return prompts, [Completion(prompt_index=0, prompt_token_ids=[1, 2], token_ids=[5], logprobs=[0.0], text=t)
                     for t in texts]


def test_each_distinct_error_is_logged_once_with_its_traceback(reward_log):
    with _scorer("failing_reward") as scorer:
        scores = scorer.score([("a", "1", "gsm8k"), ("KEY", "1", "gsm8k"), ("b", "1", "gsm8k"),
                               ("KEY 2", "1", "gsm8k")] * 3)
        assert all(s.status == "error" for s in scores)
        new = scorer.new_errors()
        assert [e.error for e in new] == ["ValueError: cannot score this", "KeyError: 'missing'"]
        assert 'raise ValueError("cannot score this")' in new[0].traceback
        assert 'return {}["missing"]' in new[1].traceback
        assert new[1].completion == "KEY" and new[1].fn == f"{PLUGIN}.failing_reward" and new[1].batch == 1
        assert scorer.errors.counts == {"error: ValueError: cannot score this": 6, "error: KeyError: 'missing'": 6}
        dataclasses.asdict(new[0])  # plain data for the JSON artifact
        logged = [r.getMessage() for r in reward_log.records if "new reward error" in r.getMessage()]
        assert len(logged) == 2 and "Traceback (most recent call last)" in logged[0]
        # the same errors again: counted, neither logged nor handed out a second time
        scorer.score([("c", "1", "gsm8k"), ("KEY", "1", "gsm8k")])
        assert scorer.new_errors() == []
        assert len([r for r in reward_log.records if "new reward error" in r.getMessage()]) == 2
        assert scorer.errors.counts["error: KeyError: 'missing'"] == 7


def test_timeouts_are_reported_with_where_they_hung(reward_log):
    with _scorer("misbehaving_reward", timeout_s=0.5) as scorer:
        start = time.monotonic()
        scores = scorer.score([("SLOW", "1", "gsm8k"), ("HANG", "1", "gsm8k"), ("1", "1", "gsm8k")])
        assert time.monotonic() - start < 30
        assert [s.status for s in scores] == ["timeout", "timeout", "ok"]
        slow, hang = scorer.new_errors()
        assert slow.status == "timeout" and "time.sleep(60)" in slow.traceback
        assert hang.error.startswith("worker unresponsive") and hang.traceback == ""
    assert any("(no traceback: the scoring worker was killed)" in r.getMessage() for r in reward_log.records)


def test_more_than_half_failed_warns_naming_the_function(reward_log):
    with _scorer("misbehaving_reward") as scorer:
        prompts, completions = _batch(["BOOM", "BOOM", "1", "1"])
        score_groups(prompts, completions, scorer=scorer)  # half: no warning
        assert not [r for r in reward_log.records if "rewards failed in this batch" in r.getMessage()]
        prompts, completions = _batch(["BOOM", "BOOM", "NAN", "1"])
        batch = score_groups(prompts, completions, scorer=scorer)
    assert batch.stats.num_errors == 3
    warnings = [r.getMessage() for r in reward_log.records if "rewards failed in this batch" in r.getMessage()]
    assert warnings == [f"reward.fn={PLUGIN}.misbehaving_reward: 3 of 4 rewards failed in this batch (3 errors, "
                        f"0 timeouts); they score 0. The first traceback of each distinct failure is in the log"]


def test_every_reward_failing_warns_each_batch_then_stops_the_run(reward_log):
    with _scorer("failing_reward", max_failed_batches=3) as scorer:
        prompts, completions = _batch(["x", "y"])
        score_groups(prompts, completions, scorer=scorer)
        score_groups(prompts, completions, scorer=scorer)
        every = [r.getMessage() for r in reward_log.records if "EVERY reward of this batch failed" in r.getMessage()]
        assert len(every) == 2 and "2 batch(es) in a row; the run stops after reward.max_failed_batches=3" in every[1]
        with pytest.raises(RewardFunctionFailing, match=r"every reward failed in 3 scoring batches in a row"):
            score_groups(prompts, completions, scorer=scorer)
    with _scorer("misbehaving_reward", max_failed_batches=2) as scorer:  # a good batch resets the count
        for texts in (["BOOM"], ["1"], ["BOOM"], ["1"]):
            score_groups(*_batch(texts), scorer=scorer)
        assert scorer.monitor.failed_in_a_row == 0
    with _scorer("failing_reward", max_failed_batches=0) as scorer:  # 0: warn, never stop
        for _ in range(4):
            score_groups(*_batch(["x"]), scorer=scorer)
        assert scorer.monitor.failed_in_a_row == 4


def _children() -> set[int]:
    """Child processes, less multiprocessing's resource tracker (one per parent, started with the
    first spawned process and kept for the parent's lifetime: not a scoring worker)."""
    out = set()
    for proc in psutil.Process().children(recursive=True):
        try:
            if "resource_tracker" not in " ".join(proc.cmdline()):
                out.add(proc.pid)
        except psutil.NoSuchProcess:
            pass
    return out


def test_worker_that_kills_itself_stops_scoring_and_leaves_no_process():
    before = _children()
    scorer = RewardScorer(RewardConfig(fn=f"{PLUGIN}.misbehaving_reward", num_workers=2, timeout_s=5.0, chunk_size=2))
    items = [("1", "1", "gsm8k")] * 5 + [("DIE here", "7", "gsm8k")] + [("2", "2", "gsm8k")] * 5
    with pytest.raises(RewardFunctionCrashed) as err:
        scorer.score(items)
    assert scorer.pool._workers == []  # noqa: SLF001  the pool stopped every worker before raising
    assert str(err.value).startswith(f"reward.fn='{PLUGIN}.misbehaving_reward' killed its worker process "
                                     f"(exit code 3) on sample 5 of this batch, 2 times, so scoring stopped")
    assert "completion 'DIE here', gold '7'" in str(err.value)
    deadline = time.monotonic() + 10
    while _children() - before and time.monotonic() < deadline:  # join() already reaped them; belt and braces
        time.sleep(0.1)
    left = [psutil.Process(pid).cmdline() for pid in _children() - before if psutil.pid_exists(pid)]
    assert not left, f"scoring workers left behind: {left}"
    scorer.close()


def test_a_one_off_worker_death_is_retried(tmp_path, reward_log):
    marker = tmp_path / "died"
    with ScoringPool(fn_path=f"{PLUGIN}:dies_once_reward", num_workers=1, timeout_s=5.0, start_method="fork",
                     label="dies_once") as pool:
        scores = pool.score([("a", "1", "gsm8k"), (f"DIE_ONCE {marker}", "1", "gsm8k"), ("b", "1", "gsm8k")])
    assert marker.exists()  # it did die once
    assert [(s.status, s.reward) for s in scores] == [("ok", 0.5)] * 3
    assert any("killed its scoring worker (exit code 4) on sample 1; retrying" in r.getMessage()
               for r in reward_log.records)
