"""The engine process of the separate transport: one RolloutEngine behind a request loop.

    trainer rank 0                         engine process (this module)
    ("sample", kwargs)      --pipe-->      engine.sample(...)           --pipe--> ("ok", completions)
    ("push", version)       --pipe-->      staged = []
    ("bucket", metas)       --pipe-->      recv buffer over the gloo group; staged += views of it
       ... one per bucket ...
    ("commit",)             --pipe-->      engine.load_weights(staged)  --pipe--> ("ok", version)
    ("abort",)              --pipe-->      staged dropped (engine untouched)
    ("close",)              --pipe-->      exit

Requests are served one at a time, so a push never overlaps a generate: the engine serves either
the old or the new weights, never a mix. Everything received for a push is held until "commit".
"""

from __future__ import annotations

import os
import traceback

from megatron_gtpo.rollout.engine import RolloutEngine
from megatron_gtpo.sync.wire import buffer_bytes, open_group, tcp_store, unpack

# Variables a torchrun parent leaves in the environment. vLLM would read them as "join this
# distributed job" and wait for ranks that never come; the engine process is a world of its own.
_LAUNCHER_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                 "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
                 "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "GROUP_WORLD_SIZE")


def serve(conn, *, model_dir: str, vllm_kwargs: dict, seed: int, host: str, port: int,
          timeout_s: float) -> None:
    """Process entry point (spawned by :class:`megatron_gtpo.sync.separate.SeparateEngine`)."""
    for key in _LAUNCHER_ENV:
        os.environ.pop(key, None)
    store = tcp_store(host, port, is_master=False, timeout_s=timeout_s)
    group = open_group(store, rank=1, world=2, timeout_s=timeout_s)
    try:
        engine = RolloutEngine(model_dir=model_dir, vllm_kwargs=vllm_kwargs, seed=seed)
        conn.send(("ready", engine.dtype, engine.weight_version))
    except BaseException:  # noqa: BLE001 - reported to the trainer, which raises
        conn.send(("error", traceback.format_exc()))
        return
    _loop(conn, engine, group)
    engine.close()


def _loop(conn, engine, group) -> None:
    handlers = {"sample": _sample, "push": _push}
    while True:
        try:
            request = conn.recv()
        except EOFError:  # the trainer went away
            return
        if request[0] == "close":
            conn.send(("ok", None))
            return
        try:
            conn.send(("ok", handlers[request[0]](engine, group, conn, *request[1:])))
        except BaseException as err:  # noqa: BLE001 - the engine stays up; the trainer raises
            conn.send(("error", f"{type(err).__name__}: {err}", traceback.format_exc()))


def _sample(engine, group, conn, kwargs: dict):
    return engine.sample(**kwargs)


def _push(engine, group, conn, version: int) -> int:
    """Receives buckets until "commit" or "abort"; only a commit reaches vLLM."""
    import torch

    staged = []
    while True:
        request = conn.recv()
        if request[0] == "abort":
            return engine.weight_version
        if request[0] == "commit":
            engine.load_weights(staged, version=version)
            return engine.weight_version
        metas = request[1]
        buffer = torch.empty(buffer_bytes(metas), dtype=torch.uint8)
        group.recv([buffer], 0, 0).wait()
        staged.extend(unpack(buffer, metas))
