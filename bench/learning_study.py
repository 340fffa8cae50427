"""The study of ``bench/learning.py``: what a study file says, the data it writes, and how one run is
launched (the real ``megatron-gtpo train``, as a subprocess or in this process).

    configs/study/<name>.yaml --load_study--> Study
    Study --prepare_data--> train.jsonl + held-out set (laid out as a gsm8k test split, so that the
                            trainer's periodic eval and ``megatron-gtpo eval --data-root`` read it)
    Study x algorithm x seed --write_recipe--> <run dir>/recipe.yaml (base: the algorithm's recipe,
                            then the shared block, then the algorithm's overrides)
                            --train_argv--> megatron-gtpo train <run dir>/recipe.yaml --output-dir ...
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from megatron_gtpo.utils.configuration import deep_merge

REPO = Path(__file__).resolve().parents[1]
ALGORITHMS = ("gtpo", "grpo", "drgrpo", "dapo", "gspo", "cispo")
"""Every algorithm of a study, in the order the runs start."""
HELD_OUT_BENCHMARK = "gsm8k"
"""The held-out arithmetic set is written as ``<data root>/gsm8k/test.jsonl`` (GSM8K's columns and
``#### N`` golds): the benchmark name the trainer's ``train.eval_benchmark`` and the eval CLI read."""


@dataclass(frozen=True, kw_only=True)
class EvalPlan:
    """Held-out evaluation of a study (the ``eval:`` block)."""

    every: int = 0
    """Greedy held-out accuracy every N steps, by the trainer (``train.eval_every``); 0 = never."""
    prompts: int = 0
    """Held-out prompts of the trainer's eval (0: the whole held-out set)."""
    n: int = 0
    """Samples per held-out prompt for pass@k with ``megatron-gtpo eval`` before and after (0 = skip)."""
    k: tuple[int, ...] = (1,)
    """The k of pass@k."""
    temperature: float = 0.9
    """Sampling temperature of the pass@k evaluation."""


@dataclass(frozen=True, kw_only=True)
class Study:
    """One study file (configs/study/*.yaml), validated."""

    name: str
    """File stem (arithmetic, quick, ...)."""
    path: Path
    """The study file."""
    task: dict
    """``kind: arithmetic`` (with arithmetic_examples' parameters) or ``kind: recipe`` (the recipe's data)."""
    steps: int
    """Rollout steps per run."""
    seeds: tuple[int, ...]
    """Seeds; every algorithm runs every seed."""
    eval: EvalPlan
    """Held-out evaluation."""
    shared: dict
    """Recipe overrides applied to every algorithm's recipe."""
    algorithms: dict[str, dict] = field(default_factory=dict)
    """Name -> {recipe: path relative to the study file, overrides: {...}}."""

    def recipe_of(self, algo: str) -> Path:
        return (self.path.parent / self.algorithms[algo]["recipe"]).resolve()


def _read_study(path: Path, depth: int = 0) -> dict:
    """A study file's mapping, deep-merged over its ``base:`` study (relative to the file). The
    algorithms' recipe paths are made absolute where they are written, so a base's stay right."""
    raw = yaml.safe_load(path.read_text()) or {}
    for entry in (raw.get("algorithms") or {}).values():
        if isinstance(entry, dict) and "recipe" in entry:
            entry["recipe"] = str((path.parent / entry["recipe"]).resolve())
    base = raw.pop("base", None)
    if base is None:
        return raw
    if depth > 8:
        raise ValueError(f"{path}: the base: chain is longer than 8 files (a loop?)")
    return deep_merge(_read_study(path.parent / base, depth + 1), raw)


def load_study(path: str | Path) -> Study:
    """Reads and checks a study file; errors name the key and the fix."""
    path = Path(path)
    raw = _read_study(path)
    unknown = set(raw) - {"task", "steps", "seeds", "eval", "shared", "algorithms"}
    if unknown:
        raise ValueError(f"{path}: unknown keys {sorted(unknown)}; allowed: base, task, steps, seeds, eval, shared, "
                         f"algorithms")
    algorithms = raw.get("algorithms") or {}
    bad = [a for a in algorithms if a not in ALGORITHMS]
    if bad or not algorithms:
        raise ValueError(f"{path}: algorithms {sorted(algorithms)} must be a non-empty subset of {ALGORITHMS}")
    task = dict(raw.get("task") or {})
    if task.get("kind") not in ("arithmetic", "recipe"):
        raise ValueError(f"{path}: task.kind={task.get('kind')!r}; expected 'arithmetic' or 'recipe'")
    ev = dict(raw.get("eval") or {})
    plan = EvalPlan(every=int(ev.get("every", 0)), prompts=int(ev.get("prompts", 0)), n=int(ev.get("n", 0)),
                    k=tuple(int(k) for k in ev.get("k", [1])), temperature=float(ev.get("temperature", 0.9)))
    if plan.n and max(plan.k) > plan.n:
        raise ValueError(f"{path}: eval.k={list(plan.k)} must be <= eval.n={plan.n}")
    study = Study(name=path.stem, path=path.resolve(), task=task, steps=int(raw.get("steps", 0)),
                  seeds=tuple(int(s) for s in raw.get("seeds", [0])), eval=plan, shared=dict(raw.get("shared") or {}),
                  algorithms={a: dict(v or {}) for a, v in algorithms.items()})
    if study.steps < 1 or not study.seeds:
        raise ValueError(f"{path}: steps={study.steps} must be >= 1 and seeds non-empty")
    for algo in study.algorithms:
        if not study.recipe_of(algo).is_file():
            raise ValueError(f"{path}: algorithms.{algo}.recipe {study.recipe_of(algo)} does not exist")
    return study


def with_sizes(study: Study, *, steps: int | None = None, seeds: tuple[int, ...] | None = None,
               algorithms: tuple[str, ...] | None = None) -> Study:
    """The study with its size changed from the command line (what ``--steps/--seeds/--algos`` do)."""
    import dataclasses

    missing = [a for a in (algorithms or ()) if a not in study.algorithms]
    if missing:
        raise ValueError(f"--algos {','.join(missing)}: not in {study.path} (has {', '.join(study.algorithms)})")
    keep = {a: study.algorithms[a] for a in (algorithms or tuple(study.algorithms))}
    return dataclasses.replace(study, steps=steps or study.steps, seeds=seeds or study.seeds, algorithms=keep)


@dataclass(frozen=True, kw_only=True)
class StudyData:
    """What ``prepare_data`` wrote (empty paths for ``kind: recipe``)."""

    train_file: Path | None
    """Training prompts (jsonl: question, answer)."""
    held_out_root: Path | None
    """Data root holding ``gsm8k/test.jsonl``, the held-out prompts."""
    held_out_count: int
    """Held-out prompts."""
    overlap_removed: int
    """Held-out candidates dropped because the training set holds the same question."""


def _jsonl(rows) -> str:
    return "".join(json.dumps({"question": r.question, "answer": r.gold}) + "\n" for r in rows)


def prepare_data(study: Study, out: Path) -> StudyData:
    """Writes the study's training and held-out prompts under ``out/data`` (arithmetic tasks)."""
    task = study.task
    if task["kind"] == "recipe":
        return StudyData(train_file=None, held_out_root=None, held_out_count=study.eval.prompts, overlap_removed=0)
    sys.path.insert(0, str(REPO))
    from megatron_gtpo.data.arithmetic import arithmetic_examples

    shape = {"max_operand": int(task.get("max_operand", 20)), "num_operands": int(task.get("num_operands", 2)),
             "operators": tuple(task.get("operators", ("+", "-")))}
    train = arithmetic_examples(num_prompts=int(task["train_prompts"]), seed=0, **shape)
    seen = {r.question for r in train}
    wanted = int(task["held_out_prompts"])
    candidates = arithmetic_examples(num_prompts=wanted * 8, seed=1, **shape)
    fresh = [r for r in candidates if r.question not in seen]
    unique = list({r.question: r for r in fresh}.values())[:wanted]
    if len(unique) < wanted:
        raise ValueError(f"task: only {len(unique)} held-out questions differ from the training set; lower "
                         f"task.held_out_prompts or task.train_prompts, or raise task.max_operand")
    data = out / "data"
    (data / "held_out" / HELD_OUT_BENCHMARK).mkdir(parents=True, exist_ok=True)
    (data / "train.jsonl").write_text(_jsonl(train))
    (data / "held_out" / HELD_OUT_BENCHMARK / "test.jsonl").write_text(_jsonl(unique))
    return StudyData(train_file=data / "train.jsonl", held_out_root=data / "held_out", held_out_count=len(unique),
                     overlap_removed=len({r.question for r in candidates} & seen))


def run_recipe(study: Study, algo: str, data: StudyData, *, seed: int) -> dict:
    """The recipe of one run: ``base:`` the algorithm's recipe, then shared, the task's data, the
    evaluation, the seed and the algorithm's own overrides (the last word)."""
    body = deep_merge({}, study.shared)
    if data.train_file is not None:
        body = deep_merge(body, {"data": {"benchmarks": [], "paths": [str(data.train_file)],
                                          "data_root": str(data.held_out_root)}})
    ev = study.eval
    train = {"steps": study.steps, "checkpoint_every": study.steps, "seed": 1234 + seed}
    if ev.every:  # the last step is always evaluated: "after" is the trained policy, not an earlier one
        every = ev.every if study.steps % ev.every == 0 else study.steps
        train.update(eval_every=every, eval_benchmark=HELD_OUT_BENCHMARK,
                     eval_prompts=data.held_out_count or ev.prompts or 16)
    body = deep_merge(body, {"train": train, "rollout": {"seed": seed}, "data": {"seed": seed},
                             "tracking": {"run_name": f"{study.name}-{algo}-s{seed}"}})
    body = deep_merge(body, study.algorithms[algo].get("overrides") or {})
    return {"base": str(study.recipe_of(algo)), **body}


def write_recipe(study: Study, algo: str, data: StudyData, *, seed: int, run_dir: Path) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "recipe.yaml"
    header = (f"# bench/learning.py: study {study.path.name}, algorithm {algo}, seed {seed}\n"
              f"# base: the algorithm's recipe; then the study's shared block and this algorithm's overrides.\n")
    path.write_text(header + yaml.safe_dump(run_recipe(study, algo, data, seed=seed), sort_keys=False))
    return path


def train_argv(recipe: Path, run_dir: Path) -> list[str]:
    """Arguments of ``megatron-gtpo train`` for one run."""
    return ["train", str(recipe), "--output-dir", str(run_dir)]


def eval_argv(*, model: str, hf_config: str, study: Study, data: StudyData, output: Path,
              shared_rollout: dict, mlflow: tuple[str, str, int] | None = None) -> list[str]:
    """Arguments of ``megatron-gtpo eval`` for the pass@k evaluation of ``model`` on the held-out set
    (sampling and context as the training rollouts; logged into the run's MLflow run when given)."""
    ev, vllm = study.eval, shared_rollout.get("vllm", {})
    argv = ["eval", "--model", model, "--benchmarks", HELD_OUT_BENCHMARK, "--data-root", str(data.held_out_root),
            "--n", str(ev.n), "--k", ",".join(map(str, ev.k)), "--temperature", str(ev.temperature),
            "--max-tokens", str(shared_rollout["max_tokens"]), "--template", study.shared["data"]["template"],
            "--seed", "0", "--workers", "1", "--output", str(output), "--save-samples"]
    argv += [f"--vllm={k}={v}" for k, v in vllm.items()]
    if hf_config:
        argv += ["--hf-config", hf_config]
    if mlflow is not None:
        uri, run_id, step = mlflow
        argv += ["--mlflow-tracking-uri", uri, "--mlflow-run-id", run_id, "--mlflow-step", str(step)]
    return argv
