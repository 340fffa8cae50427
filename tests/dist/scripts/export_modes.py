"""The exporter's delivery modes and the push's memory bound on 2 gloo ranks (no vLLM).

Usage: export_modes.py WORK_DIR (WORK_DIR/<family>/hf: tiny HF models; WORK_DIR/big/hf: a model of
many buckets). For (TP, PP) in {(2, 1), (1, 2)} and each family, checks (one RESULT line each):

  local    engine TP == trainer TP: each rank gets exactly its TP shard of every linear tensor
           (HF tensor chunked like vLLM's loaders cut it), full norms and vocabulary tensors; what
           ``metas`` planned is what ``tensors`` yields, and equals ``checks.sharded_shapes``
  senders  every bucket packed by its stage's sender equals the HF tensors; the senders together
           hold every tensor exactly once; buckets never straddle stages (also for Phi-3, whose
           fused qkv_proj / gate_up_proj are gathered piece by piece into their rows of the bucket)
  memory   on the big model (>= 10 buckets): peak extra memory (VmHWM, reset before) of packing
           every bucket into one buffer, and of streaming the full push to a consumer that drops
           each tensor, against one bucket + the largest tensor
"""

import json
import os
import sys

import torch
import torch.distributed as dist

from megatron_gtpo.convert.hf_io import HFReader
from megatron_gtpo.convert.load import load_hf_weights
from megatron_gtpo.models.hf_config import read_hf_config
from megatron.core import parallel_state as ps

from megatron_gtpo.parallel.collectives import comm_device
from megatron_gtpo.parallel.dims import init_distributed
from megatron_gtpo.sync.checks import WeightSpec, sharded_shapes
from megatron_gtpo.sync.export import Exporter, view_of
from megatron_gtpo.utils.memory import PeakMemory
from megatron_gtpo.train.model import build_model

BUCKET = 1 << 20


def report(**kw):
    sys.stdout.flush()
    os.write(1, ("\nRESULT " + json.dumps({"rank": dist.get_rank(), **kw}) + "\n").encode())


def build(hf_dir, tp, pp):
    dims = init_distributed(tp=tp, pp=pp, seed=1)
    hf_config = read_hf_config(hf_dir)
    chunks = build_model(hf_config, dims=dims, dtype=torch.float32)
    load_hf_weights(chunks, hf_dir=str(hf_dir), hf_config=hf_config, dims=dims)
    return dims, hf_config, Exporter(chunks, hf_config=hf_config, dims=dims)


def check_local(family, hf_dir, exporter, dims):
    ref = HFReader(hf_dir)
    spec = WeightSpec.from_model_dir(hf_dir, dtype=torch.float32)
    want_shapes = sharded_shapes({**spec.optional_shapes, **spec.shapes}, dims.tp)
    metas = exporter.metas("local")
    got = list(exporter.tensors("local"))
    bad = []
    for meta, (name, tensor) in zip(metas, got):
        full = ref.get(name)
        dim = next((d for d in (0, 1) if full.dim() > d and tensor.shape[d] != full.shape[d]), None)
        expect = full if dim is None else full.chunk(dims.tp, dim=dim)[dims.tp_rank]
        if meta.name != name or tuple(meta.shape) != tuple(tensor.shape) or want_shapes[name] != tuple(tensor.shape) \
                or not torch.equal(expect, tensor):
            bad.append(name)
    sharded = sum(1 for name, t in got if tuple(t.shape) != tuple(ref.get(name).shape))
    report(check="local", family=family, layout=[dims.tp, dims.pp], tensors=len(got), planned=len(metas),
           expected=len(spec.shapes), sharded=sharded, bad=bad)


def check_senders(family, hf_dir, exporter, dims):
    ref = HFReader(hf_dir)
    plan = exporter.buckets(4 << 10)  # small buckets: several per stage
    buffer = torch.empty(max(b.nbytes for b in plan), dtype=torch.uint8, device=comm_device())
    mine, bad = [], []
    for bucket in plan:
        if exporter.pack(bucket, buffer):
            for meta in bucket.tensors:
                mine.append(meta.name)
                if not torch.equal(view_of(buffer, meta), ref.get(meta.name)):
                    bad.append(meta.name)
    report(check="senders", family=family, layout=[dims.tp, dims.pp], names=mine, bad=bad, expected=len(ref.names()),
           owners=sorted({b.owner for b in plan}), buckets=len(plan),
           stage_runs=sum(1 for a, b in zip(plan, plan[1:]) if a.owner != b.owner))


def check_memory(exporter, dims):
    plan = exporter.buckets(BUCKET)
    metas = exporter.metas("full")
    model = sum(t.numel() * t.element_size() for t in exporter.params.values())
    full_bytes = [m.numel * 4 for m in metas]
    with PeakMemory() as packing:
        buffer = torch.empty(max(b.nbytes for b in plan), dtype=torch.uint8, device=comm_device())
        for bucket in plan:
            exporter.pack(bucket, buffer)
        del buffer
    with PeakMemory() as streaming:
        for item in exporter.tensors("full"):
            del item  # a consumer that keeps nothing: what remains is the exporter's own memory
    report(check="memory", layout=[dims.tp, dims.pp], buckets=len(plan), bucket=BUCKET,
           largest=max(full_bytes), push=sum(full_bytes), local_model=model,
           pack_extra=packing.extra_bytes, stream_extra=streaming.extra_bytes)


def main():
    work = sys.argv[1]
    dist.init_process_group("gloo")
    for tp, pp in ((2, 1), (1, 2)):
        for family in ("qwen2", "qwen3", "phi3"):
            hf_dir = f"{work}/{family}/hf"
            dims, _, exporter = build(hf_dir, tp, pp)
            if tp > 1 and not exporter.family.fused:  # fused families never get local delivery (shards.py)
                check_local(family, hf_dir, exporter, dims)
            check_senders(family, hf_dir, exporter, dims)
            ps.destroy_model_parallel()
    dims, _, exporter = build(f"{work}/big/hf", 2, 1)
    exporter.entries  # the one-time metadata exchange, outside the measured blocks
    check_memory(exporter, dims)
    ps.destroy_model_parallel()


if __name__ == "__main__":
    main()
