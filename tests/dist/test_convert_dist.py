"""Conversion, loading, logits parity and streaming export on 2 and 4 gloo ranks.

One module-scoped set of tiny HF models (Llama tied + llama3 RoPE, Qwen2, Qwen3, Mistral, Phi-3 and
the mixtures of experts Qwen3-MoE, Qwen2-MoE, Mixtral; the Qwen2 one sharded with an index;
vocabulary 257, RoPE theta 12345) is converted by the CLI with ``--tp 2 --pp 2`` (``--ep 2`` for the
mixtures of experts), which pads the vocabulary to 512 rows; the dist scripts then load that
checkpoint at other layouts (Megatron reshards at load; TP=1 models have 384 rows). The mixtures of
experts run with EP=2 wherever a stage has two ranks: EP2 over DP2, TP2 x EP2, and TP2 x EP2 x PP2
on 4 ranks (experts whole on their rank, ETP=1).

Logits parity with transformers (fp32, eager attention) is held to LOGITS_TOL = 1e-6 absolute on
logits of magnitude ~1: tight enough that a rope_theta 10% off fails it (a negative control on
every family; measured 5e-5 .. 2e-3), loose enough for the different op order of the two
implementations (fused qkv GEMM, TP-split GEMMs; measured <= 3e-7). The tests print the numbers.
"""

from __future__ import annotations

import pytest
import torch

from megatron_gtpo.cli.convert import main as convert_main
from megatron_gtpo.convert.hf_io import HFReader
from tests.helpers import REPO, torchrun
from tests.tiny_hf import FAMILIES, MOE_FAMILIES, VOCAB_SIZE, save_tiny_hf_model

LOGITS_TOL = 1e-6


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("convert")
    for seed, family in enumerate(FAMILIES):
        save_tiny_hf_model(family, root / family / "hf", seed=seed,
                           max_shard_size="150KB" if family == "qwen2" else None)
        ep = ["--ep", "2"] if family in MOE_FAMILIES else []
        assert convert_main(["--to", "megatron", "--input", str(root / family / "hf"),
                             "--output", str(root / family / "mcore"), "--tp", "2", "--pp", "2", *ep]) == 0
    return root


def _assert_same_checkpoint(ref_dir, got_dir):
    ref, got = HFReader(ref_dir), HFReader(got_dir)
    assert sorted(ref.names()) == sorted(got.names())
    for name in ref.names():
        a, b = ref.get(name), got.get(name)
        assert a.dtype == b.dtype and torch.equal(a, b), name


def test_layouts_on_two_ranks(work):
    """(TP, PP) in {(1,1) x DP2, (2,1), (1,2)}: logits match transformers, direct HF load equals the
    checkpoint load, and both export modes reproduce the HF tensors bit for bit."""
    results = torchrun(REPO / "tests/dist/scripts/convert_parity.py", 2, str(work))
    assert len(results) == 2 * 3 * len(FAMILIES)
    print("max |logits - transformers| per family/layout:",
          {f"{r['family']}{r['layout']}": r["logits_diff"] for r in results if r["logits_diff"] is not None},
          "wrong rope_theta:", {r["family"]: r["wrong_theta_diff"] for r in results if r["wrong_theta_diff"]},
          "max |logit|:", max(r["logits_scale"] for r in results))
    for family in FAMILIES:
        for layout in ([1, 1], [2, 1], [1, 2]):
            rows = [r for r in results if r["family"] == family and r["layout"] == layout]
            diffs = [r["logits_diff"] for r in rows if r["logits_diff"] is not None]
            # PP=2: only the last stage (rank 1) has logits; otherwise both ranks.
            assert len(diffs) == (1 if layout == [1, 2] else 2), rows
            assert max(diffs) <= LOGITS_TOL, (family, layout, diffs)
            # the mixtures of experts ran expert-parallel wherever the stage had two ranks
            assert {r["ep"] for r in rows} == {2 if family in MOE_FAMILIES and layout != [1, 2] else 1}, rows
            assert all(r["pad_logit"] == 0.0 for r in rows if r["logits_diff"] is not None), rows  # zero rows
            if layout == [1, 1]:  # negative control: a 10% rope_theta error is far outside the tolerance
                assert all(r["wrong_theta_diff"] > 10 * LOGITS_TOL for r in rows), rows
            # embedding rows: 257 padded to a multiple of 128 x TP (stage 0 holds the embedding)
            assert [n for r in rows for n in r["padded_rows"]] == [384 if layout[0] == 1 else 512] * (
                1 if layout == [1, 2] else 2), rows
            for r in rows:
                assert r["direct_load_equal"] and r["export_all_complete"] and r["export_all_equal"], r
                assert r["export_first_equal"], r
                assert r["export_first_complete"] == (r["rank"] == 0), r
                assert r["hf_order"][0] == "model.embed_tokens.weight", r
            tied = family == "llama"
            assert rows[0]["hf_order"][-1] == ("model.norm.weight" if tied else "lm_head.weight")


@pytest.mark.slow
def test_tp2_pp2_roundtrip_is_bit_exact(work):
    """HF -> Megatron -> live model at TP=2 x PP=2 (and VPP=2) -> exporter -> HF files: identical
    (vocabulary 257: padded to 512 rows in the checkpoint and the model, stripped on export)."""
    results = torchrun(REPO / "tests/dist/scripts/roundtrip_tp2pp2.py", 4, str(work))
    assert len(results) == 4 * 2 * len(FAMILIES)
    print("max |logits - transformers| at TP2 x PP2:",
          {f"{r['family']}/{r['layout']}": r["logits_diff"] for r in results if r["logits_diff"] is not None})
    for r in results:
        assert (r["buckets"] > 1) == (r["rank"] == 0), r  # "first": only global rank 0 receives
        assert r["ep"] == (2 if r["family"] in MOE_FAMILIES else 1), r  # TP2 x EP2 x PP2 for the experts
        if r["rank"] >= 2:  # last pipeline stage
            assert r["logits_diff"] is not None and r["logits_diff"] <= LOGITS_TOL, r
            assert r["pad_logit"] == 0.0, r  # padding rows of the output layer stayed zero
    vpp_offsets = {r["rank"]: r["layer_offsets"] for r in results if r["layout"] == "tp2pp2_vpp2"}
    assert vpp_offsets[0] == [0, 2] and vpp_offsets[2] == [1, 3]  # interleaved layer assignment
    for family in FAMILIES:
        for suffix in ("tp2pp2", "tp2pp2_vpp2"):
            _assert_same_checkpoint(work / family / "hf", work / family / f"back_{suffix}")
