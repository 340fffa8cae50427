"""Rollouts on vLLM: sample G completions per prompt from the current policy weights.

    Prompt --RolloutEngine.generate--> Completion (tokens, sampler log-probs, finish reason, version)

Weights reach the engine through :mod:`megatron_gtpo.sync`; :func:`logprob_mismatch` compares the
engine's log-probs with the trainer's every step. vLLM is imported only when an engine is built.
"""

from megatron_gtpo.rollout.config import RolloutConfig
from megatron_gtpo.rollout.engine import RolloutEngine, prompt_seeds
from megatron_gtpo.rollout.mismatch import logprob_mismatch
from megatron_gtpo.rollout.prompts import chat_prompt
from megatron_gtpo.rollout.weights import PushChecker, WeightPushError, WeightSpec

__all__ = ["RolloutConfig", "RolloutEngine", "prompt_seeds", "logprob_mismatch", "chat_prompt",
           "PushChecker", "WeightPushError", "WeightSpec"]
