"""Training-checkpoint checks with Megatron DDP + distributed optimizer (fp32, CPU, TP=1).

Usage: ckpt_resume.py WORK MODE (MODE's world size in brackets):
* ``train`` [2 ranks, DP=2]: the uninterrupted reference: 4 steps of next-token cross-entropy on a
  tiny Qwen2 model, saving after steps 1-3 into WORK/a (keep_last=2); then a fresh, differently
  initialised model resumes from step 2 at the same layout and trains steps 3 and 4.
* ``dp1`` [1 rank, DP=1]: resumes WORK/a step 2, trains step 3, saves it into WORK/b, trains step 4.
* ``dp2`` [2 ranks, DP=2]: resumes WORK/b step 3 (saved at DP=1) and trains step 4; then tries
  to resume it at TP=2 (must be refused with a clear error).
Every rank prints the losses, the extra_state and a few RNG draws made right after save/load.
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallel as DDP
from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_gtpo.checkpoint.store import latest_step, load_checkpoint, save_checkpoint
from megatron_gtpo.parallel.dims import init_distributed
from megatron_gtpo.train import model as M
from tests.tiny_hf import tiny_hf_config

GLOBAL_BATCH, SEQ, VOCAB = 4, 8, 128


def model_config() -> dict:
    """The tiny Qwen2 with a 128-token vocabulary (no padding at TP=1). The DP=1 vs DP=2 resume is
    compared bit for bit although DP=1 sums the 4 micro-batch gradients as ((a+b)+c)+d and DP=2 as
    (a+b)+(c+d): that holds for this model and data (Adam's first steps absorb the last-bit
    differences), not in general. With tiny_hf's 257-token vocabulary (384 rows) the same-layout
    resume stays bit-exact but the DP=1 one differs at step 4 by 8e-8 relative."""
    return {**tiny_hf_config("qwen2"), "vocab_size": VOCAB}


def report(**kw):
    """One RESULT line, written with a single write(2) that starts on a fresh line: atomic on the
    shared pipe, so lines of several ranks never interleave."""
    sys.stdout.flush()
    os.write(1, ("\nRESULT " + json.dumps({"rank": dist.get_rank(), **kw}) + "\n").encode())


def setup(tp, pp, init_seed):
    dims = init_distributed(tp=tp, pp=pp, seed=21)
    torch.manual_seed(init_seed)
    chunks = M.build_model(model_config(), dims=dims)
    config = M.unwrap(chunks[0]).config
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True,
                                               overlap_grad_reduce=False)
    chunks = [DDP(config=config, ddp_config=ddp_config, module=c) for c in chunks]
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.01, clip_grad=1.0,
                                                 params_dtype=torch.float32, use_distributed_optimizer=True),
                                 chunks)
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = opt.scale_loss
    return dims, chunks, opt


def batch_for(step, dims):
    """The global batch of ``step`` (same at every layout); this DP rank's share, one sample per micro-batch."""
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=torch.Generator().manual_seed(step))
    per = GLOBAL_BATCH // dims.dp
    mine = tokens[dims.dp_rank * per:(dims.dp_rank + 1) * per]
    positions, mask = torch.arange(SEQ).expand(1, SEQ), M.causal_mask(SEQ)
    return [(row[None, :SEQ], positions, mask, row[None, 1:]) for row in mine]


def train_step(step, dims, chunks, opt):
    def forward_step(data_iterator, model):
        tokens, positions, mask, labels = next(data_iterator)
        per_token = model(tokens, positions, mask, labels=labels)

        def loss_func(output):
            loss = output.float().mean()
            return loss, {"loss": loss.detach().clone()}
        return per_token, loss_func

    micro = batch_for(step, dims)
    for c in chunks:
        c.zero_grad_buffer()
    opt.zero_grad()
    iters = [iter(micro) for _ in chunks] if len(chunks) > 1 else iter(micro)
    out = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iters, model=chunks,
                                      num_microbatches=len(micro), seq_length=SEQ, micro_batch_size=1)
    ok, _, _ = opt.step()
    assert ok
    if not out:  # not the last pipeline stage
        return None
    loss = torch.stack([o["loss"] for o in out]).mean()
    dist.all_reduce(loss, group=ps.get_data_parallel_group())
    return (loss / dims.dp).item()


def extra_for(step):
    return {"cursor": {"epoch": 0, "index": step * GLOBAL_BATCH}, "run_id": "run-42"}


def train(work):
    dims, chunks, opt = setup(1, 1, init_seed=1)
    if dist.get_rank() == 0:
        (work / "a" / ".tmp_step_00000009").mkdir(parents=True)  # a crashed save: must be ignored
    losses, rand_after = {}, None
    for step in (1, 2, 3, 4):
        losses[step] = train_step(step, dims, chunks, opt)
        if step <= 3:
            save_checkpoint(work / "a", step=step, model_chunks=chunks, optimizer=opt, keep_last=2,
                            extra_state=extra_for(step))
        if step == 2:
            rand_after = torch.rand(3).tolist()
    report(mode="reference", losses=losses, rand=rand_after, kept=sorted(p.name for p in (work / "a").iterdir()),
           latest=latest_step(work / "a"), empty=load_checkpoint(work / "nothing", model_chunks=chunks, optimizer=opt))
    ps.destroy_model_parallel()
    resume(work / "a", 2, (3, 4), mode="same_layout")


def resume(root, step, steps, *, mode, save_to=None):
    dims, chunks, opt = setup(1, 1, init_seed=999)  # other random weights: the load must overwrite them
    loaded_step, extra = load_checkpoint(root, model_chunks=chunks, optimizer=opt, step=step)
    rand_after = torch.rand(3).tolist()
    losses = {}
    for s in steps:
        losses[s] = train_step(s, dims, chunks, opt)
        if save_to is not None and s == steps[0]:
            save_checkpoint(save_to, step=s, model_chunks=chunks, optimizer=opt, keep_last=1, extra_state=extra_for(s))
    report(mode=mode, dp=dims.dp, step=loaded_step, extra=extra, losses=losses, rand=rand_after)


def main():
    work, mode = Path(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo")
    if mode == "train":
        train(work)
    elif mode == "dp1":
        resume(work / "a", 2, (3, 4), mode="dp1", save_to=work / "b")
    else:
        resume(work / "b", 3, (4,), mode="dp2_from_dp1")
        ps.destroy_model_parallel()
        _, chunks, opt = setup(2, 1, init_seed=3)
        try:
            load_checkpoint(work / "b", model_chunks=chunks, optimizer=opt)
            report(mode="tp2", error=None)
        except ValueError as err:
            report(mode="tp2", error=str(err))


if __name__ == "__main__":
    main()
