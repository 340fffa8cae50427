"""Generation jobs that keep running while the weights change (partial rollouts, issue 37).

    submit(job, prompts, seeds, sampling, partial) --n=1 vLLM requests--> background stepping thread
    result(job) <-- completions, each token tagged with the weight version that sampled it
    with swapping(): <weights change> --> requests continue, restart or were finished first

A rollout server answers its trainer one request at a time; generating inside a request would hold
a weight push back until the whole batch is done. Here a job's requests are added to the engine
(:meth:`RolloutEngine.add_requests`: one n=1 request per sample, sample j of prompt i seeded
``seeds[i] + j``, exactly what vLLM's own n>1 fan-out samples) and one background thread steps the
engine while any request is unfinished. Every vLLM call holds the engine's lock, so the control
thread's calls (a push's receive, the commit) run between two engine steps, and generation waits
while one runs.

A weight change goes through :meth:`InflightGenerator.swapping`: on enter the thread keeps stepping
only while requests of ``partial="off"`` jobs are unfinished (the whole batch steps: the other
requests' tokens are sampled by the old weights and tagged so), then pauses between two steps. The
caller changes the weights inside the block (vLLM's in-place reload: the KV cache survives). On
exit, if the engine's version changed, ``"continue"`` requests simply go on (their tokens so far keep
the old version, the KV cache of the old weights included), ``"abort"`` requests are aborted and
added again from their prompt with the same seed (what they had is discarded), as is any request
with no token yet; then the thread resumes. A failed change (same version) only resumes.

Each token's version is the engine's version when the step that sampled it ran, so a completion's
versions never decrease. That holds for vLLM's synchronous scheduling, which the engines of a run
with pushes during generation get (``RolloutConfig.for_engines`` sets ``async_scheduling: false``
unless the recipe sets it; CPU engines have no other): with asynchronous scheduling (a GPU default:
one batch stays in flight between two steps) the first tokens returned after a change would have
been sampled by the old weights but carry the new version. Not yet run on a GPU.

A step that raises fails every job in flight (their requests are aborted); ``result`` raises that
error, never hangs.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from megatron_gtpo.rollout.config import Sampling
from megatron_gtpo.rollout.engine import RolloutEngine
from megatron_gtpo.rollout.staleness import PARTIAL_MODES as PARTIAL
from megatron_gtpo.types import Completion, Prompt



@dataclass
class _Request:
    """One n=1 request: sample ``sample`` of prompt ``prompt_index`` of its job."""

    job: int
    prompt_index: int
    sample: int
    prompt: Prompt
    seed: int
    tries: int = 0
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    done: bool = False

    @property
    def request_id(self) -> str:
        return f"mgtpo-{self.job}-{self.prompt_index}-{self.sample}-{self.tries}"

    def take(self, output, version: int) -> None:
        """Appends one step's delta (``output``: a vLLM ``RequestOutput`` of this request)."""
        sample = output.outputs[0]
        tokens = list(sample.token_ids)
        # logprobs=0: one {token_id: Logprob} per new token, the sampled token's entry.
        self.logprobs.extend(float(step[t].logprob) for step, t in zip(sample.logprobs or (), tokens))
        self.tokens.extend(tokens)
        self.versions.extend([version] * len(tokens))
        self.text.append(sample.text or "")
        if output.finished:
            self.finish_reason, self.done = sample.finish_reason or "length", True

    def restart(self) -> None:
        """Forgets what was generated; the next request id is a new one."""
        self.tries += 1
        self.tokens, self.logprobs, self.text, self.versions = [], [], [], []

    def completion(self, version: int) -> Completion:
        versions = self.versions
        return Completion(prompt_index=self.prompt_index, prompt_token_ids=self.prompt.token_ids,
                          token_ids=list(self.tokens), logprobs=list(self.logprobs), text="".join(self.text),
                          finish_reason=self.finish_reason or "length", truncated=self.finish_reason == "length",
                          weight_version=versions[0] if versions else version,
                          token_versions=list(versions) if len(set(versions)) > 1 else None)


@dataclass
class _Job:
    partial: str
    sampling: Sampling
    requests: list[_Request]
    error: BaseException | None = None
    window: tuple[float, float] | None = None
    """Wall clock (time.time()) from the start of the first engine step that advanced one of its
    requests to the end of the last: when the engine generated this job (``rollout/overlap_s``)."""

    @property
    def done(self) -> bool:
        return self.error is not None or all(r.done for r in self.requests)


class InflightGenerator:
    """Jobs of n=1 requests stepped by one background thread (module docstring)."""

    def __init__(self, engine: RolloutEngine):
        self.engine = engine
        self._cv = threading.Condition()
        self._jobs: dict[int, _Job] = {}
        self._live: dict[str, _Request] = {}  # unfinished requests by vLLM request id
        self._mode = "run"  # "drain": step only while "off" requests are unfinished; "pause": no steps
        self._stepping = False
        self._reset_pending = False  # the prefix cache still holds blocks of replaced weights
        self._closed = False
        self._fatal: BaseException | None = None  # the thread itself died (a bug): every job fails
        self._thread = threading.Thread(target=self._loop, name="inflight-generator", daemon=True)
        self._thread.start()

    # ----------------------------------------------------------------------------- jobs

    def submit(self, job: int, prompts: Sequence[Prompt], seeds: Sequence[int], sampling: Sampling,
               partial: str = "off") -> None:
        """Adds ``job``'s requests (``sampling.n`` per prompt) and returns at once."""
        if partial not in PARTIAL:
            raise ValueError(f"partial must be one of {PARTIAL}, got {partial!r}")
        if len(seeds) != len(prompts):
            raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts")
        requests = [_Request(job=job, prompt_index=i, sample=j, prompt=p, seed=int(seeds[i]) + j)
                    for i, p in enumerate(prompts) for j in range(sampling.n)]
        with self._cv:
            if self._closed or self._fatal is not None:
                raise RuntimeError(f"the generator is closed or its thread died ({self._fatal!r})")
            if job in self._jobs:
                raise ValueError(f"job {job} is already in flight")
            try:
                self.engine.add_requests([(r.request_id, r.prompt, r.seed) for r in requests], sampling)
            except BaseException:
                self._abort(requests)  # those already added must not run unowned
                raise
            self._jobs[job] = _Job(partial=partial, sampling=sampling, requests=requests)
            self._live.update((r.request_id, r) for r in requests)
            self._cv.notify_all()

    def has(self, job: int) -> bool:
        """Whether ``job`` was submitted and its result not yet taken."""
        with self._cv:
            return job in self._jobs

    def in_flight(self) -> int:
        """Requests of the jobs whose result was not taken yet."""
        with self._cv:
            return sum(len(state.requests) for state in self._jobs.values())

    def progress(self, job: int) -> list[int]:
        """Tokens generated so far by each of ``job``'s requests."""
        with self._cv:
            return [len(r.tokens) for r in self._jobs[job].requests]

    def result(self, job: int, timeout_s: float | None = None) -> list[Completion]:
        """``job``'s completions once all its requests finished (grouped by prompt, ``prompt_index``
        relative to the job, samples in order), as :meth:`RolloutEngine.sample` returns them; the
        job is then forgotten. Raises KeyError for an unknown job, TimeoutError, or the error that
        failed the job."""
        return self.take(job, timeout_s)[0]

    def take(self, job: int, timeout_s: float | None = None) -> tuple[list[Completion], tuple[float, float] | None]:
        """:meth:`result` and the job's generation window (None if no step advanced it)."""
        with self._cv:
            if job not in self._jobs:
                raise KeyError(f"no job {job} in flight")
            state = self._jobs[job]
            if not self._cv.wait_for(lambda: state.done or self._fatal is not None, timeout=timeout_s):
                raise TimeoutError(f"job {job} not finished after {timeout_s} s")
            del self._jobs[job]
            error = state.error or (None if state.done else self._fatal)
            if error is not None:
                raise RuntimeError(f"generation job {job} failed: {error!r}") from error
            version = self.engine.weight_version
            return [r.completion(version) for r in state.requests], state.window

    def drop(self, job: int | None = None) -> None:
        """Forgets ``job`` (None: every job), aborting its unfinished requests."""
        with self._cv:
            jobs = list(self._jobs) if job is None else [job]
            for j in jobs:
                state = self._jobs.pop(j, None)
                if state is not None:
                    self._abort([r for r in state.requests if not r.done])

    def close(self) -> None:
        """Drops every job and stops the thread."""
        self.drop()
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join()

    # ----------------------------------------------------------------------------- weight changes

    @contextlib.contextmanager
    def swapping(self) -> Iterator[None]:
        """The block where the weights may change (module docstring)."""
        with self._cv:
            if self._mode != "run":
                raise RuntimeError("swapping() does not nest")
            self._mode = "drain"
            self._cv.notify_all()
            self._cv.wait_for(lambda: self._fatal is not None or not self._stepping and not self._off_live())
            self._mode = "pause"
            before = self.engine.weight_version
        try:
            yield
        finally:
            with self._cv:
                try:
                    if self.engine.weight_version != before:
                        self._reset_pending = True
                        self._restart_aborted()
                finally:
                    self._mode = "run"
                    self._cv.notify_all()

    def _off_live(self) -> bool:
        return any(self._jobs[r.job].partial == "off" for r in self._live.values() if r.job in self._jobs)

    def _restart_aborted(self) -> None:
        """``"abort"`` requests, and those with no token yet (nothing to lose), start again from their
        prompt on the new weights (holding ``_cv``)."""
        again = [r for r in self._live.values() if self._jobs[r.job].partial == "abort" or not r.tokens]
        self._abort(again)
        by_job: dict[int, list[_Request]] = {}
        for r in again:
            r.restart()
            by_job.setdefault(r.job, []).append(r)
        for job, requests in by_job.items():
            try:
                self.engine.add_requests([(r.request_id, r.prompt, r.seed) for r in requests], self._jobs[job].sampling)
            except Exception as err:  # noqa: BLE001 - the job fails (result() raises it) instead of hanging
                self._jobs[job].error = err
                self._abort(requests)
            else:
                self._live.update((r.request_id, r) for r in requests)

    # ----------------------------------------------------------------------------- the thread

    def _loop(self) -> None:
        try:
            while True:
                with self._cv:
                    self._cv.wait_for(lambda: self._closed or self._may_step())
                    if self._closed:
                        return
                    self._stepping = True
                try:
                    self._step()
                except Exception as err:  # noqa: BLE001 - fails the jobs in flight, reported by result()
                    self._fail_all(err)
                finally:
                    with self._cv:
                        self._stepping = False
                        self._cv.notify_all()
        except BaseException as err:  # a bug in this loop: no job may wait forever
            with self._cv:
                self._fatal = err
                self._cv.notify_all()
            raise

    def _may_step(self) -> bool:
        if not self._live or self._mode == "pause":
            return False
        return self._mode == "run" or self._off_live()

    def _step(self) -> None:
        """One engine step; its deltas go to their requests."""
        engine = self.engine
        with engine.lock:
            version, start = engine.weight_version, time.time()
            outputs = engine.step()
            end = time.time()
            idle = not engine.has_unfinished_requests()
            if idle and self._reset_pending:
                # A weight change while requests held KV blocks left the prefix cache unreset.
                self._reset_pending = not engine.reset_prefix_cache()
        with self._cv:
            for output in outputs:
                request = self._live.get(output.request_id)  # None: aborted meanwhile
                if request is not None:
                    request.take(output, version)
                    self._stamp(request.job, start, end)
                    if request.done:
                        del self._live[output.request_id]
            self._cv.notify_all()

    def _stamp(self, job: int, start: float, end: float) -> None:
        """Widens ``job``'s generation window to this step (holding ``_cv``)."""
        state = self._jobs.get(job)
        if state is not None:
            state.window = (start, end) if state.window is None else (state.window[0], end)

    def _fail_all(self, err: BaseException) -> None:
        with self._cv:
            for state in self._jobs.values():
                if not state.done:
                    state.error = err
            self._abort(list(self._live.values()))
            self._cv.notify_all()

    def _abort(self, requests: list[_Request]) -> None:
        """Aborts ``requests`` in vLLM (holding ``_cv``); a failure is left to the next step."""
        for r in requests:
            self._live.pop(r.request_id, None)
        with contextlib.suppress(Exception):
            self.engine.abort_requests([r.request_id for r in requests])
