"""Colocated transport: the engine lives in the trainer's own process.

Every trainer rank holds one engine (see :mod:`megatron_gtpo.sync.placement`) and receives the full
HF tensors from the exporter (``dst_ranks="all"``), so a push moves no bytes between processes:
the exported tensors are staged by reference, checked, and handed to vLLM's in-place reload, which
copies them into the engine's (repacked) parameters. On GPU the engine and the trainer share the
devices; with ``enable_sleep_mode`` in the vLLM settings the engine sleeps during training
(``RolloutGroup.sleep``) and ``load_weights`` wakes it.

    rank r: exporter buckets --stage + check (by reference)--> all ranks agree --> engine r reloads
"""

from __future__ import annotations

from collections.abc import Iterable

from megatron_gtpo.rollout.engine import RolloutEngine
from megatron_gtpo.sync.base import ExportPlan, PushTimer, SyncStats, WeightSync, agree, drain
from megatron_gtpo.sync.checks import Bucket, PushChecker, WeightPushError, WeightSpec


class ColocatedSync(WeightSync):
    """Pushes into the :class:`RolloutEngine` of this process."""

    dst_ranks = "all"

    def __init__(self, engine: RolloutEngine, export: ExportPlan):
        super().__init__(export)
        self._engine = engine
        self._spec = WeightSpec.from_model_dir(engine.model_dir, dtype=engine.dtype)

    def push(self, buckets: Iterable[Bucket], *, version: int) -> SyncStats:
        timer = PushTimer()
        checker = PushChecker(self._spec, version)
        staged: Bucket = []
        error = None
        it = iter(buckets)
        try:
            for bucket in it:
                staged.extend(checker.prepare(bucket))
            checker.finish()
        except WeightPushError as err:
            error = err
            drain(it)
        agree(error)  # nobody loads unless every rank's push is complete and well-formed
        error = None
        try:
            self._engine.load_weights(staged, version=version)
        except Exception as err:  # noqa: BLE001 - re-raised on every rank by agree()
            error = err
        del staged
        stats = timer.stats(version=version, num_tensors=checker.num_tensors, num_bytes=checker.num_bytes)
        return agree(error, stats)
