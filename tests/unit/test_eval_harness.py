"""The evaluation loop and CLI with a scripted ``generate`` (no vLLM): metrics, report, table, errors."""

import json

import pytest

from megatron_gtpo.cli import eval as cli
from megatron_gtpo.data import SHIPPED_DATA
from megatron_gtpo.eval.config import EvalConfig
from megatron_gtpo.eval.harness import _check_completions, format_table, mlflow_metrics
from megatron_gtpo.reward.extract import gold_answer
from megatron_gtpo.types import Completion
from tests.unit.data_tokenizer import tiny_tokenizer


def _wrong(answer: str) -> str:
    return "ABCD"[("ABCD".index(answer) + 1) % 4] if answer in "ABCD" else str(int(answer) + 1)


def scripted_generate(prompts, sampling, *, seed=None):
    """Even-numbered samples answer right, odd ones wrong (so c = ceil(n/2) for every problem)."""
    out, n = [], sampling.n
    for i, prompt in enumerate(prompts):
        answer = gold_answer(prompt.gold, prompt.task)
        for j in range(n):
            text = f"So the answer is \\boxed{{{answer if j % 2 == 0 else _wrong(answer)}}}."
            out.append(Completion(prompt_index=i, prompt_token_ids=prompt.token_ids, token_ids=[1] * (j + 1),
                                  logprobs=[0.0] * (j + 1), text=text, finish_reason="length" if j == 3 else "stop",
                                  truncated=j == 3))
    return out


def test_run_reports_the_expected_metrics(tmp_path):
    output = tmp_path / "out" / "report.json"
    config = EvalConfig(model="scripted", benchmarks=["gsm8k", "mmlu", "aime24"], n=4, k=[1, 2, 4], limit=3,
                        workers=0, output=str(output), save_samples=True, data_root=str(SHIPPED_DATA),
                        chunk_samples=8)
    report = cli.run(config, generate=scripted_generate, tokenizer=tiny_tokenizer())
    assert [r.name for r in report.results] == ["gsm8k", "mmlu_stem", "aime24"]
    for r in report.results:
        assert r.num_problems == 3 and r.n == 4 and r.num_timeouts == 0 and r.num_errors == 0
        assert r.metrics["pass@1"] == pytest.approx(0.5)
        assert r.metrics["pass@2"] == pytest.approx(1 - 1 / 6)  # 1 - C(2,2)/C(4,2)
        assert r.metrics["pass@4"] == 1.0
        assert r.metrics["maj@4"] == 1.0  # 2-2 tie: the earliest answer (sample 0, right) wins
        assert r.metrics["mean@1"] == 1.0 and r.metrics["mean@4"] == pytest.approx(0.5)
        assert r.truncated_rate == pytest.approx(0.25) and r.mean_completion_tokens == pytest.approx(2.5)
        assert r.no_answer_rate == 0.0
    saved = json.loads(output.read_text())
    assert saved["benchmarks"]["gsm8k"]["metrics"] == report.results[0].metrics
    assert saved["config"]["n"] == 4 and saved["model"] == "scripted"
    rows = [json.loads(line) for line in output.with_suffix(".samples.jsonl").read_text().splitlines()]
    assert len(rows) == 3 * 3 * 4 and sum(r["correct"] for r in rows) == 18
    assert [p.name for p in output.parent.iterdir() if p.name.startswith(".")] == []  # no temp files left


def test_table_and_mlflow_names():
    from megatron_gtpo.eval.harness import BenchmarkResult

    result = BenchmarkResult(name="gsm8k", num_problems=3, num_too_long=0, n=4,
                             metrics={"pass@1": 0.5, "maj@1": 0.25, "mean@1": 1.0})
    table = format_table([result], [1])
    assert "pass@1" in table.splitlines()[0] and "50.0" in table and "25.0" in table and "100.0" in table
    names = mlflow_metrics([result])
    assert names["eval/gsm8k/pass_at_1"] == 0.5 and all("@" not in k for k in names)


def test_engine_output_is_checked():
    prompts_n = 2

    def completion(i):
        return Completion(prompt_index=i, prompt_token_ids=[1], token_ids=[1], logprobs=[0.0])

    assert len(_check_completions([completion(0), completion(1)], prompts_n, 1)) == 2
    with pytest.raises(RuntimeError, match="expected n=2"):
        _check_completions([completion(0), completion(0), completion(1)], prompts_n, 2)
    with pytest.raises(RuntimeError, match="prompt_index=5"):
        _check_completions([completion(5)], prompts_n, 1)


def test_cli_help_lists_every_config_field(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--model", "--benchmarks", "--n ", "--k ", "--max-tokens", "--mlflow-run-id", "--vllm"):
        assert flag in out
    assert "pass@k" in out


def test_cli_flags_become_a_validated_config():
    args = cli.build_parser().parse_args(["--model", "m", "--benchmarks", "gsm8k, mmlu", "--n", "8", "--k", "8,1",
                                          "--temperature", "1", "--no-use-chat-template",
                                          "--vllm", "max_model_len=2048", "--vllm", "dtype=float32"])
    config = cli.config_from_args(args)
    assert config.benchmarks == ["gsm8k", "mmlu_stem"] and config.n == 8 and config.k == [1, 8]
    assert config.temperature == 1.0 and config.use_chat_template is False
    assert config.vllm == {"max_model_len": 2048, "dtype": "float32"}


@pytest.mark.parametrize("argv,message", [
    (["--model", "m", "--n", "4", "--k", "1,8"], "k=[1, 8] is not allowed"),
    (["--model", "m", "--benchmarks", "gsm9k"], "unknown benchmark 'gsm9k'"),
    (["--model", "m", "--top-p", "0"], "top_p=0"),
    (["--model", "m", "--vllm", "oops"], "--vllm 'oops' must look like KEY=VALUE"),
    (["--model", "/nonexistent/model"], "neither an HF model directory"),
])
def test_cli_bad_input_exits_2_naming_the_flag(argv, message, capsys):
    assert cli.main(argv) == cli.EXIT_BAD_INPUT
    assert message in capsys.readouterr().err


def test_a_failed_run_leaves_no_report_and_no_partial_samples(tmp_path):
    calls = []

    def failing_generate(prompts, sampling, **kwargs):
        calls.append(len(prompts))
        if len(calls) == 2:
            raise RuntimeError("engine died")
        return scripted_generate(prompts, sampling, **kwargs)

    output = tmp_path / "report.json"
    config = EvalConfig(model="scripted", benchmarks=["gsm8k"], n=2, k=[1], limit=4, workers=0, chunk_samples=4,
                        output=str(output), save_samples=True, data_root=str(SHIPPED_DATA))
    with pytest.raises(RuntimeError, match="engine died"):
        cli.run(config, generate=failing_generate, tokenizer=tiny_tokenizer())
    assert calls == [2, 2] and list(tmp_path.iterdir()) == []


def test_run_uses_a_given_scorer_and_leaves_it_open(tmp_path):
    from megatron_gtpo.reward import RewardConfig, RewardScorer

    config = EvalConfig(model="scripted", benchmarks=["gsm8k"], n=2, k=[1, 2], limit=2, workers=0,
                        output=str(tmp_path / "r.json"), data_root=str(SHIPPED_DATA))
    with RewardScorer(RewardConfig(fn="correctness", num_workers=0)) as scorer:
        calls = []
        real = scorer.score
        scorer.score = lambda items, **kw: calls.append(len(items)) or real(items, **kw)
        report = cli.run(config, generate=scripted_generate, tokenizer=tiny_tokenizer(), scorer=scorer)
        assert calls == [4] and report.results[0].metrics["pass@1"] == pytest.approx(0.5)
        assert scorer.score([("\\boxed{1}", "1", "math")])[0].correct  # still open after the run


def test_engine_defaults_on_cpu(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    config = EvalConfig(model="tiny", vllm={"max_model_len": 512})
    assert cli.engine_vllm_kwargs(config) == {"block_size": cli.CPU_KV_BLOCK_TOKENS, "max_model_len": 512}
    assert cli.engine_vllm_kwargs(EvalConfig(model="tiny", vllm={"block_size": 128}))["block_size"] == 128
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cli.engine_vllm_kwargs(config) == {"max_model_len": 512}  # GPUs keep vLLM's own default


SPY = """
import os, sys
class Spy:  # records the wait policy at the moment torch starts loading
    def find_spec(self, name, path=None, target=None):
        if name == "torch" and "policy" not in globals():
            globals()["policy"] = os.environ.get("OMP_WAIT_POLICY", "<unset>")
        return None
sys.meta_path.insert(0, Spy())
import megatron_gtpo.cli.eval
print(policy)
"""


@pytest.mark.parametrize("preset, expected", [(None, "PASSIVE"), ("ACTIVE", "ACTIVE")])
def test_openmp_wait_policy_is_set_before_torch_loads(preset, expected):
    import os
    import subprocess
    import sys

    from tests.helpers import REPO

    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if preset:
        env["OMP_WAIT_POLICY"] = preset  # the user's setting wins
    out = subprocess.run([sys.executable, "-c", SPY], env={**env, "PYTHONPATH": str(REPO)}, capture_output=True,
                         text=True, timeout=300, check=True).stdout.split()
    assert out[-1:] == [expected]
