"""2-rank conversion checks at (TP, PP) in {(1,1) x DP2, (2,1), (1,2)} for every tiny family.

Usage: convert_parity.py WORK_DIR, where WORK_DIR/<family>/hf is a tiny HF model and
WORK_DIR/<family>/mcore its conversion by the CLI. For each layout and family the script
1. builds the model and loads the converted dist checkpoint (Megatron reshards at load),
2. runs a forward through Megatron's pipeline schedule and compares the logits with the
   transformers forward of the original HF model,
3. loads the HF files directly (load_hf_weights) and checks every parameter equals (1),
4. exports with export_hf_weights (dst "all" and "first") and compares bit for bit with the HF files
   (the vocabulary, 257 rows in HF, is padded in the live model and must come back stripped),
5. at (1,1) only, a negative control: the same weights with rope_theta 10% off must miss the parity
   tolerance (so the logits check can see a wrong RoPE base at all).
"""

import copy

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_gtpo.models.hf_config import read_hf_config
from megatron_gtpo.checkpoint.store import load_model_weights
from megatron_gtpo.convert.hf_io import HFReader
from megatron_gtpo.convert.load import load_hf_weights
from megatron_gtpo.parallel.dims import init_distributed
from megatron_gtpo.train import model as M
from tests.tiny_hf import FAMILIES
from tests.sync_helpers import export_hf_weights

SEQ, BATCH = 12, 2


def report(**kw):
    """One RESULT line, written with a single write(2) that starts on a fresh line: atomic on the
    shared pipe, so lines of several ranks never interleave."""
    sys.stdout.flush()
    os.write(1, ("\nRESULT " + json.dumps({"rank": dist.get_rank(), **kw}) + "\n").encode())


def tokens_for(vocab):
    gen = torch.Generator().manual_seed(3)
    return torch.randint(0, vocab, (BATCH, SEQ), generator=gen)


def hf_logits(hf_dir, tokens):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    with torch.no_grad():
        return model(tokens).logits


def logits_diffs(logits, hf_ref) -> tuple[float | None, float | None]:
    """(max |logits - HF| over the true vocabulary, max |logit| in the padding columns) of padded
    Megatron logits; (None, None) on ranks without logits."""
    if logits is None:
        return None, None
    vocab = hf_ref.shape[-1]
    pad = logits[..., vocab:]
    return (logits[..., :vocab] - hf_ref).abs().max().item(), (pad.abs().max().item() if pad.numel() else 0.0)


def megatron_logits(chunks, tokens, dims):
    """Full-vocab logits (padded columns included) on last-stage ranks (None elsewhere), through
    the real pipeline schedule."""
    captured = []
    positions, mask = torch.arange(SEQ).expand(1, SEQ), M.causal_mask(SEQ)
    # One sample per micro-batch: the interleaved (VPP) schedule needs at least PP micro-batches.
    micro = [(tokens[i:i + 1], positions, mask) for i in range(BATCH)]

    def forward_step(data_iterator, model):
        out = model(*next(data_iterator))

        def loss_func(output):
            captured.append(output.detach().clone())
            return output.sum() * 0.0, {}
        return out, loss_func

    iters = [iter(micro) for _ in chunks] if len(chunks) > 1 else iter(micro)
    with torch.no_grad():
        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iters, model=chunks,
                                    num_microbatches=BATCH, seq_length=SEQ, micro_batch_size=1,
                                    forward_only=True)
    if not captured:
        return None
    local = torch.cat(captured, dim=0)
    parts = [torch.empty_like(local) for _ in range(dims.tp)]
    dist.all_gather(parts, local.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)


def export_matches(chunks, hf_config, dims, reader, dst):
    names, equal = [], True
    for bucket in export_hf_weights(chunks, hf_config=hf_config, dims=dims, bucket_bytes=64 << 10, dst_ranks=dst):
        for name, tensor in bucket:
            names.append(name)
            ref = reader.get(name)
            equal &= tensor.dtype == ref.dtype and torch.equal(tensor, ref)
    return names, equal


def with_rope_theta(hf_config: dict, factor: float) -> dict:
    """A copy of ``hf_config`` whose RoPE base is ``factor`` x the original (both config spellings)."""
    out = copy.deepcopy(hf_config)
    for holder in (out.get("rope_parameters"), out):
        if isinstance(holder, dict) and "rope_theta" in holder:
            holder["rope_theta"] = float(holder["rope_theta"]) * factor
    return out


def wrong_theta_diff(hf_config, mc_dir, hf_ref, tokens, dims):
    """Max |logits - HF| when Megatron is built with a rope_theta 10% too large (negative control)."""
    chunks = M.build_model(with_rope_theta(hf_config, 1.1), dims=dims)
    load_model_weights(chunks, mc_dir / "model")
    return logits_diffs(megatron_logits(chunks, tokens, dims), hf_ref)[0]


def check(family, work, dims, layout):
    hf_dir, mc_dir = work / family / "hf", work / family / "mcore"
    hf_config = read_hf_config(mc_dir)
    reader = HFReader(hf_dir)
    chunks = M.build_model(hf_config, dims=dims)
    load_model_weights(chunks, mc_dir / "model")
    tokens = tokens_for(int(hf_config["vocab_size"]))
    hf_ref = hf_logits(hf_dir, tokens)
    diff, pad_logit = logits_diffs(megatron_logits(chunks, tokens, dims), hf_ref)
    control = wrong_theta_diff(hf_config, mc_dir, hf_ref, tokens, dims) if layout == [1, 1] else None
    padded_rows = [M.unwrap(c).embedding.word_embeddings.weight.shape[0] * dims.tp for c in chunks
                   if M.unwrap(c).pre_process]
    direct = M.build_model(hf_config, dims=dims)
    load_hf_weights(direct, hf_dir=hf_dir, hf_config=hf_config, dims=dims)
    same_params = all(torch.equal(a, b) for c1, c2 in zip(chunks, direct)
                      for a, b in zip(c1.parameters(), c2.parameters()))
    all_names, all_equal = export_matches(chunks, hf_config, dims, reader, "all")
    first_names, first_equal = export_matches(chunks, hf_config, dims, reader, "first")
    report(family=family, layout=layout, logits_diff=diff, pad_logit=pad_logit, wrong_theta_diff=control,
           padded_rows=padded_rows,
           logits_scale=hf_ref.abs().max().item(), direct_load_equal=same_params,
           export_all_complete=sorted(all_names) == sorted(reader.names()), export_all_equal=all_equal,
           export_first_names=len(first_names), export_first_complete=sorted(first_names) == sorted(reader.names()),
           export_first_equal=first_equal, hf_order=all_names[:2] + all_names[-2:])


def main():
    work = Path(sys.argv[1])
    dist.init_process_group("gloo")
    for tp, pp in ((1, 1), (2, 1), (1, 2)):
        dims = init_distributed(tp=tp, pp=pp, seed=11)
        for family in FAMILIES:
            check(family, work, dims, [tp, pp])
        ps.destroy_model_parallel()


if __name__ == "__main__":
    main()
