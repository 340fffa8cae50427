"""Parallel scoring: per-sample timeouts (in-worker alarm and parent kill), errors, order, and the
score_groups hand-off to the training loop."""

import signal
import time

import pytest

from megatron_gtpo.reward import RewardConfig, RewardScorer, ScoringPool, score_groups
from megatron_gtpo.reward.functions import OverlongPunishment
from megatron_gtpo.types import Completion, Prompt
from megatron_gtpo.utils.configuration import ConfigError

PLUGIN = "tests.unit.reward_plugins"


def test_pool_survives_timeouts_hangs_and_errors():
    items = [("ok \\boxed{3}", "3", "math"), ("SLOW", "1", "gsm8k"), ("HANG", "1", "gsm8k"),
             ("BOOM", "1", "gsm8k"), ("NAN", "1", "gsm8k")]
    items += [(f"the answer is {i}", str(i if i % 3 else i + 1), "gsm8k") for i in range(30)]
    # fork keeps this protocol test fast (no re-import per worker or respawn); the spawn default
    # is exercised by test_reward_benchmarks and the eval e2e tests.
    with ScoringPool(fn_path=f"{PLUGIN}:misbehaving_reward", num_workers=2, timeout_s=1.0, chunk_size=4,
                     start_method="fork") as pool:
        start = time.monotonic()
        scores = pool.score(items, with_answers=True)
        assert time.monotonic() - start < 60  # neither the 60 s sleep nor the hang was waited out
        assert [s.status for s in scores[:5]] == ["ok", "timeout", "timeout", "error", "error"]
        assert "boom" in scores[3].error and "finite" in scores[4].error
        assert all(s.reward == 0.0 and not s.correct for s in scores[1:5])
        # tracebacks: where the alarm interrupted the sleep, where the function raised; none for a killed worker
        assert "time.sleep(60)" in scores[1].traceback and "SampleTimeout" in scores[1].traceback
        assert scores[2].traceback == "" and 'raise RuntimeError("boom")' in scores[3].traceback
        assert scores[0].reward == 0.5 and scores[0].correct and scores[0].answer == "3"
        # every other sample kept its place in the output order
        assert [s.correct for s in scores[5:]] == [bool(i % 3) for i in range(30)]
        assert [s.answer for s in scores[5:]] == [str(i) for i in range(30)]
        # the killed worker was replaced: the pool keeps working
        again = pool.score([("the answer is 5", "5", "gsm8k")] * 5)
        assert all(s.status == "ok" and s.correct and s.answer is None for s in again)  # no answers asked


def test_inline_scoring_times_out_and_restores_handler():
    marker = []
    previous = signal.signal(signal.SIGALRM, lambda *a: marker.append(1))
    try:
        pool = ScoringPool(fn_path=f"{PLUGIN}:misbehaving_reward", num_workers=0, timeout_s=0.5)
        scores = pool.score([("SLOW", "1", "gsm8k"), ("BOOM", "1", "gsm8k"), ("7", "7", "gsm8k")])
        assert [s.status for s in scores] == ["timeout", "error", "ok"]
        assert scores[2].correct
        assert signal.getsignal(signal.SIGALRM) is not None
        signal.raise_signal(signal.SIGALRM)  # the caller's handler is back in place
        assert marker == [1]
    finally:
        signal.signal(signal.SIGALRM, previous)


def test_worker_that_cannot_import_its_reward_fails_loudly():
    with pytest.raises(RuntimeError, match="could not start reward"):
        ScoringPool(fn_path="no_such_module_xyz:fn", num_workers=1, timeout_s=1.0).score([("1", "1", "gsm8k")])


def _prompt(i: int, gold: str) -> Prompt:
    return Prompt(uid=f"p{i}", token_ids=[1, 2, 3], gold=gold, task="gsm8k")


def _completion(prompt_index: int, text: str, num_tokens: int) -> Completion:
    return Completion(prompt_index=prompt_index, prompt_token_ids=[1, 2, 3], token_ids=[5] * num_tokens,
                      logprobs=[0.0] * num_tokens, text=text)


def test_score_groups_groups_by_prompt_and_adds_overlong_punishment():
    prompts = [_prompt(0, "#### 4"), _prompt(1, "#### 9"), _prompt(2, "#### 1")]
    completions = [_completion(1, "\\boxed{9}", 10), _completion(0, "\\boxed{4}", 10),
                   _completion(1, "\\boxed{8}", 90), _completion(0, "\\boxed{5}", 100),
                   _completion(1, "\\boxed{9}", 101)]
    scorer = RewardScorer(RewardConfig(fn="dapo", num_workers=0),
                          overlong=OverlongPunishment(max_tokens=100, cache_tokens=20))
    with scorer:
        batch = score_groups(prompts, completions, scorer=scorer)
    g0, g1, g2 = batch.groups
    assert [c.text for c in g0.completions] == ["\\boxed{4}", "\\boxed{5}"]
    assert g0.correct == [True, False] and g0.rewards == [1.0, -2.0]  # -1 rule reward, -1 at L_max
    assert g1.correct == [True, False, True]
    assert g1.rewards == pytest.approx([1.0, -1.5, 0.0])  # 90 tokens: (80 - 90) / 20 = -0.5; 101 > L_max: -1
    assert g2.completions == [] and g2.rewards == []
    assert batch.stats.num_samples == 5 and batch.stats.num_overlong == 3
    assert batch.stats.num_timeouts == 0 and batch.stats.num_errors == 0
    assert batch.stats.metrics()["reward/overlong"] == 3.0


def test_score_groups_counts_failures_and_rejects_bad_input():
    prompts = [_prompt(0, "#### 1")]
    cfg = RewardConfig(fn=f"{PLUGIN}.misbehaving_reward", num_workers=0, timeout_s=0.5)
    with RewardScorer(cfg) as scorer:
        batch = score_groups(prompts, [_completion(0, "BOOM", 3), _completion(0, "SLOW", 3),
                                       _completion(0, "1", 3)], scorer=scorer)
    assert batch.groups[0].rewards == [0.0, 0.0, 0.5]
    assert (batch.stats.num_errors, batch.stats.num_timeouts) == (1, 1)
    with pytest.raises(ValueError, match="prompt_index=3"):
        score_groups(prompts, [_completion(3, "1", 1)], config=cfg)
    with pytest.raises(ValueError, match="exactly one"):
        score_groups(prompts, [], scorer=None, config=None)
    with pytest.raises(ValueError, match="reward.fn='not_a_reward'"):
        RewardScorer(RewardConfig(fn="not_a_reward"))


def test_reward_scale_multiplies_every_reward_where_it_is_produced():
    """reward.scale (the reward-scale probe's phi, spec 6 D3) scales the rule reward and the overlong
    term alike; bad values name the field."""
    prompts = [_prompt(0, "#### 4")]
    completions = [_completion(0, "\\boxed{4}", 10), _completion(0, "\\boxed{5}", 100)]
    rewards = {}
    for scale in (1.0, 10.0):
        with RewardScorer(RewardConfig(fn="dapo", num_workers=0, scale=scale),
                          overlong=OverlongPunishment(max_tokens=100, cache_tokens=20)) as scorer:
            rewards[scale] = score_groups(prompts, completions, scorer=scorer).groups[0].rewards
    assert rewards[1.0] == [1.0, -2.0] and rewards[10.0] == [10.0, -20.0]
    for bad in (0.0, -1.0, float("inf")):
        with pytest.raises(ConfigError, match="scale"):
            RewardConfig(scale=bad)


def test_preemption_signal_during_worker_start_up_does_not_kill_it():
    """SLURM's SIGUSR1 reaches the rank's whole process group; a worker still importing (workers
    start lazily, mid-run) must not die of it before it installs its ignore handler."""
    import os

    with ScoringPool(fn_path=f"{PLUGIN}:length_reward", num_workers=1, timeout_s=5.0) as pool:
        pool._ensure_workers()  # noqa: SLF001  start it, then signal it at once, mid-import
        os.kill(pool._workers[0].proc.pid, signal.SIGUSR1)  # noqa: SLF001
        scores = pool.score([("abcd", "1", "gsm8k")])
    assert scores[0].status == "ok" and scores[0].reward == 1.0


def test_start_spawns_the_workers_before_the_first_score():
    with RewardScorer(RewardConfig(fn="correctness", num_workers=2, start_method="fork")) as scorer:
        scorer.start()
        procs = [w.proc for w in scorer.pool._workers]
        assert len(procs) == 2 and all(p.is_alive() for p in procs)  # running before anything is scored
        assert [s.correct for s in scorer.score([("\\boxed{4}", "4", "math"), ("\\boxed{5}", "4", "math")])] \
            == [True, False]
        assert [w.proc for w in scorer.pool._workers] == procs  # the started workers did the scoring
    with RewardScorer(RewardConfig(fn="correctness", num_workers=0)) as inline:
        inline.start()  # nothing to start in-process
        assert inline.pool._workers == [] and inline.score([("\\boxed{4}", "4", "math")])[0].correct
