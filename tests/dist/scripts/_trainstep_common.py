"""Shared pieces of the train-step equivalence scripts: a tiny model config, a global batch whose
groups straddle DP ranks and micro-batches, weight copying from a TP1/PP1 reference into any
TP/PP/VPP layout, and the single-process reference loss/gradients computed with plain autograd
(dense log-softmax, no schedule, no DDP) on the whole batch."""

from __future__ import annotations

import torch

from megatron_gtpo import algo
from megatron_gtpo.train import model as M
from megatron_gtpo.types import TrainBatch

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


def make_batch(seed: int = 0, *, num_groups: int = 3, group_size: int = 4) -> TrainBatch:
    """Prompts of different lengths; completions share prefixes/suffixes (GTPO conflicts), end in
    EOS and vary in length; one group has all-equal rewards (zero advantages); extra right padding."""
    g = torch.Generator().manual_seed(seed)

    def rand(n):
        return torch.randint(3, VOCAB, (n,), generator=g).tolist()

    rows, starts, group_ids, rewards = [], [], [], []
    reward_sets = [[1.0, 0.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0], [0.5, 1.0, 0.0, 0.25]]
    for gi in range(num_groups):
        prompt, template = rand(int(torch.randint(2, 7, (1,), generator=g))), rand(10)
        for j in range(group_size):
            pre = int(torch.randint(0, 4, (1,), generator=g))
            comp = template[:pre] + rand(int(torch.randint(1, 6, (1,), generator=g))) + template[-2:] + [EOS]
            rows.append(prompt + comp)
            starts.append(len(prompt))
            group_ids.append(gi)
            rewards.append(reward_sets[gi % len(reward_sets)][j % 4])
    width = max(len(r) for r in rows) + 3
    ids = torch.full((len(rows), width), PAD, dtype=torch.long)
    mask = torch.zeros(len(rows), width)
    for b, (row, start) in enumerate(zip(rows, starts)):
        ids[b, :len(row)] = torch.tensor(row)
        mask[b, start:len(row)] = 1.0
    sampler = torch.where(mask > 0, -2.0 - torch.rand(mask.shape, generator=g), torch.zeros(()))
    rewards_t = torch.tensor(rewards)
    return TrainBatch(input_ids=ids, loss_mask=mask, position_ids=torch.arange(width).expand(len(rows), width).clone(),
                      group_ids=torch.tensor(group_ids), rewards=rewards_t,
                      advantages=algo.group_advantages(rewards_t, torch.tensor(group_ids), std_scale=False),
                      sampler_logprobs=sampler, pad_id=PAD, completion_start=torch.tensor(starts))


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


def completion_rows(batch: TrainBatch):
    """``(token_ids, mask, seq_positions)`` left-aligned completions, built independently of
    train/batching.py with a plain loop."""
    lengths = batch.loss_mask.sum(1).long()
    width = int(lengths.max())
    ids = torch.full((len(lengths), width), batch.pad_id, dtype=torch.long)
    pos = torch.zeros(len(lengths), width, dtype=torch.long)
    for b in range(len(lengths)):
        where = batch.loss_mask[b].nonzero().squeeze(1)
        ids[b, :len(where)] = batch.input_ids[b, where]
        pos[b, :len(where)] = where
    mask = torch.arange(width)[None] < lengths[:, None]
    return ids, mask, pos


def dense_token_stats(logits: torch.Tensor, batch: TrainBatch, temperature: float):
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


def reference_loss(model, batch: TrainBatch, *, algo_name: str, prepare_kwargs: dict, loss_kwargs: dict,
                   temperature: float, ref_logp_seq: torch.Tensor | None = None,
                   old_logp: torch.Tensor | None = None, mean_entropy: torch.Tensor | None = None):
    """Whole-batch loss with algo.policy_loss; returns (loss, logp [B,T] detached, <H> [B])."""
    seq = batch.input_ids.shape[1]
    logits = model(batch.input_ids, batch.position_ids, M.causal_mask(seq))
    logp, entropy, clamped, ids, mask = dense_token_stats(logits, batch, temperature)
    if mean_entropy is None:
        mean_entropy = algo.completion_mean_entropy(clamped, mask)
    ref = None
    if ref_logp_seq is not None:
        ref = ref_logp_seq.double().gather(1, completion_rows(batch)[2])
        ref = torch.where(mask, ref, torch.zeros((), dtype=torch.float64))
    loss, metrics = algo.policy_loss(
        algo_name, logp=logp, mask=mask, rewards=batch.rewards, group_ids=batch.group_ids, token_ids=ids,
        entropy=entropy, mean_entropy=mean_entropy, old_logp=old_logp, ref_logp=ref, **loss_kwargs,
        **prepare_kwargs)
    return loss, logp.detach(), mean_entropy, metrics
