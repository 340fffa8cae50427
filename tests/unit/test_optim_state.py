"""Adam state by the rules of the optimizer in use (megatron_gtpo/train/optim_state.py): one contract
test per layout the code may meet on a cluster, through the real Megatron DistributedOptimizer and
dist-checkpointing (single process, CPU): prime -> save -> load -> diagnostics -> the next step.

torch's AdamW is what Megatron builds here; TE's and apex's FusedAdam are the stand-ins of
tests/optim_standins.py (written from their upstream sources, see its docstring), built by
Megatron where it builds the real ones when TE or apex imports."""

from __future__ import annotations

import pytest
import torch

from megatron_gtpo.checkpoint.store import load_checkpoint, save_checkpoint
from megatron_gtpo.parallel.dims import init_distributed
from megatron_gtpo.train.offload import TrainerOffload
from megatron_gtpo.train import optim_state
from megatron_gtpo.train.diagnostics import adam_step, momentum_metrics, small_v_fraction
from megatron_gtpo.train.model import build_model
from megatron_gtpo.train.optim import OptimConfig, build_optimizer, wrap_ddp
from tests.optim_standins import ApexFusedAdam, TEFusedAdam, megatron_uses

HF = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
      "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 64,
      "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
      "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
EXPECTED = {"torch": optim_state.TORCH, "te": optim_state.TE, "apex": optim_state.APEX}


@pytest.fixture(params=["te", "apex", "torch"])
def kind(request):
    """The Adam Megatron builds for the whole test (its save and load paths read the same flags)."""
    with megatron_uses(request.param):
        yield request.param


def _policy(*, distributed: bool = True):
    dims = init_distributed(tp=1, seed=0)
    optim = OptimConfig(optimizer={"optimizer": "adam", "lr": 1e-2, "use_distributed_optimizer": distributed,
                                   "clip_grad": 0.0})
    torch.manual_seed(0)
    chunks = wrap_ddp(build_model(HF, dims=dims), optim)
    optimizer, _ = build_optimizer(chunks, optim, total_steps=8)
    return chunks, optimizer


def _inner(optimizer):
    return optimizer.optimizer


def _step(chunks, optimizer, seed: int) -> None:
    """One optimizer step with seeded gradients (the same on every model built by ``_policy``)."""
    g = torch.Generator().manual_seed(seed)
    for p in chunks[0].parameters():
        p.main_grad.copy_(torch.randn(p.shape, generator=g))
    ok, _, _ = optimizer.step()
    assert ok


def _params(chunks) -> list[torch.Tensor]:
    return [p.detach().clone() for p in chunks[0].parameters()]


def test_te_optimizer_state_prime_save_load_diagnostics(kind, tmp_path):
    """Save after 2 steps, load into a fresh policy (primed in its own layout), read the D3/D4
    diagnostics on both, park the state on the host and back, then take step 3 on both: the
    resumed run is the uninterrupted one bit for bit (moments, main params and Adam's step)."""
    chunks, optimizer = _policy()
    rules = optim_state.adam_rules(_inner(optimizer))
    assert rules is EXPECTED[kind]
    if kind != "torch":
        assert isinstance(_inner(optimizer), {"te": TEFusedAdam, "apex": ApexFusedAdam}[kind])
    norms = []
    for step in (1, 2):
        _step(chunks, optimizer, seed=step)
        norms.append(adam_step(optimizer))
    assert [n.step for n in norms] == [1, 2] and all(n.norm > 0 for n in norms)
    ratio = momentum_metrics(norms)  # D4: ||dtheta_2|| / ||dtheta_1|| next to Adam's momentum-only prediction
    assert ratio["bias/adam_step_ratio"] == norms[1].norm / norms[0].norm and ratio["bias/adam_step_ratio_momentum"] > 0
    save_checkpoint(tmp_path / "ckpt", step=2, model_chunks=chunks, optimizer=optimizer, extra_state={"k": kind},
                    keep_last=1)

    chunks_b, optimizer_b = _policy()
    step, extra = load_checkpoint(tmp_path / "ckpt", model_chunks=chunks_b, optimizer=optimizer_b, step=2)
    assert (step, extra) == (2, {"k": kind})
    inner = _inner(optimizer_b)
    for group in inner.param_groups:
        assert optim_state.step_of(inner, rules, group) == 2
    for state in inner.state.values():  # the layout of the optimizer in use, nothing else
        allowed = set(rules.keys) | ({"step"} if rules.step_per_param else set())
        assert set(state) <= allowed and {"exp_avg", "exp_avg_sq"} <= set(state), state.keys()
    resumed = adam_step(optimizer_b)
    assert (resumed.step, resumed.norm) == (2, norms[1].norm)
    assert small_v_fraction(optimizer_b) == small_v_fraction(optimizer) is not None

    offload = TrainerOffload(chunks_b, optimizer_b)
    held = offload.nbytes
    offload.offload()
    assert offload.nbytes == 0 and held >= 2 * 4 * sum(p.numel() for p in chunks_b[0].parameters())
    offload.reload()

    _step(chunks, optimizer, seed=3)
    _step(chunks_b, optimizer_b, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(_params(chunks), _params(chunks_b)))
    assert adam_step(optimizer_b).step == 3
    save_checkpoint(tmp_path / "ckpt", step=3, model_chunks=chunks_b, optimizer=optimizer_b, extra_state={},
                    keep_last=1)  # and the resumed optimizer checkpoints again


def test_te_optimizer_state_prime_follows_each_layout():
    """Priming a fresh optimizer: torch gets a per-parameter step (Megatron's torch path asserts one),
    TE and apex only their moments, so TE's state_dict() (which unscales every key) works."""
    for kind, rules in EXPECTED.items():
        with megatron_uses(kind):
            chunks, optimizer = _policy(distributed=False)
        inner = _inner(optimizer)
        optim_state.prime(optimizer)
        for state in inner.state.values():
            assert ("step" in state) is rules.step_per_param and float(state["exp_avg_sq"].abs().sum()) == 0
        inner.state_dict()
        assert all(optim_state.step_of(inner, rules, g) == 0 for g in inner.param_groups)


def test_te_optimizer_state_step_lives_in_the_param_group():
    """After a step the stand-ins keep Adam's step where TE and apex do, and TE's state_dict refuses
    any other per-parameter key, as TE 2.11's does (name_to_dtype_map)."""
    weights = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.zeros(2))]
    for cls in (TEFusedAdam, ApexFusedAdam):
        opt = cls(weights, lr=0.1)
        for p in weights:
            p.grad = torch.ones_like(p)
        opt.step()
        assert opt.param_groups[0]["step"] == 1 and all(set(opt.state[p]) == {"exp_avg", "exp_avg_sq"} for p in weights)
        assert optim_state.step_of(opt, optim_state.adam_rules(opt), opt.param_groups[0]) == 1
    opt.state[weights[0]]["step"] = torch.tensor(1.0)  # what the old priming added
    TEFusedAdam(weights).state_dict()  # no state yet: fine
    te = TEFusedAdam(weights)
    te.state[weights[0]].update(exp_avg=torch.zeros(3), exp_avg_sq=torch.zeros(3), step=torch.tensor(0.0))
    with pytest.raises(KeyError, match="step"):
        te.state_dict()


def test_te_optimizer_state_update_matches_torch_adamw():
    """The stand-ins' update is Adam's (AdamW mode): the same trajectory as torch.optim.AdamW."""
    start = torch.randn(5, generator=torch.Generator().manual_seed(0))
    results = {}
    for cls in (torch.optim.AdamW, TEFusedAdam, ApexFusedAdam):
        w = torch.nn.Parameter(start.clone())
        opt = cls([w], lr=0.05, weight_decay=0.1)
        for k in range(3):
            w.grad = torch.full_like(w, 0.5 * (k + 1))
            opt.step()
        results[cls.__name__] = w.detach()
    ref = results.pop("AdamW")
    for name, got in results.items():
        assert torch.allclose(got, ref, atol=1e-6), (name, got, ref)


def test_te_optimizer_state_gpu_smoke_part_on_cpu(tmp_path):
    """bench/gpu_smoke.py's optim_state part (what the GPU machine runs with the Adam it has) on CPU with
    the TE stand-in: it must report TE's layout (step in the param group, moments only)."""
    from bench.gpu_smoke_parts import Smoke
    from bench.gpu_smoke_setup import TINY, SmokeConfig

    cfg = SmokeConfig(**{**TINY, "layers": 1, "rows": 4, "group": 2, "micro_batch": 2}, device="cpu")
    with megatron_uses("te"):
        smoke = Smoke(cfg, init_distributed(tp=1, seed=0), tmp_path)
        report = smoke.part_optim_state()
    assert report["rules"] == optim_state.TE.name and report["step_in"] == "param group"
    assert report["state_keys"] == ["exp_avg", "exp_avg_sq"] and report["optimizer"].endswith("TEFusedAdam")
    assert report["abs_loss_resumed_vs_uninterrupted"] == 0.0 and report["adam_norm_loaded"] == report["adam_norm_saved"]


def test_a_save_keeps_megatron_write_results_in_this_process(tmp_path):
    """Catches every run's first save waiting on a spawned multiprocessing Manager (~3.3 s per rank
    of the tiny recipe while it imported torch, and one more process per rank) that Megatron's
    writer creates for its results queue on first use: the save must hand Megatron an in-process
    queue (checkpoint/store.py) and leave no helper process behind. A Megatron that stopped reading
    ``filesystem_async._results_queue`` would start the Manager again: this fails then too."""
    import queue

    import psutil
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    chunks, optimizer = _policy()
    _step(chunks, optimizer, seed=1)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    save_checkpoint(tmp_path / "ckpt", step=1, model_chunks=chunks, optimizer=optimizer, extra_state={}, keep_last=1)
    assert isinstance(filesystem_async._get_write_results_queue(), queue.Queue)
    helpers = [p for p in psutil.Process().children(recursive=True) if p.pid not in before and p.is_running()
               and p.status() != psutil.STATUS_ZOMBIE]
    assert helpers == [], [p.cmdline() for p in helpers]
