"""Rollouts on vLLM: sample G completions per prompt from the current policy weights, and score them.

    Prompt --RolloutEngine.generate--> Completion (tokens, sampler log-probs, finish reason, version)
    RolloutGroup: one generate call fanned out over the job's engines (same result on every rank)
    RolloutCollector: prompts -> engines -> reward -> kept groups (DAPO dynamic sampling) per step

Weights reach the engines through :mod:`megatron_gtpo.sync`. vLLM is imported only when an engine
is built.
"""

from megatron_gtpo.rollout.config import RolloutConfig
from megatron_gtpo.rollout.engine import RolloutEngine, prompt_seeds
from megatron_gtpo.rollout.group import RolloutGroup

__all__ = ["RolloutConfig", "RolloutEngine", "RolloutGroup", "prompt_seeds"]
