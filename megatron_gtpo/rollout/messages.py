"""What trainer rank 0 and a rollout server say to each other on the control channel (data only):
the schemas of the server's own requests and the codec of ``generate`` (and of ``submit``/``fetch``).

Every request is one frame ``{"op": name, "args": {...}}`` (+ blobs) of :mod:`megatron_gtpo.utils.channel`,
answered by one frame: ``{"ok": true, "result": {...}}`` (+ blobs) or ``{"ok": false, "kind":
exception class name, "message": ..., "trace": ...}``. The first frame of a connection is
``{"role": "control"}`` (answered ``{"ok": true}``, or ``{"ok": false, "error": ...}`` when the
server already serves a trainer) or ``{"role": "store", "join": id}`` (utils/rendezvous.py).

The server's own requests (the weight requests come from ``sync/wire.py``):

    hello     {}                                      -> {host, version, dtype, tp, model_dir}
    generate  {lengths, seeds, sampling: the Sampling record's fields} + [prompt token ids, int32]
              -> {version, completions: [{prompt_index, length, text, finish_reason, truncated,
                 weight_version}], window: [start, end]} + [completion token ids, int32; sampler
                 log-probs, float64 (; token versions, int32: only when a completion's tokens span
                 weight versions)]
    submit    {job, partial: off|abort|continue, lengths, seeds, sampling} + [prompt token ids]
              -> {} at once: the job generates in the background (rollout/inflight.py), across
                 weight pushes as ``partial`` says
    fetch     {job}                                   -> once the job is done, ``generate``'s answer
    close     {}                                      -> {} and the server exits

``window`` (optional: absent when nothing was generated) is the wall-clock interval (``time.time()``
seconds on the server) from the start of the engine's first step for that call or job to the end of
its last: what ``rollout/overlap_s`` measures against the trainer's train phase (rollout/overlap.py).

Only token ids go to the server (not the prompt text, answer or id), and the completions come back
without their prompt, which the trainer still holds. The :class:`~megatron_gtpo.rollout.config.Sampling`
record travels as its fields (``asdict``) and is rebuilt, validated, on the server (:func:`decode_generate`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from megatron_gtpo.rollout.config import Sampling
from megatron_gtpo.rollout.staleness import PARTIAL_MODES as PARTIAL, tags_in_order
from megatron_gtpo.types import Completion, Prompt
from megatron_gtpo.utils.channel import SchemaError

REQUEST = {"op": str, "args": dict}
"""Every request frame's header (besides ``blobs``)."""

HELLO: dict = {}
CLOSE: dict = {}
SAMPLING = {"n": int, "temperature": float, "top_p": float, "max_tokens": int, "stop": [str]}
"""The fields of :class:`~megatron_gtpo.rollout.config.Sampling` (a unit test keeps them equal)."""
GENERATE = {"lengths": [int], "seeds": [int], "sampling": SAMPLING}
SUBMIT = {"job": int, "partial": str, **GENERATE}
FETCH = {"job": int}
GENERATE_REPLY = {"version": int, "completions": [{"prompt_index": int, "length": int, "text": str,
                                                   "finish_reason": str, "truncated": bool, "weight_version": int}],
                  "window?": [float]}

_TOKENS, _LOGPROBS = np.dtype("<i4"), np.dtype("<f8")


def encode_generate(prompts: Sequence[Prompt], seeds: Sequence[int], sampling: Sampling) -> tuple[dict, list]:
    """The ``generate`` request of a run of prompts."""
    lengths = [len(p.token_ids) for p in prompts]
    tokens = np.fromiter((t for p in prompts for t in p.token_ids), dtype=_TOKENS, count=sum(lengths))
    args = {"lengths": lengths, "seeds": [int(s) for s in seeds],
            "sampling": {**asdict(sampling), "stop": list(sampling.stop)}}
    return args, [tokens.tobytes()]


def encode_submit(job: int, partial: str, prompts: Sequence[Prompt], seeds: Sequence[int],
                  sampling: Sampling) -> tuple[dict, list]:
    """The ``submit`` request of a job (``generate``'s request plus the job id and ``partial``)."""
    args, blobs = encode_generate(prompts, seeds, sampling)
    return {"job": int(job), "partial": partial, **args}, blobs


def decode_submit(args: dict, blobs: list, limits: GenerateLimits) -> tuple[list[Prompt], list[int], Sampling]:
    """A checked ``submit`` request (args match :data:`SUBMIT`): :func:`decode_generate` plus ``partial``."""
    if args["partial"] not in PARTIAL:
        raise SchemaError(f"submit.partial must be one of {list(PARTIAL)}, got {args['partial']!r:.40}")
    return decode_generate(args, blobs, limits)


@dataclass(frozen=True, kw_only=True)
class GenerateLimits:
    """What one ``generate`` request may ask of a server's engine (the server fills it from its
    engine), so that no request can exhaust its memory or reach past its vocabulary."""

    max_model_len: int
    """Longest sequence the engine holds: caps ``max_tokens`` and every prompt."""
    vocab_size: int
    """Prompt token ids must lie in [0, vocab_size)."""
    max_sequences: int = 1 << 16
    """Most completions (prompts x n) of one request."""
    max_stop: int = 32
    """Most stop strings of one request, each of at most 256 characters."""


def decode_generate(args: dict, blobs: list, limits: GenerateLimits) -> tuple[list[Prompt], list[int], Sampling]:
    """A checked ``generate`` request (args already match :data:`GENERATE`): prompts, seeds, and the
    sampling record (its own checks refuse out-of-range values as a malformed request, ``limits``
    what the engine cannot serve)."""
    lengths = args["lengths"]
    if len(blobs) != 1 or len(args["seeds"]) != len(lengths) or min(lengths, default=1) < 1:
        raise SchemaError("generate: one token blob, one seed and at least one token per prompt")
    try:
        sampling = Sampling(**args["sampling"])
    except (TypeError, ValueError) as err:
        raise SchemaError(f"generate.sampling: {err}") from None
    tokens = _array(blobs[0], _TOKENS, sum(lengths), "prompt tokens")
    _check_limits(lengths, tokens, sampling, limits)
    prompts, start = [], 0
    for i, n in enumerate(lengths):
        prompts.append(Prompt(uid=str(i), token_ids=tokens[start:start + n].tolist()))
        start += n
    return prompts, args["seeds"], sampling


def _check_limits(lengths: list[int], tokens: np.ndarray, sampling: Sampling, limits: GenerateLimits) -> None:
    if len(lengths) * sampling.n > limits.max_sequences:
        raise SchemaError(f"generate: {len(lengths)} prompts x n={sampling.n} completions, more than "
                          f"{limits.max_sequences} in one request")
    if sampling.max_tokens > limits.max_model_len or max(lengths, default=0) > limits.max_model_len:
        raise SchemaError(f"generate: max_tokens {sampling.max_tokens} or a prompt of {max(lengths)} tokens "
                          f"exceeds the engine's max_model_len {limits.max_model_len}")
    if len(sampling.stop) > limits.max_stop or any(len(s) > 256 for s in sampling.stop):
        raise SchemaError(f"generate: at most {limits.max_stop} stop strings of at most 256 characters")
    if tokens.size and not (0 <= int(tokens.min()) and int(tokens.max()) < limits.vocab_size):
        raise SchemaError(f"generate: prompt token ids must lie in [0, {limits.vocab_size})")


def encode_completions(version: int, completions: Sequence[Completion],
                       window: tuple[float, float] | None = None) -> tuple[dict, list]:
    """The ``generate`` (and ``fetch``) answer; a third blob carries every token's weight version
    when any completion spans versions (``token_versions``). ``window``: when the engine generated
    them (module docstring)."""
    rows = [{"prompt_index": c.prompt_index, "length": len(c.token_ids), "text": c.text,
             "finish_reason": c.finish_reason, "truncated": c.truncated, "weight_version": c.weight_version}
            for c in completions]
    total = sum(r["length"] for r in rows)
    tokens = np.fromiter((t for c in completions for t in c.token_ids), dtype=_TOKENS, count=total)
    logprobs = np.fromiter((x for c in completions for x in c.logprobs), dtype=_LOGPROBS, count=total)
    blobs = [tokens.tobytes(), logprobs.tobytes()]
    if any(c.token_versions is not None for c in completions):
        blobs.append(np.fromiter((v for c in completions for v in c.versions()), dtype=_TOKENS, count=total).tobytes())
    result = {"version": version, "completions": rows}
    if window is not None:
        result["window"] = [float(window[0]), float(window[1])]
    return result, blobs


def decode_window(result: dict) -> tuple[float, float] | None:
    """The generation window of a checked ``generate`` (or ``fetch``) answer; None when absent."""
    window = result.get("window")
    if window is None:
        return None
    if len(window) != 2 or not all(map(math.isfinite, window)) or not window[0] <= window[1]:
        raise SchemaError(f"generate answer: window must be two finite [start, end] with start <= end, "
                          f"got {window!r:.80}")
    return float(window[0]), float(window[1])


def decode_completions(result: dict, blobs: list, prompts: Sequence[Prompt]) -> tuple[int, list[Completion]]:
    """A checked ``generate`` (or ``fetch``) answer for ``prompts`` (the run that was sent): version,
    completions (``prompt_index`` relative to the run; each carries its prompt's token list). A third
    blob sets ``token_versions`` of the completions whose tokens span versions (None where all are
    ``weight_version``'s); they must start at ``weight_version`` and never decrease."""
    rows = result["completions"]
    total = sum(r["length"] for r in rows)
    if len(blobs) not in (2, 3) or any(r["length"] < 0 or not 0 <= r["prompt_index"] < len(prompts) for r in rows):
        raise SchemaError("generate answer: two or three blobs and prompt indices of the run")
    tokens = _array(blobs[0], _TOKENS, total, "completion tokens").tolist()
    logprobs = _array(blobs[1], _LOGPROBS, total, "log-probs").tolist()
    versions = _array(blobs[2], _TOKENS, total, "token versions").tolist() if len(blobs) == 3 else None
    out, start = [], 0
    for r in rows:
        end = start + r["length"]
        out.append(Completion(prompt_index=r["prompt_index"], prompt_token_ids=prompts[r["prompt_index"]].token_ids,
                              token_ids=tokens[start:end], logprobs=logprobs[start:end], text=r["text"],
                              finish_reason=r["finish_reason"], truncated=r["truncated"],
                              weight_version=r["weight_version"],
                              token_versions=None if versions is None else _token_versions(versions[start:end], r)))
        start = end
    return result["version"], out


def _token_versions(versions: list[int], row: dict) -> list[int] | None:
    if not tags_in_order(versions, row["weight_version"]):
        raise SchemaError(f"generate answer: token versions {versions[:3]}... of a completion of weight version "
                          f"{row['weight_version']} must start at it and never decrease")
    return versions if len(set(versions)) > 1 else None


def _array(blob, dtype: np.dtype, count: int, what: str) -> np.ndarray:
    if len(blob) != count * dtype.itemsize:
        raise SchemaError(f"{what}: {len(blob)} bytes for {count} values of {dtype.itemsize} bytes")
    return np.frombuffer(blob, dtype=dtype, count=count)
