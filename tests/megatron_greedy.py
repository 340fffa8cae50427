"""Greedy decoding with plain Megatron forwards (no KV cache): a test aid that compares Megatron's
greedy tokens with a dense reference model's or vLLM's, at any TP/PP/VPP layout."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_gtpo.parallel.collectives import comm_device
from megatron_gtpo.train.batching import MicroBatch
from megatron_gtpo.train.logprobs import vocab_parallel_argmax
from megatron_gtpo.train.model import true_vocab_size
from megatron_gtpo.train.step import process_groups, run_schedule


@torch.no_grad()
def greedy_generate(model_chunks, prompt_ids: list[list[int]], max_new_tokens: int, dims, *,
                    eos_id: int | None = None, vocab_size: int | None = None) -> list[list[int]]:
    """Greedy continuation of each prompt (O(n^2): every token is a full forward through the
    forward-only pipeline schedule, broadcast from the last stage). Stops after ``eos_id``."""
    groups = process_groups()
    vocab_size = true_vocab_size(model_chunks) if vocab_size is None else vocab_size  # never a padding column
    results = []
    for prompt in prompt_ids:
        tokens, new = list(prompt), []
        for _ in range(max_new_tokens):
            device = comm_device()
            ids = torch.tensor([tokens], dtype=torch.long, device=device)
            one = torch.ones(1, dtype=torch.long, device=device)
            mb = MicroBatch(rows=torch.zeros(1, dtype=torch.long), input_ids=ids,
                            position_ids=torch.arange(len(tokens), device=device)[None, :], start=one, lengths=one,
                            width=1)

            def loss_for(mb, logits):
                nxt = vocab_parallel_argmax(logits[:, -1], group=groups.tp, vocab_start=dims.tp_rank * logits.shape[-1],
                                            vocab_size=vocab_size)
                return logits.new_zeros(()), {"next": nxt}

            # the interleaved schedule needs >= pp micro-batches: repeat the same one
            repeats = dims.pp if (dims.vpp and dims.pp > 1) else 1
            store = run_schedule(model_chunks, [mb] * repeats, loss_for, forward_only=True)
            nxt = store[0]["next"].to(device) if dims.is_last_stage else None
            nxt = broadcast_tensor_from_last_stage(
                nxt, shape=(1,), dtype=torch.long, pp_group=groups.pp, last_stage_rank=groups.last_stage_rank)
            token = int(nxt[0])
            tokens.append(token)
            new.append(token)
            if eos_id is not None and token == eos_id:
                break
        results.append(new)
    return results


def broadcast_tensor_from_last_stage(tensor: torch.Tensor | None, *, shape, dtype, pp_group,
                                     last_stage_rank: int) -> torch.Tensor:
    """The last pipeline stage's tensor on every stage of ``pp_group``: the other stages pass None and
    receive a ``shape``/``dtype`` tensor."""
    if not dist.is_initialized() or dist.get_world_size(pp_group) == 1:
        return tensor
    if dist.get_rank() != last_stage_rank:
        tensor = torch.empty(shape, dtype=dtype, device=comm_device())
    tensor = tensor.to(comm_device()).contiguous()
    dist.broadcast(tensor, src=last_stage_rank, group=pp_group)
    return tensor
