"""A scripted reward for DAPO's dynamic-sampling test (loaded by dotted path in scoring workers)."""

from megatron_gtpo.reward.toy import alphabet_count


def half_constant_reward(completion, gold, task):
    """0 for every completion of a prompt whose gold text has an odd length (an all-equal group that
    dynamic sampling must drop), else the toy reward (groups with mixed rewards)."""
    if len(gold) % 2:
        return 0.0
    return alphabet_count(completion, gold, task).reward
