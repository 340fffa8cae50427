"""A bf16 model hands the fused log-prob pass its bf16 logits (fp32_output=False): log-probs and
entropies equal those of the fp32-output path bit for bit. One RESULT line."""

import json

import torch
import torch.distributed as dist

from megatron_gtpo.algo import AlgoConfig
from megatron_gtpo.parallel.dims import init_distributed
from megatron_gtpo.train import model as M
from megatron_gtpo.train import step as S
from tests.dist.scripts import _trainstep_common as C


def main() -> None:
    dims = init_distributed(tp=1, pp=1, seed=3)
    torch.manual_seed(0)
    chunks = M.build_model(C.tiny_config(tied=False), dims=dims, dtype=torch.bfloat16)
    batch = C.make_batch(0)
    settings = S.StepSettings(spec=AlgoConfig().resolve(max_completion_tokens=16), micro_batch_size=2,
                              temperature=0.8)
    _, mbs = S.rank_micro_batches(batch, settings, dims)
    lp = S.logprob_settings(settings, dims, S.process_groups(), chunks)
    kwargs = S.forward_kwargs(chunks[0])
    bf16 = S.forward_stats(chunks, batch, mbs, lp)
    S.forward_kwargs = lambda chunk: {}  # the fp32-output path: Float16Module upcasts the logits
    fp32 = S.forward_stats(chunks, batch, mbs, lp)
    print("RESULT " + json.dumps({"kwargs": kwargs, "logp_equal": torch.equal(bf16.logp, fp32.logp),
                                  "entropy_equal": torch.equal(bf16.entropy, fp32.entropy),
                                  "finite": bool(torch.isfinite(bf16.logp).all())}), flush=True)
    dist.barrier()


if __name__ == "__main__":
    main()
