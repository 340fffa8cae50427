"""LoRA on the Megatron policy at TP=2, PP=2 and DP=2 against one process, on 2 gloo ranks.

Usage: torchrun --nproc_per_node=2 lora_layouts.py WORK_DIR (checkpoints go under it)

Phase 0 (every rank alone): a TP1/PP1 Qwen2-shaped model (q/k/v biases, GQA) with adapters on all
four layers, random B, plain autograd on the whole batch: loss, adapter gradients, merged weights,
one AdamW step. Then per layout (TP, PP) in (2, 1), (1, 2), (1, 1) (DP = 2 / (TP * PP)): the same
weights and adapters, Megatron DDP + distributed optimizer, Megatron's schedule over micro-batches
of the rank's DP slice; one ``RESULT`` line per check:

  lora_init     adapters as initialised equal the one-process initialisation (TP/PP independent)
  lora_gather   TP-gathered adapters equal the global ones; the dist-checkpoint entries' global
                shapes/offsets hold exactly the global adapters' slices (fc1's B in [gate; up])
  lora_merged   every merged local shard equals the TP slice of the one-process merged weight
  lora_frozen   only adapters require grad; DDP's buffers and the optimizer hold adapters only, and
                (after the step) the optimizer state covers exactly this rank's adapter shards
  lora_step     loss, every adapter gradient (DDP main grads), the optimizer's grad norm and the
                AdamW update equal the reference; frozen base params have no grad
  lora_push     after the step, the weight push (``Exporter``, the path into vLLM) sends every
                adapted HF tensor merged, ``W + s B A`` of the trained adapters, equal to the one-process
                merge, and no adapter tensor; a second push through the same exporter after the adapters
                changed sends the new merge (nothing stale is cached)
  lora_ckpt     the trained state saved as a LoRA checkpoint holds adapter entries only (no base
                tensor) plus the LoRA record; a fresh, differently initialised model at the same layout
                resumes it bit-exact (adapters, Adam moments, fp32 main params)
  lora_bf16     a bf16 model at DP=2 (the GPU dtype): adapters bf16, base frozen, fp32 main params
                in the optimizer for adapters only, a finite step
  lora_sp       column + row parallel linears with sequence parallelism (impossible in a local-spec
                GPTModel on CPU: torch norms refuse it): outputs, input grad and adapter grads
                (sequence-parallel flags summed over TP, as finalize_model_grads does) vs dense
"""

from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state as ps

from megatron_gtpo.checkpoint.adapters import BaseIdentity, lora_record, saved_lora
from megatron_gtpo.checkpoint.store import load_checkpoint, save_checkpoint
from megatron_gtpo.convert import mapping as mp
from megatron_gtpo.models.families import FAMILIES, family_of
from megatron_gtpo.parallel.collectives import comm_device
from megatron_gtpo.parallel.dims import init_distributed
from megatron_gtpo.sync.export import Exporter
from megatron_gtpo.train import lora_layers as L
from megatron_gtpo.train import model as M
from megatron_gtpo.train.lora import BY_NAME, LoraConfig
from megatron_gtpo.train.optim import OptimConfig, build_optimizer, wrap_ddp, zero_grads
from tests.dist.scripts import _trainstep_common as C

SEED, ROWS, SEQ, MBS, LR = 11, 8, 12, 2, 1e-2
EPS = 1e-3  # Adam's first step is g / (|g| + eps): a larger eps keeps it well-conditioned for near-zero g
CFG = LoraConfig(rank=4, alpha=8.0)


def emit(**record) -> None:
    line = ("RESULT " + json.dumps({"rank": dist.get_rank(), **record}) + "\n").encode()
    sys.stdout.flush()
    os.write(1, line)


def err(a, b) -> float:
    return float((a.detach().double() - b.detach().double()).abs().max()) if a.numel() else 0.0


def make_data():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, C.VOCAB, (ROWS, SEQ), generator=g)
    labels = torch.roll(ids, -1, dims=1)
    mask = (torch.rand(ROWS, SEQ, generator=g) < 0.7).float()
    return SimpleNamespace(ids=ids, labels=labels, mask=mask, tokens=float(mask.sum()))


def optim_config(distopt: bool = True) -> OptimConfig:
    return OptimConfig(optimizer={"optimizer": "adam", "lr": LR, "weight_decay": 0.0, "adam_beta1": 0.9,
                                  "adam_beta2": 0.999, "adam_eps": EPS, "clip_grad": 0.0,
                                  "use_distributed_optimizer": distopt})


def keyed(chunks, get) -> dict:
    """``{adapter_key: get(tensor)}`` for the a/b of every adapter of ``chunks``."""
    out = {}
    for layer, adapter, _ in L.adapters(chunks):
        for which in ("a", "b"):
            out[L.adapter_key(layer, adapter.target, which)] = get(getattr(adapter, which))
    return out


def reference(hf, data):
    """The one-process run (module docstring, phase 0)."""
    dims = init_distributed(tp=1, pp=1, seed=7)
    torch.manual_seed(0)
    model = M.build_model(hf, dims=dims)[0]
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    L.apply_lora([model], CFG, seed=SEED)
    init = {k: v.clone() for k, v in L.gather_adapters([model]).items()}
    g = torch.Generator().manual_seed(5)
    adapters = {k: (0.1 * torch.randn(v.shape, generator=g) if k.endswith(".b") else v) for k, v in init.items()}
    L.set_adapters([model], adapters)
    per_token = model(data.ids, torch.arange(SEQ).expand(ROWS, SEQ), M.causal_mask(SEQ), labels=data.labels)
    loss = (per_token * data.mask).sum() / data.tokens
    loss.backward()
    frozen_clean = all(p.grad is None for n, p in model.named_parameters() if not L.is_adapter_name(n))
    grads = keyed([model], lambda p: p.grad.detach().clone())
    norm = float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values())))
    merged = {n: t.clone() for n, t in L.merged_weights([model])}
    params = L.adapter_parameters([model])
    torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.999), eps=EPS, weight_decay=0.0).step()
    updated = keyed([model], lambda p: p.detach().clone())
    merged_after = {n: t.clone() for n, t in L.merged_weights([model])}
    ps.destroy_model_parallel()
    return SimpleNamespace(full=full, init=init, adapters=adapters, loss=float(loss), grads=grads, norm=norm,
                           merged=merged, updated=updated, frozen_clean=frozen_clean,
                           hf_merged=hf_tensors(hf, merged_after), hf_before=hf_tensors(hf, merged),
                           hf_base=hf_tensors(hf, {n: full[n] for n in merged}))


def hf_tensors(hf, weights: dict) -> dict:
    """Global Megatron weights (``decoder.layers.{l}.{local}``) as the HF tensors they split into."""
    shapes, family, out = mp.shapes_of(hf), family_of(hf), {}
    for name, tensor in weights.items():
        layer, local = int(name.split(".")[2]), name.split(".", 3)[3]
        pm = next(p for p in mp.layer_maps(family) if p.local == local)
        out.update(zip(mp.hf_names(pm, layer), mp.split(pm, tensor, shapes)))
    return out


def build(hf, ref, *, tp: int, pp: int, dtype=torch.float32):
    dims = init_distributed(tp=tp, pp=pp, seed=7)
    chunks = M.build_model(hf, dims=dims, dtype=dtype)
    C.load_full(chunks, ref.full, tied=False, tp=dims.tp, tp_rank=dims.tp_rank)
    L.apply_lora(chunks, CFG, seed=SEED)
    return dims, chunks


def compare_local(chunks, want: dict, get) -> float:
    """Largest difference between each adapter's local a/b (``get``) and its piece of ``want``."""
    worst = 0.0
    for layer, adapter, _ in L.adapters(chunks):
        a, b = L.local_pieces(adapter, want[L.adapter_key(layer, adapter.target, "a")],
                              want[L.adapter_key(layer, adapter.target, "b")])
        worst = max(worst, err(get(adapter.a), a), err(get(adapter.b), b))
    return worst


def check_sharded_state_dict(chunks, adapters: dict) -> tuple[int, float]:
    """Every adapter ShardedTensor (factories built) holds the global adapter's slice at its offset."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    seen, worst = 0, 0.0
    for chunk in chunks:
        for key, value in M.unwrap(chunk).sharded_state_dict().items():
            if ".lora." not in key:
                continue
            target = next(t for t in BY_NAME.values() if f".{t.path}.lora." in key)
            for st in (value.build() if isinstance(value, ShardedTensorFactory) else [value]):
                layer, offsets = st.global_offset[0], st.global_offset[st.prepend_axis_num:]
                full = adapters[L.adapter_key(layer, target, key[-1])]
                assert tuple(st.global_shape[1:]) == tuple(full.shape), (key, st.global_shape, full.shape)
                index = tuple(slice(o, o + n) for o, n in zip(offsets, st.data.shape))
                worst = max(worst, err(st.data, full[index]))
                seen += 1
    return seen, worst


def check_placement(chunks, ref, dims, layout) -> None:
    init_err = compare_local(chunks, ref.init, lambda p: p)
    L.set_adapters(chunks, ref.adapters)
    gathered = L.gather_adapters(chunks)
    gather_err = max(err(t, ref.adapters[k]) for k, t in gathered.items())
    seen, sharded_err = check_sharded_state_dict(chunks, ref.adapters)
    merged_err, merged_count = 0.0, 0
    for name, shard in L.merged_weights(chunks):
        local = name.split(".", 3)[3]
        pm = next(p for p in mp.layer_maps(FAMILIES["qwen2"]) if p.local == local)
        merged_err = max(merged_err, err(shard, mp.tp_shard(pm, ref.merged[name], tp=dims.tp, rank=dims.tp_rank)))
        merged_count += 1
    emit(check="lora_init", layout=layout, err=init_err)
    emit(check="lora_gather", layout=layout, err=gather_err, adapters=len(gathered), sharded=seen,
         sharded_err=sharded_err)
    emit(check="lora_merged", layout=layout, err=merged_err, count=merged_count)


def megatron_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def check_frozen(chunks, optimizer, dims, layout) -> None:
    adapter_ids = {id(p) for p in L.adapter_parameters(chunks)}
    trainable = {id(p) for chunk in chunks for p in chunk.parameters() if p.requires_grad}
    buffered, buffer_numel = set(), 0
    for chunk in chunks:
        for buffer in chunk.buffers + chunk.expert_parallel_buffers:
            buffered |= {id(p) for p in buffer.params}
            buffer_numel += buffer.grad_data.numel()
    held = set()
    for opt in megatron_optimizers(optimizer):
        for group in opt.model_float16_groups + opt.model_fp32_groups:
            held |= {id(p) for p in group}
    adapter_numel = sum(p.numel() for p in L.adapter_parameters(chunks))
    base_numel = sum(p.numel() for chunk in chunks for p in chunk.parameters() if not p.requires_grad)
    # The distributed optimizer holds the parameters with a piece in this DP rank's shard.
    emit(check="lora_frozen", layout=layout, trainable_is_adapters=trainable == adapter_ids,
         buffers_are_adapters=buffered == adapter_ids, optimizer_holds_adapters=bool(held) and held <= adapter_ids,
         adapter_numel=adapter_numel, buffer_numel=buffer_numel, base_numel=base_numel,
         no_base_main_grad=not any(hasattr(p, "main_grad") for c in chunks for p in c.parameters()
                                   if not p.requires_grad))


def forward_backward(chunks, data, dims) -> float:
    """Megatron's schedule over this DP rank's rows; the loss is the token mean over the global
    batch (the DDP average over DP and the schedule's 1/micro-batches undone per rank)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    rows = ROWS // dims.dp
    lo = dims.dp_rank * rows
    n_mb = rows // MBS
    batches = [(data.ids[i:i + MBS], data.labels[i:i + MBS], data.mask[i:i + MBS]) for i in range(lo, lo + rows, MBS)]
    sums = []

    def step(iterator, model):
        ids, labels, mask = next(iterator)
        out = model(ids, torch.arange(SEQ).expand(MBS, SEQ), M.causal_mask(SEQ), labels=labels)

        def loss_func(per_token):
            total = (per_token.float() * mask).sum()
            sums.append(total.detach().clone())
            return total * dims.dp * n_mb / data.tokens, {"sum": total.detach().clone()}

        return out, loss_func

    get_forward_backward_func()(forward_step_func=step, data_iterator=iter(batches), model=chunks,
                                num_microbatches=n_mb, seq_length=SEQ, micro_batch_size=MBS)
    local = torch.stack(sums).sum() if sums else torch.zeros((), device=comm_device())
    if dims.dp > 1:
        dist.all_reduce(local, group=ps.get_data_parallel_group())
    return float(local) / data.tokens


def full_main_grads(chunks, dims) -> None:
    """After the distributed optimizer's reduce-scatter each DP rank holds its shard of every
    bucket's gradients: all-gather them so every ``main_grad`` is complete (test only)."""
    if dims.dp == 1:
        return
    group = ps.get_data_parallel_group()
    for chunk in chunks:
        for buffer in chunk.buffers:
            for bucket in buffer.buckets:
                shard = bucket.grad_data.chunk(dims.dp)[dims.dp_rank].clone()
                dist.all_gather_into_tensor(bucket.grad_data, shard, group=group)


def optimizer_state_numel(optimizer) -> int:
    total = 0
    for opt in megatron_optimizers(optimizer):
        for state in opt.optimizer.state.values():
            total += state["exp_avg"].numel()
    return total


def frozen_base(chunks) -> list[torch.Tensor]:
    """Copies of every frozen (base) parameter of this rank, in a fixed order."""
    return [p.detach().clone() for c in chunks for p in c.parameters() if not p.requires_grad]


def base_drift(chunks, before: list[torch.Tensor]) -> float:
    """Largest |change| of any frozen base element since ``before`` (0.0 when untouched)."""
    now = [p.detach() for c in chunks for p in c.parameters() if not p.requires_grad]
    assert len(now) == len(before)
    return max(((a.double() - b.double()).abs().max().item() for a, b in zip(now, before)), default=0.0)


def push_errors(exporter, want: dict) -> dict:
    """One push's HF tensors against ``want`` (the adapted ones): worst error, names missing, adapter names sent."""
    got = {name: tensor.clone() for name, tensor in exporter.tensors("full")}
    return {"err": max(err(got[n], t) for n, t in want.items() if n in got),
            "missing": sorted(set(want) - set(got))[:3], "adapter_names": [n for n in got if "lora" in n][:3],
            "sent": len(got)}


def check_push(chunks, hf, ref, dims, layout, base) -> None:
    exporter = Exporter(chunks, hf_config=hf, dims=dims)
    trained = push_errors(exporter, ref.hf_merged)
    exporter.release()  # what WeightSync.update does around every push
    L.set_adapters(chunks, ref.adapters)  # the adapters change (back to their pre-step values)
    again = push_errors(exporter, ref.hf_before)
    moved = max(err(ref.hf_merged[n], t) for n, t in ref.hf_base.items())  # what an unmerged push would miss by
    emit(check="lora_push", layout=layout, trained=trained, again=again, base_vs_merged=moved,
         base_drift=base_drift(chunks, base))


def optimizer_tensors(optimizer) -> list[torch.Tensor]:
    """Every Adam moment and fp32 main param of this rank's optimizer shards, in a fixed order."""
    out = []
    for opt in megatron_optimizers(optimizer):
        for group in opt.optimizer.param_groups:
            for p in group["params"]:
                state = opt.optimizer.state.get(p, {})
                out += [p.detach().clone()] + [state[k].clone() for k in ("exp_avg", "exp_avg_sq") if k in state]
    return out


def check_checkpoint(chunks, optimizer, hf, ref, *, layout, root) -> None:
    """Save the trained LoRA state, rebuild a fresh model at the same layout, resume, compare."""
    from torch.distributed.checkpoint import FileSystemReader

    tp, pp = layout[0], layout[1]
    record = lora_record(CFG, BaseIdentity(path="/base", sha256="0" * 64, files=1, bytes=1))
    adapters_before = keyed(chunks, lambda p: p.detach().clone())
    state_before = optimizer_tensors(optimizer)
    path = save_checkpoint(root, step=1, model_chunks=chunks, optimizer=optimizer, extra_state={"x": 1}, keep_last=1,
                           lora=record)
    keys = list(FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    model_keys = [k for k in keys if not k.startswith(("optimizer.", "rng_state"))]
    ps.destroy_model_parallel()
    dims, fresh = build(hf, ref, tp=tp, pp=pp)  # B = 0, A as initialised: not the trained values
    cfg = optim_config()
    fresh = wrap_ddp(fresh, cfg)
    opt2, _ = build_optimizer(fresh, cfg, total_steps=1)
    differs_before = compare_local(fresh, ref.updated, lambda p: p)
    step, extra = load_checkpoint(root, model_chunks=fresh, optimizer=opt2)
    after = keyed(fresh, lambda p: p.detach())
    state_after = optimizer_tensors(opt2)
    emit(check="lora_ckpt", layout=layout, step=step, extra=extra, record_ok=saved_lora(path) == record,
         model_keys=len(model_keys), base_keys=[k for k in model_keys if ".lora." not in k][:3],
         optimizer_keys=sum(k.startswith("optimizer.") for k in keys), differs_before=differs_before,
         adapter_err=max(err(after[k], v) for k, v in adapters_before.items()),
         state_count=[len(state_before), len(state_after)],
         state_err=max((err(a, b) for a, b in zip(state_before, state_after)), default=-1.0))
    ps.destroy_model_parallel()


def run_layout(hf, data, ref, *, tp: int, pp: int, work) -> None:
    layout = [tp, pp, 2 // (tp * pp)]
    dims, chunks = build(hf, ref, tp=tp, pp=pp)
    check_placement(chunks, ref, dims, layout)
    cfg = optim_config()
    chunks = wrap_ddp(chunks, cfg)
    optimizer, _ = build_optimizer(chunks, cfg, total_steps=1)
    check_frozen(chunks, optimizer, dims, layout)
    base = frozen_base(chunks)
    zero_grads(chunks, optimizer)
    loss = forward_backward(chunks, data, dims)
    full_main_grads(chunks, dims)
    grad_err = compare_local(chunks, ref.grads, lambda p: p.main_grad)
    base_grads = sum(p.grad is not None for c in chunks for p in c.parameters() if not p.requires_grad)
    _, norm, _ = optimizer.step()
    update_err = compare_local(chunks, ref.updated, lambda p: p)
    state = torch.tensor(float(optimizer_state_numel(optimizer)), device=comm_device())
    if dims.dp > 1:
        dist.all_reduce(state, group=ps.get_data_parallel_group())
    adapter_numel = sum(p.numel() for p in L.adapter_parameters(chunks))
    emit(check="lora_step", layout=layout, last_stage=dims.is_last_stage, loss=loss, ref_loss=ref.loss,
         grad_err=grad_err, norm=float(norm), ref_norm=ref.norm, update_err=update_err, base_grads=base_grads,
         state_numel=int(state), adapter_numel=adapter_numel, ref_frozen_clean=ref.frozen_clean,
         base_drift=base_drift(chunks, base))
    check_push(chunks, hf, ref, dims, layout, base)
    check_checkpoint(chunks, optimizer, hf, ref, layout=layout, root=work / f"tp{tp}pp{pp}")


def run_bf16(hf, data, ref) -> None:
    dims, chunks = build(hf, ref, tp=1, pp=1, dtype=torch.bfloat16)
    L.set_adapters(chunks, ref.adapters)
    cfg = optim_config()
    chunks = wrap_ddp(chunks, cfg)
    optimizer, _ = build_optimizer(chunks, cfg, total_steps=1)
    zero_grads(chunks, optimizer)
    loss = forward_backward(chunks, data, dims)
    ok, norm, _ = optimizer.step()
    main = [p for opt in megatron_optimizers(optimizer) for g in opt.shard_fp32_from_float16_groups for p in g]
    held = {id(p) for opt in megatron_optimizers(optimizer) for g in opt.model_float16_groups for p in g}
    adapter_ids = {id(p) for p in L.adapter_parameters(chunks)}
    adapters = L.adapter_parameters(chunks)
    main_numel = torch.tensor(float(sum(p.numel() for p in main)), device=comm_device())
    dist.all_reduce(main_numel, group=ps.get_data_parallel_group())
    emit(check="lora_bf16", adapter_dtypes=sorted({str(p.dtype) for p in adapters}),
         base_dtypes=sorted({str(p.dtype) for c in chunks for p in c.parameters() if not p.requires_grad}),
         main_dtypes=sorted({str(p.dtype) for p in main}), main_numel=int(main_numel),
         adapter_numel=sum(p.numel() for p in adapters), held_is_adapters=bool(held) and held <= adapter_ids,
         loss=loss, ref_loss=ref.loss, norm=float(norm), ok=bool(ok))
    ps.destroy_model_parallel()


def sp_layers(config):
    """A column-parallel fc1 and a row-parallel fc2 (no bias) with frozen random weights and
    random adapters; returns the layers and the global tensors (the dense reference's)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    h, f, r = config.hidden_size, config.ffn_hidden_size, CFG.rank
    col = ColumnParallelLinear(h, 2 * f, config=config, init_method=torch.nn.init.zeros_, bias=False,
                               gather_output=False)
    row = RowParallelLinear(f, h, config=config, init_method=torch.nn.init.zeros_, bias=False, input_is_parallel=True,
                            skip_bias_add=True)
    g = torch.Generator().manual_seed(9)
    full = {"w1": 0.1 * torch.randn(2 * f, h, generator=g), "w2": 0.1 * torch.randn(h, f, generator=g),
            "a1": 0.1 * torch.randn(2 * r, h, generator=g), "b1": 0.1 * torch.randn(2 * f, r, generator=g),
            "a2": 0.1 * torch.randn(r, f, generator=g), "b2": 0.1 * torch.randn(h, r, generator=g)}
    tp_rank = ps.get_tensor_model_parallel_rank()
    adapters = []
    for layer, target, w, a, b in ((col, BY_NAME["linear_fc1"], "w1", "a1", "b1"),
                                   (row, BY_NAME["linear_fc2"], "w2", "a2", "b2")):
        with torch.no_grad():
            layer.weight.copy_(mp.tp_shard(L.base_param_map(target), full[w], tp=2, rank=tp_rank))
        layer.weight.requires_grad_(False)
        adapter = L.LoraAdapter(layer, target, CFG)
        L.attach(layer, adapter)
        L.set_adapter(adapter, full[a], full[b])
        adapters.append(adapter)
    return col, row, adapters, full


def sp_dense(x, weight, full):
    """The dense (one-process) fc1 -> SwiGLU -> fc2 with its adapters, gate and up with their own A."""
    f, r, s = full["w2"].shape[1], CFG.rank, CFG.scale
    leaves = {k: v.clone().requires_grad_(k[0] in "ab") for k, v in full.items()}
    x = x.clone().requires_grad_()
    w1, a1, b1 = leaves["w1"], leaves["a1"], leaves["b1"]
    gate = x @ w1[:f].T + s * (x @ a1[:r].T) @ b1[:f].T
    up = x @ w1[f:].T + s * (x @ a1[r:].T) @ b1[f:].T
    act = F.silu(gate) * up
    out = act @ leaves["w2"].T + s * (act @ leaves["a2"].T) @ leaves["b2"].T
    (out * weight).sum().backward()
    return out, x.grad, {k: v.grad for k, v in leaves.items() if k[0] in "ab"}


def run_sequence_parallel() -> None:
    from megatron.core.transformer import TransformerConfig

    init_distributed(tp=2, pp=1, seed=7)
    config = TransformerConfig(num_layers=1, hidden_size=64, ffn_hidden_size=48, num_attention_heads=4,
                               tensor_model_parallel_size=2, sequence_parallel=True, use_cpu_initialization=True,
                               gated_linear_unit=True, add_bias_linear=False, params_dtype=torch.float32)
    col, row, (ad1, ad2), full = sp_layers(config)
    g = torch.Generator().manual_seed(10)
    x, weight = torch.randn(8, 2, 64, generator=g), torch.randn(8, 2, 64, generator=g)
    tp_rank, group = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_group()
    x_local = x.chunk(2, dim=0)[tp_rank].clone().requires_grad_()
    gate, up = col(x_local)[0].chunk(2, dim=-1)
    out, _ = row(F.silu(gate) * up)
    (out * weight.chunk(2, dim=0)[tp_rank]).sum().backward()
    for p in (ad1.a, ad1.b, ad2.a, ad2.b):  # what finalize_model_grads does for sequence-parallel params
        if p.sequence_parallel:
            dist.all_reduce(p.grad, group=group)
    dense_out, dense_x_grad, grads = sp_dense(x, weight, full)
    a1, b1 = L.local_pieces(ad1, grads["a1"], grads["b1"])
    a2, b2 = L.local_pieces(ad2, grads["a2"], grads["b2"])
    emit(check="lora_sp", out_err=err(out, dense_out.chunk(2, dim=0)[tp_rank]),
         x_grad_err=err(x_local.grad, dense_x_grad.chunk(2, dim=0)[tp_rank]),
         grad_err=max(err(ad1.a.grad, a1), err(ad1.b.grad, b1), err(ad2.a.grad, a2), err(ad2.b.grad, b2)),
         flags=[ad1.a.sequence_parallel, ad1.b.sequence_parallel, ad2.a.sequence_parallel, ad2.b.sequence_parallel],
         out_scale=float(dense_out.abs().max()), grad_scale=max(float(g.abs().max()) for g in grads.values()))
    ps.destroy_model_parallel()


def main() -> None:
    from pathlib import Path

    work = Path(sys.argv[1])
    hf = C.tiny_config(tied=False)
    data = make_data()
    ref = reference(hf, data)
    for tp, pp in ((2, 1), (1, 2), (1, 1)):
        run_layout(hf, data, ref, tp=tp, pp=pp, work=work)
    run_bf16(hf, data, ref)
    run_sequence_parallel()


if __name__ == "__main__":
    main()
