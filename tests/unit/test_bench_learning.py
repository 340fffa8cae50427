"""bench/learning*.py without training: the study files load and every run's recipe is a valid
recipe (the real config loader), the held-out prompts are never training prompts, the summaries'
windows and spreads, the quick check's verdict on a flat or falling reward, and the grouped
(mean over seeds) plot lines of megatron_gtpo/plotting.py."""

from __future__ import annotations

import json

import pytest

from bench.learning_report import aggregate, quick_verdict, spread, window
from bench.learning_study import ALGORITHMS, eval_argv, load_study, prepare_data, run_recipe, with_sizes, write_recipe
from megatron_gtpo.config import load_config
from megatron_gtpo.plotting import _draw, _smoothed
from tests.helpers import REPO

STUDIES = sorted((REPO / "configs" / "study").glob("*.yaml"))


@pytest.mark.parametrize("path", STUDIES, ids=lambda p: p.stem)
def test_every_run_recipe_of_every_study_is_valid(path, tmp_path):
    study = load_study(path)
    # the quick check runs every algorithm; the studies at least the four of the GTPO comparison
    assert set(study.algorithms) == set(ALGORITHMS) if path.stem == "quick" else \
        {"gtpo", "grpo", "drgrpo", "dapo"} <= set(study.algorithms) <= set(ALGORITHMS)
    data = prepare_data(study, tmp_path)
    names = set()
    for algo in study.algorithms:
        recipe = write_recipe(study, algo, data, seed=3, run_dir=tmp_path / algo)
        cfg = load_config(recipe, [f"output_dir={tmp_path / algo}"])
        names.add(cfg.algo.name)
        assert cfg.train.steps == study.steps and cfg.train.checkpoint_every == study.steps
        assert (cfg.rollout.seed, cfg.data.seed, cfg.train.seed) == (3, 3, 1237)
        # shared settings win over the algorithm's recipe: the same sampling and optimizer for all
        shared = study.shared
        assert cfg.rollout.n == shared["rollout"]["n"] and cfg.rollout.max_tokens == shared["rollout"]["max_tokens"]
        assert cfg.optim.optimizer["lr"] == shared["optim"]["optimizer"]["lr"]
        assert cfg.train.prompts_per_step == shared["train"]["prompts_per_step"]
        if study.eval.every:
            assert cfg.train.eval_every == study.eval.every and cfg.train.eval_benchmark == "gsm8k"
    assert names == set(study.algorithms)


def test_arithmetic_study_uses_each_algorithms_own_recipe(tmp_path):
    study = load_study(REPO / "configs" / "study" / "arithmetic.yaml")
    data = prepare_data(study, tmp_path)
    cfgs = {a: load_config(write_recipe(study, a, data, seed=0, run_dir=tmp_path / a)) for a in study.algorithms}
    assert cfgs["grpo"].algo.adv_std_scale is True and cfgs["grpo"].algo.kl_beta == 0.0  # grpo_gtpo_paper.yaml
    assert cfgs["gtpo"].algo.gtpo_prompt_reduction == "sum" and cfgs["gtpo"].algo.entropy_logits == "raw"
    assert cfgs["dapo"].algo.clip_eps_high == 0.28 and cfgs["dapo"].reward.fn == "dapo"
    assert cfgs["dapo"].algo.overlong_buffer_len <= cfgs["dapo"].rollout.max_tokens
    assert cfgs["drgrpo"].algo.agg_mode == "seq-mean-token-sum-norm"
    assert {c.data.paths[0] for c in cfgs.values()} == {str(data.train_file)}  # same prompts for all


def test_a_study_inherits_its_base_study():
    base, collapse = (load_study(REPO / "configs" / "study" / f"{n}.yaml") for n in ("arithmetic", "collapse"))
    assert collapse.task["operators"] == ["+", "-", "*"] and collapse.task["max_operand"] == base.task["max_operand"]
    assert collapse.shared["optim"]["optimizer"]["lr"] == 5 * base.shared["optim"]["optimizer"]["lr"]
    assert collapse.shared["optim"]["optimizer"]["clip_grad"] == base.shared["optim"]["optimizer"]["clip_grad"]
    assert collapse.shared["rollout"] == base.shared["rollout"] and collapse.eval.n == 0 < base.eval.n
    assert set(collapse.algorithms) == set(base.algorithms)
    assert {a: collapse.recipe_of(a) for a in base.algorithms} == {a: base.recipe_of(a) for a in base.algorithms}


def test_held_out_prompts_are_never_training_prompts(tmp_path):
    study = load_study(REPO / "configs" / "study" / "arithmetic.yaml")
    data = prepare_data(study, tmp_path)
    train = {json.loads(line)["question"] for line in data.train_file.read_text().splitlines()}
    held = [json.loads(line) for line in (data.held_out_root / "gsm8k" / "test.jsonl").read_text().splitlines()]
    assert len(held) == data.held_out_count == study.task["held_out_prompts"]
    assert not train & {r["question"] for r in held} and len({r["question"] for r in held}) == len(held)
    assert data.overlap_removed > 0  # the filter had something to remove: it is not vacuous
    argv = eval_argv(model="m", hf_config="h", study=study, data=data, output=tmp_path / "e.json",
                     shared_rollout=study.shared["rollout"], mlflow=("sqlite:///x.db", "rid", 30))
    assert argv[argv.index("--data-root") + 1] == str(data.held_out_root)
    assert argv[argv.index("--max-tokens") + 1] == str(study.shared["rollout"]["max_tokens"])
    assert "--vllm=kv_cache_memory_bytes=268435456" in argv and argv[-1] == "30"


def test_study_file_errors_name_the_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("task: {kind: arithmetic}\nsteps: 2\nalgorithms: {ppo: {recipe: ../x.yaml}}\n")
    with pytest.raises(ValueError, match="algorithms"):
        load_study(bad)
    bad.write_text("task: {kind: nope}\nsteps: 2\nalgorithms: {gtpo: {recipe: x.yaml}}\n")
    with pytest.raises(ValueError, match="task.kind"):
        load_study(bad)
    study = load_study(REPO / "configs" / "study" / "quick.yaml")
    with pytest.raises(ValueError, match="--algos ppo"):
        with_sizes(study, algorithms=("ppo",))
    assert list(with_sizes(study, steps=2, algorithms=("dapo", "gtpo")).algorithms) == ["dapo", "gtpo"]


def test_windows_and_spread():
    assert [window(s) for s in (1, 3, 6, 10, 30, 100)] == [1, 1, 2, 2, 5, 5]
    assert spread([None]) is None
    assert spread([0.2, 0.4]) == {"mean": 0.3, "min": 0.2, "max": 0.4, "std": pytest.approx(0.14142, abs=1e-5)}
    runs = [{"algo": "gtpo", "seed": s, "status": "ok", "acc_last": v, "heldout_greedy": {5: v, 10: v + 0.1},
             "pass_after": {"pass@1": v}} for s, v in ((0, 0.1), (1, 0.3))]
    runs.append({"algo": "grpo", "seed": 0, "status": "failed"})
    agg = aggregate(runs)
    assert agg["gtpo"]["acc_last"]["mean"] == pytest.approx(0.2) and agg["gtpo"]["seeds"] == [0, 1]
    assert agg["gtpo"]["heldout_greedy_after"]["max"] == pytest.approx(0.4)  # the last eval step of each seed
    assert agg["gtpo"]["pass_after"]["pass@1"]["min"] == pytest.approx(0.1)
    assert agg["grpo"] == {"seeds": [], "heldout_greedy_after": None}


def test_quick_verdict_fails_a_flat_or_falling_reward():
    ok = {"algo": "gtpo", "reward_first": 0.3, "reward_last": 0.9}
    assert quick_verdict([ok], 0.1)["passed"]
    flat = {"algo": "grpo", "reward_first": 0.3, "reward_last": 0.35}  # e.g. a zero gradient
    falling = {"algo": "dapo", "reward_first": 0.3, "reward_last": 0.1}  # e.g. a flipped advantage
    failed = {"algo": "drgrpo", "status": "failed"}  # a run that did not finish
    verdict = quick_verdict([ok, flat, falling, failed], 0.1)
    assert not verdict["passed"] and verdict["failed"] == ["dapo", "drgrpo", "grpo"]


def test_grouped_lines_are_the_mean_over_runs_with_a_band():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    runs = [{"m": [(1, 0.0), (2, 1.0)]}, {"m": [(1, 1.0), (2, 3.0)]}]
    assert _draw(ax, runs, "m", "algo", smooth=1) and not _draw(ax, runs, "absent", "algo", smooth=1)
    (line,) = ax.lines
    assert list(line.get_xdata()) == [1, 2] and list(line.get_ydata()) == [0.5, 2.0]
    assert len(ax.collections) == 1  # the min-max band of the two runs
    plt.close(fig)
    assert _smoothed([1, 2, 3], [1.0, 3.0, 5.0], 2) == [1.0, 2.0, 4.0]
    # A window of steps, not of points: evaluations 20 steps apart are not averaged together.
    assert _smoothed([20, 40], [0.2, 0.1], 5) == [0.2, 0.1]


def test_summaries_of_seeds_run_apart_merge_into_one_table(capsys, tmp_path):
    from bench.learning_report import main, merged, table

    def line(seed, acc):
        return {"base": {"greedy": 0.125}, "runs": [{"algo": "gtpo", "seed": seed, "status": "ok", "acc_last": acc,
                                                      "heldout_greedy": {20: acc}}]}

    summary = merged([line(0, 0.25), line(1, 0.75)])
    assert summary["algorithms"]["gtpo"]["seeds"] == [0, 1] and summary["base"] == [{"greedy": 0.125}] * 2
    text = table(summary)
    assert "| gtpo | 0,1 | - | 0.5 [0.25, 0.75] | 0.5 [0.25, 0.75] |" in text, text  # mean [min, max] over seeds
    assert table(merged([line(0, 0.25)])).splitlines()[2].startswith("| gtpo | 0 | - | 0.25 | 0.25 |")
    paths = []
    for seed, acc in ((0, 0.25), (1, 0.75)):
        paths.append(tmp_path / f"s{seed}.json")
        paths[-1].write_text(json.dumps(line(seed, acc)))
    assert main([str(p) for p in paths] + ["--held-out-png", str(tmp_path / "h.png")]) == 0
    out = capsys.readouterr().out
    assert "0.5 [0.25, 0.75]" in out and json.loads(out.splitlines()[-1])["algorithms"]["gtpo"]["seeds"] == [0, 1]
    assert (tmp_path / "h.png").read_bytes()[:4] == b"\x89PNG"


def test_reuse_base_copies_an_earlier_evaluation_instead_of_running_it(tmp_path):
    """--reuse-base: the base model's report and samples are copied and read, no eval runs (args=None
    would fail on any launch). Injected bug, seen failing once: the samples file not copied."""
    from bench.learning import evaluate_model

    old, new = tmp_path / "old", tmp_path / "new"
    old.mkdir(), new.mkdir()
    report = {"benchmarks": {"gsm8k": {"metrics": {"pass@1": 0.125, "maj@1": 0.125}}}}
    (old / "base_greedy.json").write_text(json.dumps(report))
    (old / "base_greedy.samples.jsonl").write_text('{"uid": "gsm8k:0", "correct": true}\n')
    got = evaluate_model("m", study=None, data=None, out=new / "base_greedy", args=None, reuse=old)
    assert got["pass"] == {"pass@1": 0.125} and got["reused"] == str(old)
    assert (new / "base_greedy.samples.jsonl").read_text() == (old / "base_greedy.samples.jsonl").read_text()


def test_summarise_only_lists_the_runs_that_never_finished(tmp_path, capsys):
    """--summarise-only trains nothing: runs without a run id (or without their pass@k report when the
    study asks for one) are listed in not_run, never summarised from guesses. (Checked by hand on a
    finished study: the same held-out, length and shift numbers as its own summary.json.)"""
    from bench.learning import main

    report = {"benchmarks": {"gsm8k": {"metrics": {"pass@1": 0.125}}}}
    (tmp_path / "base_greedy.json").write_text(json.dumps(report))
    (tmp_path / "gtpo-s0").mkdir()
    (tmp_path / "gtpo-s0" / "run_id").write_text("x")       # started, never evaluated
    assert main(["--study", str(REPO / "configs/study/paper.yaml"), "--out", str(tmp_path), "--summarise-only"]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["runs"] == [] and summary["mode"] == "summarise-only"
    assert summary["not_run"] == [f"{a}-s{s}" for s in (0, 1) for a in ("gtpo", "grpo", "drgrpo", "dapo")]
    assert summary["base"]["greedy"] == 0.125
