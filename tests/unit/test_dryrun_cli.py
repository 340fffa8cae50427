"""``megatron-gtpo dry-run`` end to end in-process: real recipes, real config loader, printed report, exit codes.

The layouts of the README (Llama-3-8B on 2 x 8 GPUs; Qwen2.5-32B on 4 x 8 with colocated engines of
TP=4, and with a separate pool of rollout servers) and rejected ones.
"""

from __future__ import annotations

import re

import pytest

from megatron_gtpo.cli import dry_run as dryrun
from megatron_gtpo.utils.configuration import ConfigError

MODELS = "configs/models"
# Overrides shared by the GPU examples: bf16 everywhere, 64 prompts x 8 completions of up to 1024 tokens
# after prompts of up to 1024, half of each GPU for vLLM, distributed optimizer (every size the checks
# depend on is pinned, so recipe defaults can change). lr is restated because an override of one key
# of optim.optimizer replaces that whole dict (apply_overrides).
GPU = ["model.dtype=bfloat16", "train.prompts_per_step=64", "rollout.n=8", "rollout.max_tokens=1024",
       "data.max_prompt_tokens=1024",
       "rollout.vllm.dtype=bfloat16", "rollout.vllm.gpu_memory_utilization=0.5",
       "optim.optimizer.use_distributed_optimizer=true", "optim.optimizer.lr=1.0e-6"]
PLANNED = [a for a in GPU if "gpu_memory_utilization" not in a]  # vLLM's share left to the plan


def run(capsys, *argv: str) -> tuple[int, str]:
    code = dryrun.main(list(argv))
    out = capsys.readouterr()
    return code, out.out + out.err


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch):
    from tests.helpers import REPO

    monkeypatch.chdir(REPO)


def test_llama3_8b_on_2_nodes_of_8(capsys):
    code, out = run(capsys, "configs/gtpo.yaml", "--nodes", "2", "--gpus-per-node", "8",
                    "--hf-config", f"{MODELS}/llama3-8b.json", *GPU, "parallel.tp=2", "parallel.dp=8",
                    "train.micro_batch_size=4")
    assert code == 0, out
    for line in ["trainer  TP=2 x PP=1 x DP=8 = 16 ranks on 2 node(s)",
                 "rollout  colocated on the trainer's 16 GPUs: 16 vLLM engine(s) x TP=1; 32 sequences per engine",
                 "batch    512 sequences per step; 64 per DP rank packed into micro-batches of <= 2048 tokens",
                 "push     15.0 GiB per engine rank per step: full tensors gathered over TP/PP one at a time (one "
                 "whole-model engine per rank)",
                 "weights (bf16)                                   7.5",
                 "optimizer (adam, 12 B/param)                     5.6  sharded over DP=8",
                 "KV cache (32 seqs x 2048 tokens)                 8.0",
                 # Packing (the default): one micro-batch is one row of the 2048-token budget.
                 "logits (1 micro-batch: 2 copies, bf16)           0.5  last stage; packed: 1 row of 2048 tokens",
                 "activations (te layers)                          5.3",
                 "= train phase (trainer total)                   33.8",
                 "vLLM share                                      40.0  gpu_memory_utilization=0.5 (set by the recipe)",
                 "= rollout phase (trainer resident + vLLM)       68.0  trainer resident 28.0",
                 "OK       launch: sbatch --nodes=2 --gpus-per-node=8 slurm/train.sbatch"]:
        assert line in out, line
    assert "warning" not in out


def test_padded_micro_batches_are_planned_at_micro_batch_size_rows(capsys):
    """``train.micro_batch_tokens=0``: micro-batches of micro_batch_size rows of the longest
    sequence, four times the packed logits and activations of the same layout."""
    code, out = run(capsys, "configs/gtpo.yaml", "--nodes", "2", "--gpus-per-node", "8",
                    "--hf-config", f"{MODELS}/llama3-8b.json", *GPU, "parallel.tp=2", "parallel.dp=8",
                    "train.micro_batch_size=4", "train.micro_batch_tokens=0")
    assert code == 0, out
    for line in ["batch    512 sequences per step; 64 per DP rank = 16 micro-batch(es) of 4; up to 2048 tokens each",
                 "logits (1 micro-batch: 2 copies, bf16)           2.0  last stage; 4 rows x 2048 tokens",
                 "activations (te layers)                         21.2",
                 "= train phase (trainer total)                   51.2"]:
        assert line in out, line


def test_engine_tp4_qwen25_32b_on_4_nodes_of_8_is_valid_and_plans_the_vllm_share(capsys):
    code, out = run(capsys, "configs/gtpo.yaml", "--nodes", "4", "--gpus-per-node", "8",
                    "--hf-config", f"{MODELS}/qwen2.5-32b.json", *PLANNED, "parallel.tp=4", "parallel.pp=2",
                    "parallel.vpp=2", "parallel.dp=4", "train.micro_batch_size=2",
                    "rollout.vllm.tensor_parallel_size=4")
    assert code == 0, out
    assert "TP=4 x PP=2 x VPP=2 x DP=4 = 32 ranks on 4 node(s); 32 layers per PP stage (16 per virtual stage)" in out
    assert ("8 vLLM engine(s) x TP=4, each over 4 consecutive ranks = Megatron's TP groups; "
            "64 sequences per engine per step") in out
    assert "128 per DP rank packed into micro-batches of <= 2048 tokens" in out
    assert "push     17.4 GiB per engine rank per step: its own TP shards, no gather" in out
    for term in ["weights (bf16)", "gradients (fp32)", "optimizer (adam, 12 B/param)",
                 "logits (1 micro-batch: 2 copies, bf16)", "activations (te layers)",
                 "recompute: none; 2.5 micro-batch(es) in flight", "= train phase (trainer total)                   48.3",
                 "push buffers", "= push phase", "rollout weights (bf16, TP=4)", "KV cache (64 seqs x 2048 tokens)",
                 "gpu_memory_utilization=0.52 (planned: what the rollout phase leaves)",
                 "= rollout phase (trainer resident + vLLM)", "reserve (CUDA context, NCCL, fragmentation)"]:
        assert term in out, term
    # the one warning: 427 GiB saved every 10 steps (gtpo.yaml's checkpoint_every) is 19% of a 120 s step
    assert [w for w in out.splitlines() if w.startswith("warning")] == [
        "warning  checkpoints take 19% of the training time (229 s per save every 10 step(s) of ~120 s, --step-time-s), "
        "over 5%: raise train.checkpoint_every to 39 or more"]


def test_packed_layout_ignores_micro_batch_size_in_the_dry_run_and_the_config(capsys):
    """The README's Qwen2.5-32B layout on 4 x 8 (DP=4) with one prompt per step: 8 sequences, 2 per
    DP rank. Packing (the default) ignores train.micro_batch_size (8 here, its default), so training
    accepts it; the dry-run must too: one rule (parallel.layout.batch_split_problem), one input
    (train.rows_per_micro_batch)."""
    from megatron_gtpo.config import load_config

    layout = ["parallel.tp=4", "parallel.pp=2", "parallel.vpp=2", "parallel.dp=4", "train.prompts_per_step=1",
              "rollout.vllm.tensor_parallel_size=4"]
    overrides = [a for a in PLANNED if "prompts_per_step" not in a] + layout
    cfg = load_config("configs/gtpo.yaml", overrides)
    assert cfg.train.micro_batch_size == 8 and cfg.train.rows_per_micro_batch == 1
    code, out = run(capsys, "configs/gtpo.yaml", "--nodes", "4", "--gpus-per-node", "8",
                    "--hf-config", f"{MODELS}/qwen2.5-32b.json", *overrides)
    assert code == 0, out
    assert "batch    8 sequences per step; 2 per DP rank packed into micro-batches of <= 2048 tokens" in out
    # padded micro-batches do use micro_batch_size: 8 sequences do not fill 4 x 8 rows, and the recipe is
    # refused with the rule's one message (the dry-run reads it through the config loader: bad input)
    code, out = run(capsys, "configs/gtpo.yaml", "--nodes", "4", "--gpus-per-node", "8",
                    "--hf-config", f"{MODELS}/qwen2.5-32b.json", *overrides, "train.micro_batch_tokens=0")
    message = "not divisible by parallel.dp x train.micro_batch_size = 4 x 8 = 32"
    assert code == dryrun.EXIT_BAD_INPUT and message in out
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        load_config("configs/gtpo.yaml", overrides + ["train.micro_batch_tokens=0"])


def test_rollout_nodes_separate_pool_for_qwen25_32b(capsys):
    code, out = run(capsys, "configs/gtpo.yaml", "--nodes", "4", "--gpus-per-node", "8", "--rollout-nodes", "2",
                    "--hf-config", f"{MODELS}/qwen2.5-32b.json", *PLANNED, "sync.transport=separate",
                    "parallel.tp=4", "parallel.pp=2", "parallel.dp=2", "train.micro_batch_size=2",
                    "rollout.vllm.tensor_parallel_size=8")
    assert code == 0, out
    assert "trainer  TP=4 x PP=2 x DP=2 = 16 ranks on 2 node(s)" in out
    assert "separate: 2 rollout server(s) x TP=8, one per rollout node (2 node(s) of their own)" in out
    assert "push     61.0 GiB per step to each of 2 rollout server(s) (122.1 GiB in all) from 2 sender rank(s)" in out
    assert "gpu_memory_utilization=0.9 (planned: a rollout node holds nothing else)" in out
    assert "OK       launch: ROLLOUT_NODES=2 sbatch --nodes=4 --gpus-per-node=8 slurm/train.sbatch" in out


def test_colocated_share_that_starves_the_trainer_is_rejected(capsys):
    code, out = run(capsys, "configs/gtpo.yaml", "--nodes", "2", "--gpus-per-node", "8",
                    "--hf-config", f"{MODELS}/llama3-8b.json", *PLANNED, "rollout.vllm.gpu_memory_utilization=0.9",
                    "parallel.tp=2", "parallel.dp=8", "train.micro_batch_size=4")
    assert code == dryrun.EXIT_IMPOSSIBLE
    assert "the engine would refuse to start; set rollout.vllm.gpu_memory_utilization <= 0.59" in out


def test_impossible_layout_is_rejected_with_every_reason(capsys):
    code, out = run(capsys, "configs/gtpo.yaml", "--nodes", "4", "--gpus-per-node", "8",
                    "--hf-config", f"{MODELS}/qwen2.5-32b.json", "model.dtype=bfloat16", "parallel.tp=16",
                    "parallel.pp=3", "train.prompts_per_step=64")
    assert code == dryrun.EXIT_IMPOSSIBLE
    assert "REJECTED: impossible layout:" in out
    assert "num_attention_heads=40 is not divisible by TP=16: choose parallel.tp among 1, 2, 4, 5, 8, 10, 20, 40" in out
    assert "num_hidden_layers=64 is not divisible by PP=3" in out
    assert "32 trainer GPUs are not divisible by TP*PP = 16*3 = 48" in out


def test_layout_that_does_not_fit_in_memory_is_rejected(capsys):
    code, out = run(capsys, "configs/gtpo.yaml", "--nodes", "4", "--gpus-per-node", "8",
                    "--hf-config", f"{MODELS}/qwen2.5-32b.json", *GPU, "parallel.dp=32", "train.micro_batch_size=2")
    assert code == dryrun.EXIT_IMPOSSIBLE
    assert "REJECTED: does not fit:" in out and "trainer needs" in out


def test_builtin_model_name_is_sized_from_its_config(capsys):
    code, out = run(capsys, "configs/tiny.yaml", "model.path=tiny-char", "--nodes", "1", "--gpus-per-node", "2")
    assert code == 0, out
    assert "(qwen2): 2 layers, hidden 128, 4 heads / 2 KV heads x 32, vocab 128" in out
    assert "TP=2 x PP=1 x DP=1 = 2 ranks on 1 node(s)" in out
    assert "memory   per GPU, MiB" in out


def test_bad_input_exits_2_naming_the_problem(capsys, tmp_path):
    code, out = run(capsys, "configs/nope.yaml", "--nodes", "1", "--gpus-per-node", "1")
    assert code == dryrun.EXIT_BAD_INPUT and "recipe file configs/nope.yaml does not exist" in out
    code, out = run(capsys, "configs/gtpo.yaml", f"model.path={tmp_path}", "--nodes", "1", "--gpus-per-node", "1")
    assert code == dryrun.EXIT_BAD_INPUT and "pass --hf-config" in out


def test_help_lists_the_flags(capsys):
    with pytest.raises(SystemExit) as exit_:
        dryrun.main(["--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert "megatron-gtpo dry-run" in text and "--gpus-per-node" in text and "--hf-config" in text


def test_dp_is_derived_from_the_gpus_only_when_the_recipe_leaves_it_unset(capsys):
    """The README's `dry-run configs/gtpo.yaml --nodes 2 --gpus-per-node 8` asked for parallel.dp=16
    (base.yaml set dp: 1). Injected bug: `sets_dp` returning True -> REJECTED, fails; an explicit
    parallel.dp=1 is still checked against the GPUs."""
    code, out = run(capsys, "configs/gtpo.yaml", "--nodes", "2", "--gpus-per-node", "8", "train.prompts_per_step=16")
    assert code == 0, out
    assert "TP=1 x PP=1 x DP=16 = 16 ranks on 2 node(s)" in out
    assert "parallel.dp is not set: derived DP=16 from the GPUs" in out and "add parallel.dp=16" in out
    code, out = run(capsys, "configs/gtpo.yaml", "--nodes", "2", "--gpus-per-node", "8", "train.prompts_per_step=16",
                    "parallel.dp=1")
    assert code == dryrun.EXIT_IMPOSSIBLE and "set parallel.dp=16" in out


def test_checkpoint_size_and_time_per_save_with_a_warning_past_the_stated_shares(capsys):
    """The 32B recipe saves ~460 GB every 10 steps and the dry-run never said so. Injected bug:
    `optimizer_bytes_per_param` left out of `checkpoint_cost` (weights only) -> 61 GiB, fails; the
    warning's share compared with `<` -> no warning, fails."""
    args = ["configs/gpu/gtpo_qwen2.5-32b_4x8_pool.yaml", "--nodes", "6", "--gpus-per-node", "8",
            "--rollout-nodes", "2", "--hf-config", f"{MODELS}/qwen2.5-32b.json"]
    code, out = run(capsys, *args, "--disk-gib", "1000")
    assert code == 0, out
    # 32.76 B parameters x (2 B bf16 weights + 12 B fp32 Adam moments and master copy) = 459 GB = 427.1 GiB
    assert re.search(r"ckpt     427\.\d GiB per save \(weights \+ optimizer state\) every 10 step\(s\), 1281\.\d GiB "
                     r"on disk \(train\.keep_last=2 \+ the save in progress\); ~229 s per save at 2 GB/s", out), out
    assert "warning  checkpoints take 19% of the training time (229 s per save every 10 step(s) of ~120 s" in out
    assert "raise train.checkpoint_every to 39 or more" in out
    assert "over 50% of the 1000 GiB disk (--disk-gib): lower train.keep_last" in out
    code, out = run(capsys, *args, "train.checkpoint_every=50", "--fs-gbps", "4")
    assert code == 0 and "~115 s per save at 4 GB/s" in out and "checkpoints take" not in out, out
