"""Weight-sync settings: which transport moves the trainer's weights into the rollout engines."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron_gtpo.utils.configuration import require


@dataclass(kw_only=True)
class SyncConfig:
    """How policy weights travel from the Megatron trainer to the vLLM engines after each step."""

    transport: Literal["colocated", "separate"] = "colocated"
    """``colocated``: every trainer rank holds an engine in its own process and loads the exported
    tensors by reference (on GPU: same devices, vLLM sleep/wake around training). ``separate``: one
    engine in its own process, fed by trainer rank 0 over a dedicated process group (gloo on CPU)."""

    bucket_bytes: int = 256 << 20
    """Size of the exporter's buckets; bounds the extra memory of a gather and of one transfer."""

    timeout_s: float = 900.0
    """Longest wait for a separate engine to start or to answer one request (generate, push)."""

    def __post_init__(self) -> None:
        require(self.transport in ("colocated", "separate"), "transport", self.transport,
                "'colocated' or 'separate'")
        require(self.bucket_bytes >= 1 << 20, "bucket_bytes", self.bucket_bytes, "an integer >= 1 MiB")
        require(self.timeout_s > 0, "timeout_s", self.timeout_s, "a number of seconds > 0")
