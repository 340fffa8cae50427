"""The one list of metric names the training loop logs, with what each means.

Every metric is named where it is produced (the collector, ``algo``, the train step, the weight
sync, the reporter); this list documents them. The README's metrics table is generated from it
(``python -m megatron_gtpo.metrics``), a unit test checks the README against it, and the e2e tests
check that everything a run logs is listed here.
"""

from __future__ import annotations

import re

ROWS: list[tuple[tuple[str, ...], str]] = [
    (("reward/mean", "reward/std", "reward/accuracy"),
     "reward of the step's completions; share judged correct"),
    (("reward/timeouts", "reward/errors", "reward/overlong", "reward/num_samples"),
     "scoring counters (a timeout or exception scores 0 and is counted)"),
    (("completion/length_mean", "completion/length_max", "completion/truncated_frac"),
     "completion tokens; share that hit `rollout.max_tokens`"),
    (("rollout/groups", "rollout/tries", "rollout/dropped_groups", "rollout/skipped_step"),
     "groups trained on; DAPO dynamic-sampling refills and drops"),
    (("rollout/weight_version_min", "rollout/weight_version_max", "rollout/staleness_max", "rollout/staleness_mean",
      "rollout/partial_frac"),
     "policy version (step of the weight push) that sampled the step's tokens, oldest and newest; most and mean "
     "weight pushes between a token's sampler and the trained weights (<= `rollout.staleness`, checked on every "
     "token); share of completions sampled by more than one version (`rollout.partial: continue`)"),
    (("rollout/overlap_s", "rollout/overlap_frac"),
     "seconds of the step's train phase (`time/train_s`) during which at least one rollout server was generating "
     "(the union of the windows the servers report, rollout/overlap.py; hosts' clocks assumed NTP-synced), and its "
     "share of the phase; only for a pool with one call in flight (`sync.transport: separate`, `rollout.staleness` "
     "<= 1, no `rollout.partial`): 0 on-policy, > 0 when the servers generate while the trainer trains; absent for "
     "colocated engines (they generate before the phase) and with calls in flight across pushes"),
    (("entropy/mean",),
     "mean over completions of `<H>_i`, the mean token entropy (nats, full vocabulary) of the policy before "
     "the update; for GTPO the filter's statistic (probabilities floored at 1e-6 inside the log, as the "
     "reference code), otherwise exact"),
    (("gtpo/filtered_frac",), "share of completions with delta = 0 (entropy above `algo.entropy_threshold`)"),
    (("gtpo/conflict_tokens_per_completion",), "conflict tokens per completion (forward + backward runs)"),
    (("gtpo/lambda_zero_share", "gtpo/lambda_ge2_share"), "share of loss tokens with lambda = 0 / lambda >= 2"),
    (("batch/active_frac",), "share of completions with a non-zero advantage"),
    (("batch/equal_groups_frac",), "share of groups whose rewards are all equal (every A_i = 0: only GTPO's shift acts)"),
    (("gtpo/shift_share",),
     "GTPO regime guard: share of the completions' coefficient mass carried by the entropy shift gamma <H>_i "
     "(sum \\|delta gamma <H> w\\| over that plus sum \\|delta A w\\|; 0 for the others); > 0.5 for 5 steps warns"),
    (("bias/length_drift",),
     "D5: first-order direction in which the step moves the expected completion length, sum_i c_i (\\|o_i\\| - "
     "group mean) / sum_i \\|c_i\\| with c_i the per-token coefficient; < 0 shorter, > 0 longer (algo/regime.py)"),
    (("loss",), "the loss value (at rho = 1 a covariance-like statistic, not a progress measure: spec 6, Prop. 4)"),
    (("clip/low_frac", "clip/high_frac"), "share of tokens clipped below / above (non-zero only for mu > 1; "
     "GSPO: tokens of clipped completions; CISPO: tokens whose IS weight is truncated, which keep their gradient)"),
    (("train/ratio_mean", "train/ratio_min", "train/ratio_max"),
     "importance ratio pi_theta / pi_old (GSPO: the sequence ratio s_i, per token)"),
    (("train/kl_mean",), "k3 KL to the reference model (only with `algo.kl_beta` > 0)"),
    (("optim/grad_norm", "optim/grad_norm_max", "optim/lr", "optim/update_ok"),
     "Megatron optimizer: grad norm before clipping (mean and max over the mu updates), learning rate, "
     "update-applied flag"),
    (("mismatch/logprob_abs_mean", "mismatch/logprob_abs_max", "mismatch/kl_k3"),
     "train-inference mismatch: \\|log-prob(vLLM) - log-prob(Megatron)\\| over sampled tokens, and k3 "
     "KL(engine \\|\\| trainer)"),
    (("mismatch/is_weight_mean", "mismatch/is_weight_max", "mismatch/is_ratio_min", "mismatch/is_ratio_max",
      "mismatch/is_cut_frac"),
     "with `algo.mismatch_correction` tis/mis: spread of the per-token weights w and of r = pi_old / pi_engine; "
     "share of tokens whose weight was truncated (tis, r > C) or masked to 0 (mis, r outside [C_low, C])"),
    (("bias/prefix_wagg_common", "bias/prefix_wagg_common_sum", "bias/prefix_common_len"),
     "D1 (spec 6 Prop. 1): net weight W_agg = sum_i omega_i A_i that the loss puts on the longest prefix shared "
     "by a whole group (per token, and summed over its positions; x number of groups, so per prompt), mean over "
     "groups with both signs; its length. 0 for Dr. GRPO and DAPO, sum_i A_i/(G\\|o_i\\|) for GRPO, > 0 for GTPO"),
    (("bias/prefix_wagg_abs_mean", "bias/prefix_mixed_nodes_per_group", "bias/prefix_wagg_len_corr"),
     "D1 on every prefix-trie node shared by completions of both signs: mean \\|W_agg\\|, nodes per group; "
     "correlation over groups of W_agg(common prefix) with mean\\|o\\|(A>0) - mean\\|o\\|(A<0) (absent when undefined)"),
    (("bias/conflict_beyond_prefix_frac", "bias/conflict_true_prefix_per_seq", "bias/conflict_fwd_excess_per_seq"),
     "D1 vs GTPO's position-matched conflicts (spec 5.3): share of conflict tokens outside a prefix truly shared "
     "with an opposite-sign completion; that prefix's length; forward-run tokens beyond it, per completion"),
    (("bias/surrogate_adv_term", "bias/surrogate_entropy_term", "bias/surrogate_kl_term", "bias/surrogate_is_term",
      "bias/surrogate_cov", "bias/surrogate_loss_gap"),
     "D2 (spec 6 Prop. 4) at the first update: sum_i A_i Omega_i, GTPO's gamma <H> part, the KL part, the part "
     "due to mismatch weights (only with a correction), within-group Cov(A, Omega); `loss` minus "
     "-(adv - entropy) - KL - is (~0: the loss is this statistic, not a progress measure)"),
    (("bias/clip_overshoot_rate",),
     "D4 (spec 6 Prop. 3; mu >= 3): of the tokens in the advantage-favoured clipped region at inner update k, "
     "the share whose \\|log rho\\| still grows by update k+1 (0 when none is clipped)"),
    (("bias/adam_step_ratio", "bias/adam_step_ratio_momentum"),
     "D4 (mu > 1): Adam update norm of the last inner update over the first's, and Adam's momentum-only "
     "prediction C_{T,k} (about (beta1/sqrt(beta2))^(k+1)); near the prediction = momentum-driven updates"),
    (("moe/expert_load/L<i>", "moe/expert_load_max", "moe/expert_load_mean"),
     "mixture of experts, first update: tokens of the busiest expert over the mean per expert, for MoE layer i "
     "(1.0 = perfectly balanced, num_experts = every token on one expert), the worst and the mean layer"),
    (("moe/dropped_frac",), "share of token-to-expert assignments dropped by an expert capacity (0 when dropless)"),
    (("moe/router_entropy",), "mean entropy (nats) of the router's softmax over all experts, per token and MoE layer"),
    (("moe/routing_agreement",),
     "share of (completion token, MoE layer) pairs whose experts in the trainer's forward equal the rollout "
     "engine's (1.0 with `model.moe_routing_replay: rollout`; logged when the engines return their routing)"),
    (("sync/seconds", "sync/gb_per_s", "sync/gigabytes", "sync/version"), "weight push into the engines"),
    (("time/rollout_s", "time/reward_s", "time/train_s", "time/sync_s", "time/step_s"),
     "wall time per stage and per step"),
    (("throughput/tokens_per_s", "throughput/completion_tokens"), "completion tokens trained per second of step time"),
    (("throughput/tokens_per_gpu_s",),
     "completion tokens / (step time x trainer GPUs): the per-GPU throughput peers report (verl's perf/throughput "
     "counts prompt tokens too); rollout servers' GPUs are not counted"),
    (("perf/tokens_per_s", "perf/tokens_per_gpu_s"),
     "tokens (prompt + completion) the train phase processed per second of `time/train_s`, and per trainer GPU"),
    (("perf/tflops_per_gpu", "perf/mfu"),
     "model TFLOPS per trainer GPU of the train phase (6N + 12 L d S per token, PaLM's count: mu updates, the KL "
     "reference's forward, LoRA's frozen base at 4N; models/flops.py) and MFU, its share of `perf.peak_tflops` "
     "(detected: H100/H200 datasheets, a CPU matmul probe)"),
    (("eval/accuracy", "eval/reward_mean"), "greedy accuracy on held-out prompts every `train.eval_every` steps"),
    (("data/prompts", "data/prompts_dropped_too_long"),
     "once per run (at the start step): prompts kept, and dropped for exceeding `data.max_prompt_tokens`"),
]
"""Rows of the README table: the names of one row are logged together."""

METRICS: dict[str, str] = {name: meaning for names, meaning in ROWS for name in names}
"""Metric name -> meaning. A name with ``<i>`` stands for one metric per index (``moe/expert_load/L0``, ...)."""

_INDEXED = [re.compile(re.escape(name).replace("<i>", r"\d+") + "$") for name in METRICS if "<i>" in name]


def markdown_table() -> str:
    """The README's metrics table."""
    lines = ["| name | meaning |", "|---|---|"]
    lines += ["| " + ", ".join(f"`{n}`" for n in names) + f" | {meaning} |" for names, meaning in ROWS]
    return "\n".join(lines)


def unknown(names) -> list[str]:
    """The names in ``names`` that this list does not document."""
    return sorted(n for n in set(names) - set(METRICS) if not any(p.match(n) for p in _INDEXED))


if __name__ == "__main__":
    print(markdown_table())
