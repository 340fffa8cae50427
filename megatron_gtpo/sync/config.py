"""Weight-sync settings: which transport moves the trainer's weights into the rollout engines."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from megatron_gtpo.rollout.config import EnginePlacement
from megatron_gtpo.utils.configuration import ConfigError, require


@dataclass(kw_only=True)
class SyncConfig:
    """How policy weights travel from the Megatron trainer to the vLLM engines after each step."""

    transport: Literal["colocated", "separate"] = "colocated"
    """``colocated``: the engines live in the trainer processes (one engine per
    ``rollout.vllm.tensor_parallel_size`` consecutive ranks) and load the exported tensors by
    reference. ``separate``: a pool of rollout servers (``megatron-gtpo rollout-server``), each one
    vLLM engine on its own GPUs/node, fed over one transfer group per server (NCCL on GPU, gloo on
    CPU); see ``servers`` for where they run."""

    bucket_mb: int = 256
    """Bucket size in MiB. Bounds the extra memory of a push on every rank (one bucket plus the
    largest single tensor) and is the unit of one transfer to a rollout server."""

    bucket_bytes: int | None = None
    """Removed: replaced by ``bucket_mb`` (MiB). Setting it is an error that names the new key."""

    timeout_s: float = 900.0
    """Longest wait for a rollout server to start (ready check) or to answer one request."""

    servers: list[str] = field(default_factory=list)
    """``host:port`` of running rollout servers (separate transport). Empty: the hosts come from
    ``MGTPO_ROLLOUT_HOSTS`` (set by ``slurm/train.sbatch`` with ``ROLLOUT_NODES``) with
    ``server_port``, or, when that is unset too, trainer rank 0 starts ``local_servers`` servers
    on its own node."""

    server_port: int = 29650
    """Port a rollout server listens on (its transfer-group rendezvous uses the next one)."""

    local_servers: int = 1
    """Rollout servers trainer rank 0 starts on localhost when no server address is known."""

    def __post_init__(self) -> None:
        if self.bucket_bytes is not None:
            raise ConfigError(f"bucket_bytes={self.bucket_bytes!r} was replaced by sync.bucket_mb (MiB): "
                              f"set sync.bucket_mb={max(self.bucket_bytes >> 20, 1)} and remove sync.bucket_bytes")
        require(self.transport in ("colocated", "separate"), "transport", self.transport,
                "'colocated' or 'separate'")
        require(isinstance(self.bucket_mb, int) and self.bucket_mb >= 1, "bucket_mb", self.bucket_mb,
                "an integer number of MiB >= 1")
        require(self.timeout_s > 0, "timeout_s", self.timeout_s, "a number of seconds > 0")
        require(all(isinstance(s, str) and s.rpartition(":")[2].isdigit() for s in self.servers), "servers",
                self.servers, "a list of 'host:port' strings")
        require(1024 <= self.server_port < 65535, "server_port", self.server_port, "a TCP port in 1024..65534")
        require(self.local_servers >= 1, "local_servers", self.local_servers, "an integer >= 1")

    @property
    def bucket_size(self) -> int:
        """``bucket_mb`` in bytes."""
        return self.bucket_mb << 20

    def placement(self) -> EnginePlacement:
        """Where these settings put the engines (``rollout.placement.build_engines``): the transport and
        the rollout servers' addresses live here, next to the weight transfer they choose."""
        return EnginePlacement(kind=self.transport, servers=tuple(self.servers), server_port=self.server_port,
                               local_servers=self.local_servers, timeout_s=self.timeout_s)
