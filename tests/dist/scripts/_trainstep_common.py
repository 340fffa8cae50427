"""Shared pieces of the train-step equivalence scripts: a tiny model config, a global batch whose
groups straddle DP ranks and micro-batches, weight copying from a TP1/PP1 reference into any
TP/PP/VPP layout, and the single-process reference loss/gradients computed with plain autograd
(dense log-softmax, no schedule, no DDP) on the whole batch."""

from __future__ import annotations

import torch

from megatron_gtpo import algo
from megatron_gtpo.train import model as M
from megatron_gtpo.types import Batch
from tests.algo_helpers import policy_loss

# 200 tokens: Megatron pads to 256 rows at TP 1 and 2 (make_vocab_size_divisible_by 128), so at
# TP=2 rank 0 holds ids 0..127 and rank 1 ids 128..199 plus 56 padding columns. The reference's
# random padding rows give large arbitrary padding logits that the train step must ignore.
VOCAB, PAD, EOS = 200, 0, 2


def tiny_config(*, tied: bool) -> dict:
    """A 4-layer GQA model (PP2 x VPP2 = one layer per virtual stage); Qwen2 has q/k/v biases."""
    arch = "LlamaForCausalLM" if tied else "Qwen2ForCausalLM"
    return {"architectures": [arch], "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": VOCAB,
            "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "tie_word_embeddings": tied}


def make_batch(seed: int = 0, *, num_groups: int = 3, group_size: int = 4) -> Batch:
    """Prompts of different lengths; completions share prefixes/suffixes (GTPO conflicts), end in
    EOS and vary in length; one group has all-equal rewards (zero advantages)."""
    g = torch.Generator().manual_seed(seed)

    def rand(n):
        return torch.randint(3, VOCAB, (n,), generator=g).tolist()

    prompts, comps, group_ids, rewards = [], [], [], []
    reward_sets = [[1.0, 0.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0], [0.5, 1.0, 0.0, 0.25]]
    for gi in range(num_groups):
        prompt, template = rand(int(torch.randint(2, 7, (1,), generator=g))), rand(10)
        for j in range(group_size):
            pre = int(torch.randint(0, 4, (1,), generator=g))
            comps.append(template[:pre] + rand(int(torch.randint(1, 6, (1,), generator=g))) + template[-2:] + [EOS])
            prompts.append(prompt)
            group_ids.append(gi)
            rewards.append(reward_sets[gi % len(reward_sets)][j % 4])
    width, prompt_width = max(len(c) for c in comps), max(len(p) for p in prompts)
    ids = torch.full((len(comps), width), PAD, dtype=torch.long)
    prompt_ids = torch.full((len(comps), prompt_width), PAD, dtype=torch.long)
    for b, (prompt, comp) in enumerate(zip(prompts, comps)):
        ids[b, :len(comp)] = torch.tensor(comp)
        prompt_ids[b, :len(prompt)] = torch.tensor(prompt)
    lengths = torch.tensor([len(c) for c in comps])
    mask = torch.arange(width)[None, :] < lengths[:, None]
    sampler = torch.where(mask, -2.0 - torch.rand(mask.shape, generator=g), torch.zeros(()))
    return Batch(prompt_ids=prompt_ids, prompt_lengths=torch.tensor([len(p) for p in prompts]), token_ids=ids,
                 mask=mask, sampler_logprobs=sampler, rewards=torch.tensor(rewards), group_ids=torch.tensor(group_ids),
                 pad_id=PAD)


def start_layouts() -> tuple[list[str], Batch]:
    """The equivalence scripts' start: the LAYOUT arguments, the gloo world, and their common batch
    (16 rows of 7..20 tokens, groups straddling micro-batches)."""
    import argparse

    import torch.distributed as dist

    parser = argparse.ArgumentParser()
    parser.add_argument("layouts", nargs="+")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    return args.layouts, make_batch(5, num_groups=4, group_size=4)


def sequence_view(batch: Batch, extra: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids [B, S], position_ids [B, S])``: prompt + completion + padding, built with a plain
    loop, independently of train/batching.py."""
    rows = []
    for b in range(batch.size):
        prompt = batch.prompt_ids[b, :int(batch.prompt_lengths[b])].tolist()
        rows.append(prompt + batch.token_ids[b, :int(batch.lengths[b])].tolist())
    width = max(len(r) for r in rows) + extra
    ids = torch.full((len(rows), width), batch.pad_id, dtype=torch.long)
    for b, row in enumerate(rows):
        ids[b, :len(row)] = torch.tensor(row)
    return ids, torch.arange(width).expand(len(rows), width).clone()


# ----------------------------------------------------------------------------- weights


def _global_name(chunk, name: str) -> str:
    """Local parameter name -> TP1/PP1 name (layer index shifted by this chunk's PP/VPP offset)."""
    if name.startswith("decoder.layers."):
        parts = name.split(".")
        parts[2] = str(int(parts[2]) + M.layer_offset(chunk))
        return ".".join(parts)
    return name


def local_piece(full: torch.Tensor, name: str, param, *, tp: int, tp_rank: int) -> torch.Tensor:
    """This TP rank's slice of a TP1 tensor, using Megatron's own partition attributes. SwiGLU's
    fc1 holds [gate; up] and each rank keeps [its gate rows; its up rows]."""
    if not getattr(param, "tensor_model_parallel", False) or tp == 1:
        return full
    dim = param.partition_dim
    if name.endswith("mlp.linear_fc1.weight"):
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp, dim=0)[tp_rank], up.chunk(tp, dim=0)[tp_rank]], dim=0)
    return full.chunk(tp, dim=dim)[tp_rank]


def named_local_params(chunks, *, tied: bool):
    """Yields ``(global_name, local_name, param)`` over all chunks; a tied output layer maps to the
    embedding it shares."""
    for chunk in chunks:
        bare = M.unwrap(chunk)
        for name, param in bare.named_parameters():
            gname = _global_name(bare, name)
            if tied and gname == "output_layer.weight":
                gname = "embedding.word_embeddings.weight"
            yield gname, name, param


def load_full(chunks, full: dict[str, torch.Tensor], *, tied: bool, tp: int, tp_rank: int) -> None:
    with torch.no_grad():
        for gname, name, param in named_local_params(chunks, tied=tied):
            param.copy_(local_piece(full[gname], name, param, tp=tp, tp_rank=tp_rank))


# ----------------------------------------------------------------------------- reference


def completion_rows(batch: Batch):
    """``(token_ids, mask, seq_positions)``: the completion view and where each completion token
    sits in ``sequence_view``."""
    pos = batch.prompt_lengths[:, None] + torch.arange(batch.token_ids.shape[1])[None, :]
    return batch.token_ids, batch.mask, torch.where(batch.mask, pos, torch.zeros_like(pos))


def dense_token_stats(logits: torch.Tensor, batch: Batch, temperature: float):
    """float64 dense log-softmax: per completion token log-prob, exact entropy and the GTPO
    reference's clamped entropy (p floored at 1e-6 inside the log), each [B, T]. ``logits`` may
    carry vocabulary padding columns: only the first VOCAB are the model's distribution."""
    ids, mask, pos = completion_rows(batch)
    logsm = torch.log_softmax(logits[..., :VOCAB].double() / temperature, dim=-1)  # [B, S, V]
    prev = (pos - 1).clamp(min=0)
    rows = torch.arange(ids.shape[0])[:, None]
    token_logp = logsm[rows, prev].gather(-1, ids[..., None]).squeeze(-1)
    probs = logsm[rows, prev].exp()
    entropy = -(probs * logsm[rows, prev]).sum(-1)
    clamped = -(probs * probs.clamp(min=1e-6).log()).sum(-1)
    zero = torch.zeros((), dtype=torch.float64)
    return (torch.where(mask, token_logp, zero), torch.where(mask, entropy, zero),
            torch.where(mask, clamped, zero), ids, mask)


def reference_loss(model, batch: Batch, *, spec, temperature: float, ref_logp: torch.Tensor | None = None,
                   old_logp: torch.Tensor | None = None, mean_entropy: torch.Tensor | None = None):
    """Whole-batch loss (tests/algo_helpers.policy_loss); returns (loss, logp [B,T] detached, <H> [B], metrics).
    ``ref_logp`` [B, T] in the completion view."""
    input_ids, position_ids = sequence_view(batch)
    logits = model(input_ids, position_ids, M.causal_mask(input_ids.shape[1]))
    logp, entropy, clamped, ids, mask = dense_token_stats(logits, batch, temperature)
    if mean_entropy is None:
        mean_entropy = algo.completion_mean_entropy(clamped, mask)
    ref = None if ref_logp is None else torch.where(mask, ref_logp.double(), torch.zeros((), dtype=torch.float64))
    loss, metrics = policy_loss(spec, logp=logp, mask=mask, rewards=batch.rewards, group_ids=batch.group_ids,
                                token_ids=ids, entropy=entropy,
                                mean_entropy=mean_entropy if spec.needs_mean_entropy else None,
                                old_logp=old_logp, ref_logp=ref)
    return loss, logp.detach(), mean_entropy, metrics
