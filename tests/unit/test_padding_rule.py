"""The sequence padding multiple (train/model.py ``padding_multiple``), per FP8 recipe and TP size,
against the checks Transformer Engine 2.11 makes (written out here from its source, see the table's
comment in train/model.py): with sequence parallelism each TP rank's shard of the tokens must pass
``assert_dim_for_fp8_exec`` (rows % 8) and, for block-scaled recipes, be quantizable before the
all-gather (rows % 32 for MXFP8, % 128 for blockwise); the whole micro-batch must keep the FP8
GEMM's token dimension 16-byte aligned (and whole scaling blocks)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron_gtpo.train.model import padding_multiple, sequence_multiple
from megatron_gtpo.utils.configuration import ConfigError

SHARD = {"delayed": 8, "tensorwise": 8, "mxfp8": 32, "blockwise": 128}
WHOLE = {"delayed": 16, "tensorwise": 16, "mxfp8": 32, "blockwise": 128}


def te_accepts(tokens: int, *, recipe: str, tp: int, sequence_parallel: bool) -> bool:
    """TE 2.11's checks on one micro-batch of ``tokens`` tokens (the rules above)."""
    if sequence_parallel and (tokens % tp or (tokens // tp) % SHARD[recipe]):
        return False  # a rank's shard, checked before the all-gather
    return tokens % WHOLE[recipe] == 0


@pytest.mark.parametrize("recipe", sorted(SHARD))
@pytest.mark.parametrize("tp", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("sp", [False, True])
def test_every_padded_length_passes_te_and_the_multiple_is_the_smallest(recipe, tp, sp):
    multiple = padding_multiple(recipe=recipe, tp=tp, sequence_parallel=sp)
    for tokens in range(1, 3 * multiple + 1):
        padded = -(-tokens // multiple) * multiple
        assert te_accepts(padded, recipe=recipe, tp=tp, sequence_parallel=sp), (tokens, padded)
    smaller = [m for m in range(1, multiple) if all(te_accepts(k * m, recipe=recipe, tp=tp, sequence_parallel=sp)
                                                    for k in range(1, 9))]
    assert smaller == []  # no smaller multiple would do: no padding beyond what TE needs


def test_the_values_per_recipe_and_tp():
    sp = {tp: {r: padding_multiple(recipe=r, tp=tp, sequence_parallel=True) for r in SHARD} for tp in (1, 2, 4, 8)}
    assert sp[1] == {"blockwise": 128, "delayed": 16, "mxfp8": 32, "tensorwise": 16}
    assert sp[2] == {"blockwise": 256, "delayed": 16, "mxfp8": 64, "tensorwise": 16}
    assert sp[4] == {"blockwise": 512, "delayed": 32, "mxfp8": 128, "tensorwise": 32}
    assert sp[8] == {"blockwise": 1024, "delayed": 64, "mxfp8": 256, "tensorwise": 64}
    # the review's case: 2016 tokens are a multiple of lcm(16, 8) = 16 but leave 252 per rank at TP=8,
    # which TE's assert_dim_for_fp8_exec refuses (252 % 8 = 4)
    assert 2016 % 16 == 0 and (2016 // 8) % 8 == 4 and 2016 % sp[8]["delayed"] != 0
    assert padding_multiple(recipe=None, tp=8, sequence_parallel=True) == 8  # bf16: the sequence splits over TP
    assert padding_multiple(recipe=None, tp=8, sequence_parallel=False) == 1
    assert padding_multiple(recipe="nvfp4", tp=4, sequence_parallel=True) == 64
    assert padding_multiple(recipe="custom", tp=2, sequence_parallel=False) == 128
    with pytest.raises(ConfigError, match="fp8_recipe='fancy'"):
        padding_multiple(recipe="fancy", tp=1, sequence_parallel=False)


def test_sequence_multiple_reads_the_transformer_config():
    from megatron.core.enums import Fp8Recipe

    cfg = lambda **kw: SimpleNamespace(**{"fp8": None, "sequence_parallel": True, "tensor_model_parallel_size": 8,
                                          **kw})  # noqa: E731
    assert sequence_multiple(cfg()) == 8
    assert sequence_multiple(cfg(fp8="hybrid")) == 64  # Megatron's default recipe: delayed
    assert sequence_multiple(cfg(fp8="e4m3", fp8_recipe=Fp8Recipe.blockwise)) == 1024
    assert sequence_multiple(cfg(fp8="hybrid", fp8_recipe="mxfp8", sequence_parallel=False)) == 32
    assert sequence_multiple(cfg(fp4="e2m1")) == 128  # nvfp4: lcm(32, 16 x 8)
