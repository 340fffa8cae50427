"""vLLM's per-push "Failed to load weights" warnings for layers a push never carries are dropped;
any other layer's warning stays (utils/vllm_reload.py ExpectedReloadMisses)."""

from __future__ import annotations

import logging

from megatron_gtpo.utils.vllm_reload import RELOAD_LOGGER, ExpectedReloadMisses, quiet_expected_reload_misses


def _record(layer: str, msg: str = "%s: Failed to load weights") -> logging.LogRecord:
    return logging.LogRecord(RELOAD_LOGGER, logging.WARNING, __file__, 1, msg, (layer,), None)


def test_rotary_and_tied_head_misses_are_dropped_others_kept():
    keep = ExpectedReloadMisses().filter
    assert not keep(_record("RotaryEmbedding")) and not keep(_record("Llama3RotaryEmbedding"))
    assert not keep(_record("ParallelLMHead"))
    assert keep(_record("QKVParallelLinear")) and keep(_record("RMSNorm"))
    assert keep(_record("RotaryEmbedding", msg="%s: Delayed processing"))


def test_filter_sits_on_the_logger_vllm_warns_from_and_is_installed_once():
    from vllm.model_executor.model_loader.reload import layerwise

    assert layerwise.logger.name == RELOAD_LOGGER  # fails if vLLM moves the warning
    quiet_expected_reload_misses()
    quiet_expected_reload_misses()
    filters = [f for f in layerwise.logger.filters if isinstance(f, ExpectedReloadMisses)]
    assert len(filters) == 1
    assert not layerwise.logger.filter(_record("RotaryEmbedding")) and layerwise.logger.filter(_record("RMSNorm"))
