"""GPU rules the CPU suite enforces: settings that would break or slow the first GPU run are refused
at validation time (naming the key and the fix), and the GPU recipes set what their stack needs."""

from __future__ import annotations

import pytest

from megatron_gtpo.config import load_config
from megatron_gtpo.plan.preflight import check_fusions, check_rollout_servers
from megatron_gtpo.sync.config import SyncConfig
from megatron_gtpo.train.optim import OptimConfig
from megatron_gtpo.utils.configuration import ConfigError
from tests.helpers import REPO

RECIPES = sorted((REPO / "configs" / "gpu").glob("*.yaml"))


@pytest.mark.parametrize("section", ["optimizer", "ddp"])
def test_deferred_parameter_gather_is_refused(section):
    """With overlap_param_gather the updated shards are gathered in the next forward: the push right
    after the step would send the pre-update weights of every shard a rank does not own."""
    with pytest.raises(ConfigError, match=rf"{section}\.overlap_param_gather=True is not allowed: .*pre-update"):
        OptimConfig(**{section: {**getattr(OptimConfig(), section), "overlap_param_gather": True}})
    with pytest.raises(ConfigError, match="optim.optimizer.overlap_param_gather"):
        load_config(str(REPO / "configs" / "tiny.yaml"),
                    ["optim.optimizer={optimizer: adam, lr: 1.0e-6, overlap_param_gather: true}"])


def test_separate_pool_on_gpu_needs_rollout_servers(monkeypatch):
    monkeypatch.delenv("MGTPO_ROLLOUT_HOSTS", raising=False)
    separate = SyncConfig(transport="separate")
    with pytest.raises(ConfigError, match=r"ROLLOUT_NODES=N .* MGTPO_ROLLOUT_HOSTS\), or set sync\.servers"):
        check_rollout_servers(separate, on_gpu=True)
    check_rollout_servers(separate, on_gpu=False)  # CPU: rank 0 starts local servers (tests, laptops)
    check_rollout_servers(SyncConfig(), on_gpu=True)  # colocated
    check_rollout_servers(SyncConfig(transport="separate", servers=["node7:29650"]), on_gpu=True)
    monkeypatch.setenv("MGTPO_ROLLOUT_HOSTS", "10.0.0.5,10.0.0.6")  # what train.sbatch exports with ROLLOUT_NODES
    check_rollout_servers(separate, on_gpu=True)


def test_gradient_accumulation_fusion_needs_apex_kernel():
    check_fusions({}, on_gpu=True)
    with pytest.raises(ConfigError, match="gradient_accumulation_fusion=true needs apex's fused_weight_gradient"):
        check_fusions({"gradient_accumulation_fusion": True}, on_gpu=False)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_gpu_recipes_fuse_rope_and_seed_requests(recipe, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cfg = load_config(str(recipe))
    assert cfg.model.megatron.get("apply_rope_fusion") is True
    assert not cfg.model.megatron.get("gradient_accumulation_fusion")  # no apex in requirements/gpu.lock
    assert cfg.rollout.seeded_requests() is True  # vLLM V2: seeded sampling is one batched kernel
