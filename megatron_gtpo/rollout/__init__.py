"""Rollouts on vLLM: everything that generates, and the G completions per prompt it returns.

    Prompt, Sampling --Engine.submit -> wait--> Completion (tokens, sampler log-probs, finish, version)
    RolloutGroup: one generate call fanned out over the job's engines (same result on every rank)
    RolloutCollector: prompts -> engines -> reward -> kept groups (DAPO dynamic sampling) per step
    placement.build_engines: which engines a job starts (in the trainer processes, or a server pool)
    memory: sleep/wake of colocated engines and the trainer's offload around rollout and push
    pool / server: rank 0's pool of rollout servers and the server program, on the authenticated
    data-only channel (utils/channel.py; the generate requests in messages.py)

Other packages use engines only through ``protocol.py``; weights reach them through
:mod:`megatron_gtpo.sync`, which this package never imports. vLLM is imported only when an engine
is built.
"""

from megatron_gtpo.rollout.config import EnginePlacement, RolloutConfig, Sampling
from megatron_gtpo.rollout.engine import RolloutEngine, prompt_seeds
from megatron_gtpo.rollout.group import RolloutGroup
from megatron_gtpo.rollout.placement import build_engines

__all__ = ["EnginePlacement", "RolloutConfig", "RolloutEngine", "RolloutGroup", "Sampling", "build_engines",
           "prompt_seeds"]
