"""SmolLM2-135M-Instruct (9 heads, 3 KV groups, tied embeddings) through a live Megatron model.

Usage: smollm2_live.py HF_DIR MCORE_DIR TP PP. Builds the model at (TP, PP), loads the converted
dist checkpoint, compares the logits with transformers on the last rank, and streams the weights
back with export_hf_weights(dst_ranks="first"); rank 0 compares every tensor with the HF file.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_gtpo.models.hf_config import read_hf_config
from megatron_gtpo.checkpoint.store import load_model_weights
from megatron_gtpo.convert.hf_io import HFReader
from megatron_gtpo.parallel.dims import init_distributed
from megatron_gtpo.train import model as M
from tests.dist.scripts.convert_parity import hf_logits, megatron_logits, report, tokens_for
from tests.sync_helpers import export_hf_weights


def main():
    hf_dir, mc_dir, tp, pp = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    dist.init_process_group("gloo")
    dims = init_distributed(tp=tp, pp=pp, seed=3)
    hf_config = read_hf_config(mc_dir)
    chunks = M.build_model(hf_config, dims=dims)
    load_model_weights(chunks, mc_dir)
    tokens = tokens_for(int(hf_config["vocab_size"]))
    logits = megatron_logits(chunks, tokens, dims)
    diff = scale = None
    if logits is not None and dist.get_rank() == dist.get_world_size() - 1:
        reference = hf_logits(hf_dir, tokens)
        diff, scale = (logits - reference).abs().max().item(), reference.abs().max().item()
    reader = HFReader(hf_dir) if dist.get_rank() == 0 else None
    names, equal, nbytes = [], True, 0
    for bucket in export_hf_weights(chunks, hf_config=hf_config, dims=dims, dst_ranks="first"):
        for name, tensor in bucket:
            names.append(name)
            nbytes += tensor.nbytes
            equal &= torch.equal(tensor, reader.get(name)) and tensor.dtype == torch.float32
    complete = reader is not None and sorted(names) == sorted(reader.names())
    report(logits_diff=diff, logits_scale=scale, export_equal=equal, export_complete=complete, exported_mb=nbytes / 2**20,
           layer_offsets=[M.layer_offset(c) for c in chunks])


if __name__ == "__main__":
    main()
