"""Separate transport: the engine runs in its own process and receives weights over a process group.

    trainer rank 0: exporter buckets --check + cast to engine dtype--> pack --gloo send--> engine
                    process: stage --"commit"--> vLLM in-place reload
    other ranks:    drain their exporter output (its collectives need them), then learn rank 0's outcome

:class:`SeparateEngine` owns the process (spawned from trainer rank 0, outside the torchrun world)
and mirrors :class:`~megatron_gtpo.rollout.engine.RolloutEngine`'s API, so the driver generates
through it exactly as through a local engine. Control messages go over a pipe; tensor bytes go over
a dedicated two-party gloo group on its own TCP store (a network transport, unlike shared memory).
With CUDA tensors this path still works, staging through host memory; the fast GPU data plane
would be vLLM's NCCL weight-transfer engine, which is not wired in yet (no GPU to test it here).

The trainer packs bucket k+1 while bucket k is on the wire. The engine keeps every received bucket
until the push is complete (one extra copy of the weights in the engine process) and then reloads
in one call; a push rejected by either side leaves the engine on its previous version.
"""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Iterable, Sequence

from megatron_gtpo.rollout.engine import call_seed, prompt_seeds
from megatron_gtpo.sync.base import ExportPlan, PushTimer, SyncStats, WeightSync, agree, drain
from megatron_gtpo.sync.checks import Bucket, PushChecker, WeightPushError, WeightSpec
from megatron_gtpo.sync.engine_server import serve
from megatron_gtpo.sync.wire import open_group, pack, tcp_store
from megatron_gtpo.types import Completion, Prompt


class EngineProcessError(RuntimeError):
    """The engine process failed to start, died, or did not answer in time."""


class SeparateEngine:
    """A RolloutEngine in a child process: same generate/tokenizer/weight_version API."""

    def __init__(self, *, model_dir: str, vllm_kwargs: dict | None = None, seed: int = 0,
                 timeout_s: float = 900.0, host: str = "127.0.0.1"):
        self._model_dir, self._seed, self._calls, self._timeout = str(model_dir), seed, 0, timeout_s
        self._tokenizer = None
        ctx = mp.get_context("spawn")  # fork would copy the trainer's threads and process groups
        self._conn, child = ctx.Pipe()
        store = tcp_store(host, 0, is_master=True, timeout_s=timeout_s)
        self._proc = ctx.Process(target=serve, daemon=True, kwargs=dict(
            conn=child, model_dir=self._model_dir, vllm_kwargs=dict(vllm_kwargs or {}), seed=seed,
            host=host, port=store.port, timeout_s=timeout_s))
        self._proc.start()
        child.close()
        self._group = open_group(store, rank=0, world=2, timeout_s=timeout_s)
        self._store = store
        reply = self._recv()
        if reply[0] != "ready":
            raise EngineProcessError(f"rollout engine process failed to start:\n{reply[1]}")
        self.weight_spec = WeightSpec.from_model_dir(self._model_dir, dtype=reply[1])
        """Names and shapes a push must hold, in the engine's dtype (checked here, before sending)."""
        self._version: int = reply[2]

    @property
    def tokenizer(self):
        """The model directory's Hugging Face tokenizer (loaded here; the engine has its own)."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self._model_dir)
        return self._tokenizer

    @property
    def weight_version(self) -> int:
        return self._version

    def generate(self, prompts: list[Prompt], *, n: int, temperature: float, top_p: float,
                 max_tokens: int, stop: list[str] | None = None, seed: int | None = None) -> list[Completion]:
        """As :meth:`RolloutEngine.generate` (same seeds for the same engine seed and call count)."""
        if seed is None:
            seed = call_seed(self._seed, self._calls)
        self._calls += 1
        return self.sample(prompts, seeds=prompt_seeds(seed, len(prompts), n), n=n,
                           temperature=temperature, top_p=top_p, max_tokens=max_tokens, stop=stop)

    def sample(self, prompts: Sequence[Prompt], *, seeds: Sequence[int], **sampling) -> list[Completion]:
        self._conn.send(("sample", dict(prompts=list(prompts), seeds=list(seeds), **sampling)))
        return self._result()

    def push(self, buckets: Iterable[Bucket], *, version: int) -> tuple[int, int]:
        """Sends one whole push; returns (tensors, bytes). Raises WeightPushError if rejected."""
        if not isinstance(version, int) or version < self._version:
            drain(iter(buckets))
            raise ValueError(f"weight version must be an int >= the served version {self._version}, got {version!r}")
        checker = PushChecker(self.weight_spec, version)
        self._conn.send(("push", version))
        it, pending = iter(buckets), None
        try:
            for bucket in it:
                bucket = checker.prepare(bucket)
                if not bucket:
                    continue
                buffer, metas = pack(bucket)  # overlaps with the previous bucket's send
                if pending is not None:
                    pending[0].wait()
                self._conn.send(("bucket", metas))
                pending = (self._group.send([buffer], 1, 0), buffer)  # the buffer lives until sent
            checker.finish()
            if pending is not None:
                pending[0].wait()
        except BaseException:
            if pending is not None:
                pending[0].wait()
            self._conn.send(("abort",))
            self._result()
            drain(it)
            raise
        self._conn.send(("commit",))
        self._version = self._result(WeightPushError)
        return checker.num_tensors, checker.num_bytes

    def sleep(self) -> None:
        """Nothing to give back: the engine does not share the trainer's devices."""

    def close(self) -> None:
        if self._proc.is_alive():
            try:
                self._conn.send(("close",))
                self._recv()
            except (EngineProcessError, OSError):
                pass
            self._proc.join(timeout=60)
        if self._proc.is_alive():
            self._proc.kill()
        self._conn.close()

    def _recv(self):
        if not self._conn.poll(self._timeout):
            raise EngineProcessError(f"rollout engine process did not answer within {self._timeout:.0f} s "
                                     f"(alive={self._proc.is_alive()}, exitcode={self._proc.exitcode})")
        try:
            return self._conn.recv()
        except EOFError:
            raise EngineProcessError(f"rollout engine process died (exitcode={self._proc.exitcode})") from None

    def _result(self, error_type: type[Exception] = EngineProcessError):
        reply = self._recv()
        if reply[0] == "ok":
            return reply[1]
        kind, _, message = reply[1].partition(": ")
        if kind in ("WeightPushError", "ValueError"):  # the caller's mistake: same type as in-process
            raise (WeightPushError if kind == "WeightPushError" else ValueError)(message)
        raise error_type(f"rollout engine process: {reply[1]}\n{reply[2]}")


class SeparateSync(WeightSync):
    """Pushes from trainer rank 0 into a :class:`SeparateEngine`; other ranks pass ``None``."""

    dst_ranks = "first"

    def __init__(self, engine: SeparateEngine | None, export: ExportPlan):
        super().__init__(export)
        self._engine = engine

    def push(self, buckets: Iterable[Bucket], *, version: int) -> SyncStats:
        timer = PushTimer()
        if self._engine is None:
            drain(iter(buckets))
            return agree(None)
        error, stats = None, None
        try:
            num_tensors, num_bytes = self._engine.push(buckets, version=version)
            stats = timer.stats(version=version, num_tensors=num_tensors, num_bytes=num_bytes)
        except (WeightPushError, EngineProcessError, ValueError) as err:
            error = err
        return agree(error, stats)
