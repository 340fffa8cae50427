"""The separate transport's engine process: a start-up failure reaches the trainer as a clear error
(with the engine's traceback) instead of a hang. The working paths run in test_sync_megatron.py."""

from __future__ import annotations

import json

import pytest


@pytest.mark.slow
def test_engine_process_start_failure_is_reported(tmp_path):
    from megatron_gtpo.sync import EngineProcessError, SeparateEngine

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["NoSuchModelForCausalLM"],
                                                      "model_type": "no_such_model"}))
    with pytest.raises(EngineProcessError, match="failed to start") as err:
        SeparateEngine(model_dir=str(tmp_path), vllm_kwargs={"max_model_len": 64}, timeout_s=300)
    assert "Traceback" in str(err.value) and "no_such_model" in str(err.value)
