"""4-rank HF -> Megatron (TP=2, PP=2, with and without VPP=2) -> HF for every tiny family.

Usage: roundtrip_tp2pp2.py WORK_DIR (layout as in convert_parity.py). Rank 0 writes the exported
model to WORK_DIR/<family>/back_tp2pp2[_vpp2]; the test compares it bit for bit with the original.
Logits through the interleaved/non-interleaved pipeline schedule are compared with transformers too.
"""

import sys
from pathlib import Path

import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_gtpo.models.hf_config import read_hf_config
from megatron_gtpo.checkpoint.store import load_model_weights
from megatron_gtpo.convert.hf_io import HFWriter, copy_side_files
from megatron_gtpo.parallel.dims import init_distributed
from megatron_gtpo.train import model as M
from tests.dist.scripts.convert_parity import hf_logits, logits_diffs, megatron_logits, report, tokens_for
from tests.tiny_hf import FAMILIES
from tests.sync_helpers import export_hf_weights


def roundtrip(family, work, dims, suffix):
    mc_dir = work / family / "mcore"
    hf_config = read_hf_config(mc_dir)
    chunks = M.build_model(hf_config, dims=dims)
    load_model_weights(chunks, mc_dir)
    tokens = tokens_for(int(hf_config["vocab_size"]))
    diff, pad_logit = logits_diffs(megatron_logits(chunks, tokens, dims), hf_logits(work / family / "hf", tokens))
    writer = HFWriter(work / family / f"back_{suffix}", shard_bytes=200 << 10) if dist.get_rank() == 0 else None
    buckets = 0
    for bucket in export_hf_weights(chunks, hf_config=hf_config, dims=dims, bucket_bytes=128 << 10,
                                    dst_ranks="first"):
        buckets += 1
        for name, tensor in bucket:
            writer.add(name, tensor)
    if writer is not None:
        writer.close()
        copy_side_files(work / family / "hf", work / family / f"back_{suffix}")
    report(family=family, layout=suffix, logits_diff=diff, pad_logit=pad_logit, buckets=buckets, chunks=len(chunks),
           layer_offsets=[M.layer_offset(c) for c in chunks])


def main():
    work = Path(sys.argv[1])
    dist.init_process_group("gloo")
    for vpp, suffix in ((None, "tp2pp2"), (2, "tp2pp2_vpp2")):
        dims = init_distributed(tp=2, pp=2, vpp=vpp, seed=5)
        for family in FAMILIES:
            roundtrip(family, work, dims, suffix)
        ps.destroy_model_parallel()


if __name__ == "__main__":
    main()
