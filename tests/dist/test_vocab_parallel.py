"""The vocab-parallel log-prob / entropy / argmax kernel on 2 gloo ranks against a dense float64
reference, including padded vocabularies: padding columns holding large arbitrary logits and, at
TP=2, a shard made only of padding must give exactly the unpadded results (log-probs, entropies,
gradients, greedy ids). Fast; the slow train-step tests repeat the same checks at TP=4."""

from __future__ import annotations

from tests.dist.test_trainstep_equivalence import SCRIPT, _check_vocab_parallel
from tests.helpers import torchrun


def test_vocab_parallel_kernel_with_padding_tp1_and_tp2():
    records = torchrun(SCRIPT, 2, "--logprob-tp", "1", "2")
    _check_vocab_parallel(records, 1, 2)
    _check_vocab_parallel(records, 2, 2)
    padded = {r["case"] for r in records if "pad" in r["case"]}
    assert {"fp64_pad_large", "fp32_pad_large_floor", "fp64_pad_only_shard", "argmax_pad20"} <= padded
