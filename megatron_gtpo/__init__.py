"""megatron-gtpo: GTPO / GRPO / Dr. GRPO / DAPO post-training on Megatron-Core with vLLM rollouts."""

__version__ = "0.1.0"
