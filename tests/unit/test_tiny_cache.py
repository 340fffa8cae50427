"""The tiny models' cache key (megatron_gtpo/models/tiny.py): a cached model is reused only when
everything its weights depend on is the same.

The bug this catches: a cache keyed by name and seed alone (``tiny-qwen2-char-seed0``) silently
serves the old weights after a change of ``TINY_CONFIG``, of the tokenizer, or of the library that
turns a seed into weights, so tests and reference values run on a model the code no longer builds.
"""

from __future__ import annotations

import json

from megatron_gtpo.models import tiny


def test_key_changes_with_config_tokenizer_and_versions(monkeypatch):
    base = tiny.cache_key(tiny.CHAR_CONFIG, "tok", 0)
    assert base.endswith("-seed0") and tiny.cache_key(tiny.CHAR_CONFIG, "tok", 0) == base  # stable
    assert tiny.cache_key({**tiny.CHAR_CONFIG, "intermediate_size": 512}, "tok", 0) != base
    assert tiny.cache_key(tiny.CHAR_CONFIG, "other tokenizer", 0) != base
    assert tiny.cache_key(tiny.CHAR_CONFIG, "tok", 1) != base
    monkeypatch.setattr(tiny, "version", lambda name: "0.0-other")
    assert tiny.cache_key(tiny.CHAR_CONFIG, "tok", 0) != base
    monkeypatch.setattr(tiny, "BUILD", "another way to seed")
    assert tiny.cache_key(tiny.CHAR_CONFIG, "tok", 0) != base


def test_a_config_change_builds_a_new_model(tmp_path, monkeypatch):
    # A model cached under today's key (stand-in files: reusing them must not build anything).
    key = tiny.cache_key(tiny.CHAR_CONFIG, f"char {tiny.CHAR_SPECIALS} {tiny.CHAR_TEMPLATE}", 0)
    old = tmp_path / f"tiny-qwen2-char-{key}"
    old.mkdir()
    (old / "config.json").write_text("{}")
    (old / "model.safetensors").write_bytes(b"")
    assert tiny.ensure_tiny_char(tmp_path) == old
    monkeypatch.setattr(tiny, "CHAR_CONFIG", {**tiny.CHAR_CONFIG, "intermediate_size": 192})
    new = tiny.ensure_tiny_char(tmp_path)
    assert new != old
    assert json.loads((new / "config.json").read_text())["intermediate_size"] == 192
