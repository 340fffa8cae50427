"""bench/vs_trl.py and bench/trl_side.py without running a trainer: the TRL-side reward adapter, the
per-step timing callback, the journal reader, the JSON summariser and ratios, our recipe overrides
(validated by the real config loader), and the TRL config (only where TRL, the `bench` extra, is
installed: those tests are skipped otherwise, with the reason)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from bench import trl_side, vs_trl
from bench.trl_side import PhaseClock, ProjectReward, check_same_tokens, dataset_rows
from bench.vs_trl import Work, journal_steps, our_overrides, ratios, summarise
from megatron_gtpo.reward import RewardConfig, RewardScorer
from megatron_gtpo.types import Prompt
from tests.helpers import REPO

GOLD = "Natalia sold 48/2 = 24 clips in May.\n#### 72"
needs_trl = pytest.mark.skipif(not vs_trl.trl_installed(),
                               reason="TRL is not installed (optional `bench` extra of pyproject.toml)")


def test_project_reward_scores_with_this_projects_checker_and_books_its_time():
    clock = PhaseClock()
    with RewardScorer(RewardConfig(fn="correctness", num_workers=0)) as scorer:
        reward = ProjectReward(scorer, clock)
        got = reward(prompts=["p", "p", "p"], completions=["... \\boxed{72}", "<answer>71</answer>",
                                                             [{"role": "assistant", "content": "<answer>72</answer>"}]],
                     gold=[GOLD] * 3, task=["gsm8k"] * 3, trainer_state=None, log_extra=None, log_metric=None)
    assert got == [1.0, 0.0, 1.0]  # conversational completions: the assistant turn is scored
    assert reward.__name__ == "megatron_gtpo/correctness"
    assert clock.take()["reward_s"] > 0 and clock.take() == {}


def test_project_reward_refuses_a_dataset_without_gold_per_completion():
    with RewardScorer(RewardConfig(fn="correctness", num_workers=0)) as scorer:
        with pytest.raises(ValueError, match="`gold` and `task` columns"):
            ProjectReward(scorer)(completions=["a", "b"], gold=[GOLD], task=["gsm8k", "gsm8k"])


def test_dataset_rows_and_the_same_tokens_check():
    prompts = [Prompt(uid="g/0", token_ids=[5, 6], text="hi", gold=GOLD, task="gsm8k")]
    assert dataset_rows(prompts) == [{"prompt": "hi", "gold": GOLD, "task": "gsm8k"}]
    same = lambda text: {"input_ids": [5, 6]}  # noqa: E731
    check_same_tokens(prompts, same)
    with pytest.raises(RuntimeError, match="tokenize prompt g/0 differently"):
        check_same_tokens(prompts, lambda text: {"input_ids": [1, 5, 6]})  # e.g. a BOS added


def test_step_callback_writes_phases_and_the_rest_as_train(monkeypatch):
    clock, out = PhaseClock(), io.StringIO()
    callback = trl_side.step_callback(clock, out)
    times = iter([100.0, 110.0])
    monkeypatch.setattr(trl_side.time, "perf_counter", lambda: next(times))
    clock.seconds = {"rollout_s": 99.0}  # left over from before the step: dropped at step begin
    callback.on_step_begin(None, SimpleNamespace(global_step=0), None)
    clock.seconds.update({"rollout_s": 6.0, "reward_s": 0.5, "sync_s": 1.0})
    callback.on_step_end(None, SimpleNamespace(global_step=1), None)
    row = json.loads(out.getvalue())
    assert row == {"step": 1, "rollout_s": 6.0, "reward_s": 0.5, "sync_s": 1.0, "train_s": 2.5, "step_s": 10.0}


def test_journal_steps_reads_our_phase_metrics_last_record_wins(tmp_path):
    records = [{"t": "params", "params": {}},
               {"t": "metrics", "step": 0, "m": {"data/prompts": 48.0}},
               {"t": "metrics", "step": 1, "m": {"time/step_s": 9.0, "time/rollout_s": 5.0, "reward/mean": 0.1}},
               {"t": "metrics", "step": 2, "m": {"time/step_s": 4.0}},
               {"t": "rewind", "to": 1},
               {"t": "metrics", "step": 2, "m": {"time/step_s": 3.0, "time/train_s": 2.0}}]
    path = tmp_path / "journal.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    steps = journal_steps(path)
    assert [s["step"] for s in steps] == [1, 2]
    assert steps[0]["rollout_s"] == 5.0 and steps[0]["sync_s"] == 0.0
    assert steps[1]["step_s"] == 3.0 and steps[1]["train_s"] == 2.0


def step(i, total, rollout=0.0):
    return {"step": i, "rollout_s": rollout, "reward_s": 0.0, "train_s": total - rollout, "sync_s": 0.0,
            "step_s": total}


def test_summarise_takes_medians_of_steps_2_on():
    row = summarise("grpo", [step(1, 100.0), step(2, 4.0, 1.0), step(3, 6.0, 3.0), step(4, 5.0, 2.0)],
                    peak_rss_mb=1234.4, wall_s=70.0)
    assert row["steps_timed"] == [2, 3, 4] and row["median_step_s"] == 5.0 and row["median_rollout_s"] == 2.0
    assert row["median_train_s"] == 3.0 and row["peak_rss_mb"] == 1234 and row["step_s_each"] == [4.0, 6.0, 5.0]
    with pytest.raises(ValueError, match="no step >= 2"):
        summarise("grpo", [step(1, 3.0)], peak_rss_mb=None, wall_s=1.0)


def test_ratios_compare_trl_with_our_grpo_and_gtpo_with_grpo():
    rows = [{"variant": "trl_hf", "status": "ok", "median_step_s": 30.0, "median_cpu_s": 12.0, "peak_rss_mb": 3000},
            {"variant": "trl_vllm", "status": "failed", "error": "boom"},
            {"variant": "grpo", "status": "ok", "median_step_s": 10.0, "median_cpu_s": 10.0, "peak_rss_mb": 2000},
            {"variant": "gtpo", "status": "ok", "median_step_s": 10.4, "median_cpu_s": None, "peak_rss_mb": 2000}]
    out = ratios(rows)
    assert out["trl_over_ours"] == {"trl_hf": 3.0, "trl_vllm": None}
    assert out["trl_over_ours_cpu"]["trl_hf"] == 1.2 and out["goal_ours_1.5x_faster_than_trl_cpu"] is False
    assert out["gtpo_over_grpo_cpu"] is None and out["goal_gtpo_le_1.05x_grpo_cpu"] is None  # not sampled
    assert out["trl_over_ours_rss"]["trl_hf"] == 1.5 and out["gtpo_over_grpo"] == 1.04
    assert out["goal_ours_1.5x_faster_than_trl"] is True and out["goal_gtpo_le_1.05x_grpo"] is True
    assert out["failed"] == {"trl_vllm": "boom"}
    rows[0]["median_step_s"], rows[3]["median_step_s"] = 14.0, 11.0
    out = ratios(rows)
    assert out["goal_ours_1.5x_faster_than_trl"] is False and out["goal_gtpo_le_1.05x_grpo"] is False
    assert ratios(rows[2:3])["goal_ours_1.5x_faster_than_trl"] is None  # nothing to compare: no verdict


def test_work_checks_its_sizes():
    with pytest.raises(ValueError, match="--steps must be >= 2"):
        Work(steps=1)
    with pytest.raises(ValueError, match="multiple of --micro-batch"):
        Work(prompts=3, n=3, micro_batch=4)
    args = vs_trl.parse_args(["--quick", "--steps", "4", "--trl-gradient-checkpointing"])
    assert vs_trl.work_from(args) == Work(**{**vs_trl.QUICK, "steps": 4},  # explicit flags win over --quick
                                          trl_gradient_checkpointing=True)


@pytest.mark.parametrize("algo", ["grpo", "gtpo"])
def test_our_overrides_make_the_recipe_do_the_shared_work(algo):
    from megatron_gtpo.config import load_config

    work = Work()
    cfg = load_config(REPO / "configs" / f"{algo}.yaml", our_overrides(work, algo))
    assert (cfg.rollout.n, cfg.rollout.max_tokens, cfg.rollout.temperature) == (8, 128, 0.9)
    assert (cfg.train.prompts_per_step, cfg.train.micro_batch_size) == (8, 8)
    assert cfg.algo.name == algo and cfg.algo.kl_beta == 0.0 and cfg.algo.mu == 1
    assert cfg.optim.optimizer["lr"] == 1e-6 and cfg.reward.fn == "correctness" and cfg.reward.num_workers == 0
    assert cfg.data.shuffle is False and cfg.data.limit == 48 and cfg.data.template == "reasoning_tags"
    assert cfg.parallel.world_size == 1 and cfg.model.dtype == "float32"


def test_a_trl_variant_without_trl_is_reported_skipped(monkeypatch, tmp_path):
    monkeypatch.setattr(vs_trl, "trl_installed", lambda: False)
    row = vs_trl.run_variant("trl_hf", Work(), tmp_path, timeout_s=5)
    assert row["status"] == "skipped" and "bench" in row["error"] and "trl==" in row["error"]


def test_a_failing_vllm_mode_says_what_it_means(monkeypatch):
    import megatron_gtpo.models.resolve as resolve

    def fail(*args, **kwargs):
        raise AttributeError("'LLM' object has no attribute 'x'")

    monkeypatch.setattr(resolve, "resolve_model", lambda name: "/m")
    monkeypatch.setattr(vs_trl, "shared_prompts", lambda work, model_dir: [])
    monkeypatch.setattr(trl_side, "run_trl", fail)
    work = json.dumps(vs_trl.dataclasses.asdict(Work()))
    with pytest.raises(RuntimeError, match=r"vLLM colocate mode failed with the installed vLLM.*AttributeError"):
        vs_trl.child_main("trl_vllm", work, "/nowhere")
    with pytest.raises(AttributeError):  # the transformers-generation variant fails as itself
        vs_trl.child_main("trl_hf", work, "/nowhere")


def test_help_and_bad_variants_answer_without_trainers():
    script = str(REPO / "bench" / "vs_trl.py")
    proc = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "--quick" in proc.stdout and "trl_over_ours" in proc.stdout
    proc = subprocess.run([sys.executable, script, "--variants", "trl_hf,deepspeed"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "--variants" in proc.stderr and "grpo" in proc.stderr


@needs_trl
@pytest.mark.parametrize("variant", ["trl_hf", "trl_vllm"])
def test_trl_config_does_the_shared_work(variant, tmp_path):
    args = trl_side.grpo_config(Work(), variant, str(tmp_path))
    assert args.per_device_train_batch_size * args.gradient_accumulation_steps == 64  # 8 prompts x 8
    assert args.num_generations == 8 and args.max_completion_length == 128 and args.beta == 0.0
    assert args.num_iterations == 1 and args.learning_rate == 1e-6 and args.max_steps == 6
    assert args.temperature == 0.9 and args.shuffle_dataset is False and args.use_cpu
    assert args.use_vllm is (variant == "trl_vllm") and args.gradient_checkpointing is False  # as our runs
    assert trl_side.grpo_config(Work(trl_gradient_checkpointing=True), variant, str(tmp_path)).gradient_checkpointing
    if args.use_vllm:
        assert args.vllm_mode == "colocate"


def test_cpu_per_step_is_the_difference_between_step_records():
    steps = [step(1, 9.0), step(2, 4.0), step(3, 5.0), step(4, 6.0)]
    got = vs_trl.with_cpu(steps, {1: 30.0, 2: 33.5, 3: 36.0})  # step 4's record was never sampled
    assert [s.get("cpu_s") for s in got] == [None, 3.5, 2.5, None]
    row = summarise("grpo", got, peak_rss_mb=1.0, wall_s=1.0)
    assert row["median_cpu_s"] == 3.0  # steps 2 and 3 only
    assert summarise("grpo", steps, peak_rss_mb=1.0, wall_s=1.0)["median_cpu_s"] is None


def test_run_child_reports_exit_rss_and_cpu_at_each_step_record(tmp_path):
    steps_path = tmp_path / "steps.jsonl"
    script = ("import json, time\n"
              "x = bytearray(200 * 2**20)\n"  # ~200 MB resident
              f"out = open({str(steps_path)!r}, 'w')\n"
              "for s in (1, 2):\n"
              "    end = time.process_time() + 0.6\n"
              "    while time.process_time() < end: pass\n"  # burn 0.6 s of CPU per step
              "    out.write(json.dumps({'step': s}) + '\\n'); out.flush(); time.sleep(0.6)\n"
              "raise SystemExit(3)\n")
    got = vs_trl.run_child([sys.executable, "-c", script], env=dict(__import__("os").environ),
                           log_path=tmp_path / "log.txt", timeout_s=120,
                           steps_of=lambda: vs_trl.read_steps(steps_path), last_step=2)
    assert got.code == 3 and got.peak_rss_mb > 190 and got.steps_rss_mb > 190 and got.cpu_s >= 1.2
    assert sorted(got.cpu_at_step) == [1, 2] and 0.4 < got.cpu_at_step[2] - got.cpu_at_step[1] < 1.5
    assert (tmp_path / "log.txt").read_text().startswith("$ ")
