"""A scripted reward for DAPO's dynamic-sampling test (loaded by dotted path in scoring workers)."""

from megatron_gtpo.reward.functions import RewardOutput
from megatron_gtpo.reward.toy import alphabet_count


def half_constant_reward(completion, gold, task):
    """Every completion of a prompt whose gold text has an odd length is wrong (an all-equal group
    that dynamic sampling on accuracy must drop); otherwise the toy reward, with correctness by the
    completion's length parity (groups of mixed accuracy, kept). Correctness, not the reward,
    decides: DAPO's overlong punishment moves rewards, never accuracy (DAPO Eq. 11)."""
    if len(gold) % 2:
        return RewardOutput(reward=0.0, correct=False)
    return RewardOutput(reward=alphabet_count(completion, gold, task).reward, correct=len(completion) % 2 == 0)
