"""Rollouts on vLLM: everything that generates, and the G completions per prompt it returns.

    Prompt, Sampling --Engine.submit -> wait--> Completion (tokens, sampler log-probs, finish, version)
    RolloutGroup: one generate call fanned out over the job's engines (same result on every rank)
    RolloutCollector: prompts -> engines -> reward -> kept groups (DAPO dynamic sampling) per step
    placement.build_engines: which engines a job starts (in the trainer processes, or a server pool)
    memory: sleep/wake of colocated engines and the trainer's offload around rollout and push

Other packages use engines only through ``protocol.py``; weights reach them through
:mod:`megatron_gtpo.sync`. vLLM is imported only when an engine is built. ``placement`` is not
imported here: it imports the pool, which still imports ``megatron_gtpo.sync``.
"""

from megatron_gtpo.rollout.config import EnginePlacement, RolloutConfig, Sampling
from megatron_gtpo.rollout.engine import RolloutEngine, prompt_seeds
from megatron_gtpo.rollout.group import RolloutGroup

__all__ = ["EnginePlacement", "RolloutConfig", "RolloutEngine", "RolloutGroup", "Sampling", "prompt_seeds"]
