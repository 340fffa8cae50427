"""Checks that run before start-up (``megatron-gtpo train ... [--dry-run]``, ``megatron-gtpo dry-run``):
recipe base: loops, vLLM engine arguments, context length, greedy groups, prompts that are all too
long, and unusable output directories. Each one fails in seconds with exit status 2 and a message
naming the key and the fix, before any rank or engine starts."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import os
import subprocess
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from megatron_gtpo.config import load_config
from megatron_gtpo.data.config import DataConfig
from megatron_gtpo.cli import train as train_cli
from megatron_gtpo.plan.engine_args import check_vllm_kwargs, context_problem, vllm_args
from megatron_gtpo.plan.preflight import check_context, check_output_dir, check_prompts
from megatron_gtpo.rollout.config import RolloutConfig
from megatron_gtpo.utils.configuration import ConfigError, load_recipe
from tests.helpers import REPO
from tests.unit.data_tokenizer import tiny_tokenizer

TINY = str(REPO / "configs" / "tiny.yaml")


# ----------------------------------------------------------------------------- recipes

def test_base_chain_that_loops_is_a_config_error_naming_the_files(tmp_path):
    (tmp_path / "self.yaml").write_text("base: self.yaml\nrollout:\n  n: 4\n")
    with pytest.raises(ConfigError, match=r"chain loops back on itself: .*self.yaml -> .*self.yaml"):
        load_recipe(tmp_path / "self.yaml")
    (tmp_path / "a.yaml").write_text("base: b.yaml\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\n")
    with pytest.raises(ConfigError) as err:
        load_recipe(tmp_path / "a.yaml")
    assert f"{tmp_path / 'a.yaml'} -> {tmp_path / 'b.yaml'} -> {tmp_path / 'a.yaml'}" in str(err.value)
    # a diamond is no loop: two files may share a base
    (tmp_path / "root.yaml").write_text("rollout:\n  n: 3\n")
    (tmp_path / "mid.yaml").write_text("base: root.yaml\n")
    (tmp_path / "top.yaml").write_text("base: mid.yaml\nrollout:\n  max_tokens: 7\n")
    assert load_recipe(tmp_path / "top.yaml") == {"rollout": {"n": 3, "max_tokens": 7}}
    (tmp_path / "missing.yaml").write_text("base: nope.yaml\n")
    with pytest.raises(ConfigError, match=r"nope.yaml \(base: of .*missing.yaml\) does not exist"):
        load_recipe(tmp_path / "missing.yaml")


def test_greedy_sampling_of_a_group_is_rejected():
    with pytest.raises(ConfigError, match=r"temperature=0.0 is not allowed: expected a float > 0 with n=4"):
        RolloutConfig(n=4, temperature=0.0)
    assert RolloutConfig(n=1, temperature=0.0).temperature == 0.0  # a single greedy sample is fine
    assert RolloutConfig(n=2, temperature=1e-3).temperature == 1e-3


# ----------------------------------------------------------------------------- vLLM engine arguments

def test_vllm_keys_are_checked_against_vllms_own_arguments():
    check_vllm_kwargs({"dtype": "float32", "max_model_len": 512, "kv_cache_memory_bytes": 1 << 26,
                       "enable_sleep_mode": True, "gpu_memory_utilization": 0.5, "load_format": "dummy",
                       "logprobs_mode": "processed_logprobs", "distributed_executor_backend": "external_launcher",
                       "chat_template": "x", "compilation_config": {"level": 0}, "max_num_seqs": None})
    with pytest.raises(ConfigError) as err:
        check_vllm_kwargs({"max_model_length": 512})
    assert "unknown vLLM engine argument rollout.vllm.max_model_length (did you mean max_model_len" in str(err.value)
    with pytest.raises(ConfigError, match="unknown vLLM engine arguments rollout.vllm.gpu_mem_util .*rollout.vllm.xyz"):
        check_vllm_kwargs({"gpu_mem_util": 0.5, "xyz": 1})


@pytest.mark.parametrize("key, value, expected", [
    ("max_model_len", "512", "rollout.vllm.max_model_len='512' (str) does not match vLLM's type for it, int"),
    ("enable_sleep_mode", "yes", "bool"),
    ("gpu_memory_utilization", "0.5", "float"),
    ("kv_cache_memory_bytes", 6.4e7, "int | None"),
    ("dtype", "fp32", "Literal['auto', 'half', 'float16', 'bfloat16', 'float', 'float32']"),
    ("logprobs_mode", "processed", "processed_logprobs"),
])
def test_vllm_values_of_the_wrong_type_are_rejected(key, value, expected):
    with pytest.raises(ConfigError) as err:
        check_vllm_kwargs({key: value})
    assert expected in str(err.value) and f"rollout.vllm.{key}" in str(err.value)


def test_vllm_names_read_from_source_match_the_imported_classes():
    """The fast path (ast over vLLM's source) must list exactly what vLLM itself accepts."""
    from vllm import LLM
    from vllm.engine.arg_utils import EngineArgs

    known = vllm_args()
    names = {f.name for f in dataclasses.fields(EngineArgs)}
    names |= {p for p in inspect.signature(LLM.__init__).parameters if p not in ("self", "model", "kwargs")}
    assert set(known.annotations) == names


# ----------------------------------------------------------------------------- context, prompts, output dir

def test_context_problem_names_both_numbers_and_the_fix():
    assert context_problem(context=512, source="rollout.vllm.max_model_len", max_prompt_tokens=256,
                           max_tokens=256) is None
    text = context_problem(context=512, source="rollout.vllm.max_model_len", max_prompt_tokens=400, max_tokens=200)
    assert text == ("max prompt + completion tokens = data.max_prompt_tokens + rollout.max_tokens = 400 + 200 = 600 "
                    "exceeds rollout.vllm.max_model_len=512: lower data.max_prompt_tokens to 312 or "
                    "rollout.max_tokens to 112, or raise rollout.vllm.max_model_len to 600")
    text = context_problem(context=100, source="the model's max_position_embeddings", max_prompt_tokens=50,
                           max_tokens=100)
    assert text.endswith("exceeds the model's max_position_embeddings=100: lower rollout.max_tokens to 50")


def test_an_engine_context_past_the_model_positions_is_refused_before_the_start(monkeypatch):
    cfg = load_config(REPO / "configs" / "tiny.yaml", ["rollout.vllm.max_model_len=704", "rollout.max_tokens=384"])
    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    with pytest.raises(ConfigError, match=r"rollout.vllm.max_model_len=704 exceeds the model's "
                                          r"max_position_embeddings=512: .* set rollout.vllm.max_model_len <= 512"):
        check_context(cfg, {"max_position_embeddings": 512})
    assert check_context(cfg, {"max_position_embeddings": 1024}) == 704
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")  # vLLM's own escape hatch: the user asked for it
    assert check_context(cfg, {"max_position_embeddings": 512}) == 704


def _jsonl(path: Path, questions: list[str]) -> Path:
    path.write_text("".join(json.dumps({"question": q, "answer": "#### 1"}) + "\n" for q in questions))
    return path


def test_prompts_that_are_all_too_long_are_rejected_with_the_longest_length(tmp_path):
    tiny_tokenizer().save_pretrained(tmp_path / "tok")
    data = _jsonl(tmp_path / "d.jsonl", ["short?", "word " * 50, "word " * 80])
    cfg = DataConfig(benchmarks=[], paths=[str(data)], template="plain", max_prompt_tokens=40)
    stats = check_prompts(cfg, tokenizer_dir=tmp_path / "tok")
    assert (stats.num_rows, stats.num_prompts, stats.num_too_long) == (3, 1, 2)
    longest = stats.longest_tokens
    assert longest > 80
    cfg = dataclasses.replace(cfg, max_prompt_tokens=5)
    with pytest.raises(ConfigError) as err:
        check_prompts(cfg, tokenizer_dir=tmp_path / "tok")
    assert (f"data: all 3 prompts are longer than data.max_prompt_tokens=5 tokens after the template "
            f"(longest {longest} tokens); raise data.max_prompt_tokens") in str(err.value)
    with pytest.raises(ConfigError, match="no Hugging Face tokenizer in"):
        check_prompts(cfg, tokenizer_dir=tmp_path)


def test_output_dir_must_be_a_writable_directory(tmp_path):
    check_output_dir(str(tmp_path / "new" / "run"))
    assert not (tmp_path / "new").exists() and not list(tmp_path.iterdir())  # nothing created, probe removed
    check_output_dir(str(tmp_path))
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match=r"output_dir='.*file' is an existing file, not a directory"):
        check_output_dir(str(tmp_path / "file"))
    with pytest.raises(ConfigError, match=r"output_dir='.*file/run' cannot be created: .*file is a file"):
        check_output_dir(str(tmp_path / "file" / "run"))


@pytest.mark.skipif(not Path("/sys").is_dir(), reason="needs sysfs, where nobody (root included) creates files")
def test_output_dir_that_is_not_writable_is_rejected():
    with pytest.raises(ConfigError, match=r"output_dir='/sys/gtpo-run' cannot be created: /sys is not writable"):
        check_output_dir("/sys/gtpo-run")


def test_output_dir_without_write_permission_is_rejected(tmp_path):
    """A directory without the write bit is refused. Root writes anywhere, so as root (CI runs as
    root) the check runs with the effective uid of ``nobody``, in a directory nobody may traverse;
    a writable sibling passes as the control."""
    root = Path(tempfile.mkdtemp(prefix="mgtpo-ro-")) if os.geteuid() == 0 else tmp_path
    try:
        root.chmod(0o755)
        for name, mode in (("ro", 0o555), ("rw", 0o777)):
            (root / name).mkdir()
            (root / name).chmod(mode)  # not mkdir's mode: the umask would mask it
        with _as_nobody():
            check_output_dir(str(root / "rw"))  # the control: the same check passes where writing works
            with pytest.raises(ConfigError, match="is not writable"):
                check_output_dir(str(root / "ro"))
    finally:
        if root != tmp_path:
            shutil.rmtree(root)


@contextlib.contextmanager
def _as_nobody():
    if os.geteuid() != 0:
        yield
        return
    os.seteuid(65534)
    try:
        yield
    finally:
        os.seteuid(0)


# ----------------------------------------------------------------------------- the CLI, end to end

@pytest.fixture
def small_data(tmp_path):
    """tiny.yaml on a few short prompts of its own (no shared data needed)."""
    path = _jsonl(tmp_path / "train.jsonl", [f"What is {i} + 1?" for i in range(6)] + ["word " * 100])
    return ["data.benchmarks=[]", f"data.paths=[{path}]", f"--output-dir={tmp_path / 'run'}"]


def _dry_run(capsys, *argv: str) -> tuple[int, str]:
    code = train_cli.main([TINY, "--dry-run", *argv])
    out = capsys.readouterr()
    return code, out.out + out.err


def test_dry_run_of_a_valid_recipe_reports_dropped_prompts(capsys, small_data):
    code, out = _dry_run(capsys, *small_data)
    assert code == 0, out
    assert "prompts: 6 of 7 rows kept, 1 dropped as too long > data.max_prompt_tokens=256" in out
    assert "context 512 tokens" in out


@pytest.mark.parametrize("override, message", [
    ("rollout.vllm.max_model_length=512", "unknown vLLM engine argument rollout.vllm.max_model_length (did you mean "
                                          "max_model_len"),
    ("rollout.vllm.enforce_eager=maybe", "rollout.vllm.enforce_eager='maybe' (str) does not match"),
    ("rollout.vllm.max_model_len=200", "= 256 + 24 = 280 exceeds rollout.vllm.max_model_len=200: lower "
                                       "data.max_prompt_tokens to 176"),
    ("data.max_prompt_tokens=600", "= 600 + 24 = 624 exceeds rollout.vllm.max_model_len=512"),
    ("rollout.temperature=0", "rollout.temperature=0.0 is not allowed: expected a float > 0 with n=4"),
    ("data.max_prompt_tokens=3", "data: all 7 prompts are longer than data.max_prompt_tokens=3 tokens"),
])
def test_dry_run_rejects_bad_input_with_exit_2(capsys, small_data, override, message):
    code, out = _dry_run(capsys, *small_data, override)
    assert code == 2, out
    assert message in out


def test_dry_run_rejects_an_output_dir_that_is_a_file(capsys, small_data, tmp_path):
    (tmp_path / "taken").write_text("")
    code, out = _dry_run(capsys, *small_data, f"--output-dir={tmp_path / 'taken'}")
    assert code == 2 and "is an existing file, not a directory" in out


def test_dry_run_cli_exits_2_on_a_recipe_whose_base_loops(tmp_path):
    (tmp_path / "loop.yaml").write_text("base: loop.yaml\n")
    proc = subprocess.run([sys.executable, "-m", "megatron_gtpo.cli", "train", str(tmp_path / "loop.yaml"),
                           "--dry-run"], capture_output=True, text=True, timeout=300, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "megatron-gtpo train: error: recipe base: chain loops back on itself" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_layout_dry_run_checks_vllm_arguments_and_max_model_len(capsys):
    from megatron_gtpo.cli import dry_run as dryrun

    common = [TINY, "--nodes", "1", "--gpus-per-node", "2"]
    assert dryrun.main([*common, "rollout.vllm.max_modl_len=9"]) == dryrun.EXIT_BAD_INPUT
    assert "did you mean max_model_len" in capsys.readouterr().err
    assert dryrun.main([*common, "rollout.vllm.max_model_len=100"]) == dryrun.EXIT_IMPOSSIBLE
    assert "exceeds rollout.vllm.max_model_len=100" in capsys.readouterr().out
    assert load_config(TINY).rollout.vllm["max_model_len"] == 512
