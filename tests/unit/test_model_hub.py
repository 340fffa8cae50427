"""Hugging Face hub ids as model.path (models/hub.py), on a hub cache the test builds (tests/hub_cache.py).

Never the network: every test runs offline (HF_HUB_OFFLINE), so a lookup that missed the cache
would fail instead of downloading.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from huggingface_hub import constants

from megatron_gtpo.cli import dry_run
from megatron_gtpo.models.hub import CONFIG_ONLY, METADATA, is_hub_id
from megatron_gtpo.models.resolve import resolve_model
from tests.helpers import REPO, child_env
from tests.hub_cache import add_to_hub_cache, offline_hub

QWEN = "Qwen/Qwen2.5-3B-Instruct"
QWEN_CONFIG = REPO / "configs" / "models" / "qwen2.5-3b-instruct.json"


@pytest.fixture
def hf_home(tmp_path, monkeypatch) -> Path:
    """HF_HOME of this test, offline."""
    return offline_hub(tmp_path / "hf", monkeypatch)


def test_hub_ids_and_paths_are_told_apart(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "local").mkdir(parents=True)
    assert is_hub_id(QWEN) and is_hub_id("meta-llama/Llama-3.2-3B-Instruct")
    assert not is_hub_id("org/local")  # an existing relative directory is a path
    assert not any(map(is_hub_id, ["/models/qwen", "./a/b", "smollm2", "a/b/c", "runs/"]))


def test_dry_run_sizes_a_hub_id_from_the_cache_with_only_config_json(hf_home, capsys, monkeypatch):
    """`dry-run` with model.path=Qwen/Qwen2.5-3B-Instruct read nothing but a local directory ("no
    such directory; pass --hf-config"). Injected bug: `resolve_model` without its hub branch -> exit
    2, fails."""
    monkeypatch.chdir(REPO)
    snapshot = add_to_hub_cache(hf_home, QWEN, {"config.json": QWEN_CONFIG})
    assert resolve_model(QWEN, hub_files=CONFIG_ONLY) == snapshot
    code = dry_run.main(["configs/gpu/gtpo_qwen2.5-3b_1x8.yaml", "--nodes", "1", "--gpus-per-node", "8",
                         f"model.path={QWEN}"])
    out = capsys.readouterr()
    assert code == 0, out.out + out.err
    assert "36 layers, hidden 2048, 16 heads / 2 KV heads x 128, vocab 151936" in out.out


def test_training_needs_the_weights_and_offline_names_the_download_command(hf_home):
    """A snapshot holding only config.json (what a dry-run fetches) is not a model to train, and a
    missing one offline says which command fills the cache. Injected bug: `_cached` without the
    weights check -> the config-only snapshot is returned for training, fails."""
    add_to_hub_cache(hf_home, QWEN, {"config.json": QWEN_CONFIG})
    with pytest.raises(FileNotFoundError) as err:
        resolve_model(QWEN)  # the whole model: weights needed
    assert f"`hf download {QWEN}`" in str(err.value) and "HF_HUB_OFFLINE" in str(err.value)
    with pytest.raises(FileNotFoundError) as err:
        resolve_model(QWEN, hub_files=METADATA)  # train --dry-run: the tokenizer is missing
    assert "--include 'tokenizer*'" in str(err.value)
    with pytest.raises(FileNotFoundError) as err:
        resolve_model("meta-llama/Llama-3.2-3B-Instruct", hub_files=CONFIG_ONLY)
    assert "hf download meta-llama/Llama-3.2-3B-Instruct --include 'config.json'" in str(err.value)
    assert str(Path(constants.HF_HUB_CACHE)) in str(err.value)
    add_to_hub_cache(hf_home, QWEN, {"model.safetensors": b"weights"})
    assert (resolve_model(QWEN) / "model.safetensors").read_bytes() == b"weights"


def test_train_dry_run_of_a_gpu_recipe_with_its_hub_id_from_the_cache(tmp_path):
    """`megatron-gtpo train configs/gpu/gtpo_qwen2.5-3b_1x8.yaml --dry-run` with the recipe's own
    model.path (a hub id) and HF_HOME pointing at a cache holding config.json and a tokenizer (the
    shipped SmolLM2 tokenizer stands in for Qwen's: the check tokenises the prompts). On CPU the
    recipe's TE-only RoPE fusion is switched off (TransformerConfig refuses it without TE).
    Injected bug: preflight resolving with hub_files=CONFIG_ONLY -> no tokenizer, exit 2, fails."""
    tokenizer = resolve_model("smollm2")
    add_to_hub_cache(tmp_path / "hf", QWEN, {"config.json": QWEN_CONFIG,
                                              **{n: tokenizer / n for n in ("tokenizer.json", "tokenizer_config.json",
                                                                    "chat_template.jinja")}})
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_gtpo.cli", "train", "configs/gpu/gtpo_qwen2.5-3b_1x8.yaml", "--dry-run",
         "--output-dir", str(tmp_path / "run"), "model.megatron.apply_rope_fusion=false"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
        env=child_env(HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "models--Qwen--Qwen2.5-3B-Instruct/snapshots/" in proc.stdout
    assert "dry run: configuration, model, data and layout are valid" in proc.stdout
