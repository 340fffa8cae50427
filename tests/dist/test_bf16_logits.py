"""bf16 logits go to the fused log-prob pass without an fp32 copy, and change nothing."""

from tests.helpers import REPO, torchrun


def test_bf16_logits_without_an_fp32_copy_give_identical_logprobs():
    (result,) = torchrun(REPO / "tests/dist/scripts/bf16_logits.py", 1)
    assert result == {"kwargs": {"fp32_output": False}, "logp_equal": True, "entropy_equal": True, "finite": True}
