"""vLLM engine start with and without the imported heap frozen (``utils/runtime.freeze_imported_heap``).

In one process that has imported what a training rank imports (the trainer, Megatron-Core's
dist_checkpointing, vLLM's engine classes), builds a tiny engine over and over
(``models.tiny.ensure_tiny``: the tests' 2-layer random Qwen2, fp32, 64 MiB of KV cache),
alternating two variants:

    unfrozen  gc.unfreeze() first: vLLM's start-up collections scan every object of the process
              (what each rank paid before the launcher froze the heap)
    frozen    gc.freeze() first: what RolloutEngine does now, right before vllm.LLM(...)

Engines are not closed between rounds (vLLM may only tear down a world it created), so each round's
heap is a little larger than the one before for both variants alike. Prints the median wall and CPU
seconds of each variant, then one JSON line with ``frozen_over_unfrozen`` (median wall ratio).

    python bench/engine_start.py [--repeats 3]
    python bench/engine_start.py --quick             # one round (the suite's smoke run)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout
from bench.alternating import alternate  # noqa: E402
from bench.quick import parse_quick  # noqa: E402

VLLM = {"dtype": "float32", "max_model_len": 512, "kv_cache_memory_bytes": 64 << 20}  # configs/tiny.yaml's rollout.vllm
QUICK = {"repeats": 1}


def start(model_dir: str, variant: str) -> dict[str, float]:
    from vllm import LLM

    from megatron_gtpo.rollout.engine import engine_kwargs

    kwargs = engine_kwargs(model_dir, dict(VLLM), 0)  # the engine's own settings (RolloutEngine)
    gc.unfreeze() if variant == "unfrozen" else gc.freeze()
    tracked = len(gc.get_objects())
    wall, cpu = time.perf_counter(), time.process_time()
    LLM(**kwargs)
    return {"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu, "tracked": tracked}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="rounds; each starts one engine per variant")
    args = parse_quick(parser, argv, QUICK)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process, as RolloutEngine runs it
    import megatron.core.dist_checkpointing  # noqa: F401 -- a rank's imports (parallel/launch.TRAINER_PRELOAD)
    import vllm.entrypoints.llm  # noqa: F401

    import megatron_gtpo.trainer  # noqa: F401
    from megatron_gtpo.models.tiny import ensure_tiny

    model_dir = str(ensure_tiny())
    start(model_dir, "frozen")  # warm-up: file caches, lazy imports of the first engine
    rows, med = alternate(("unfrozen", "frozen"), args.repeats, lambda variant, _: start(model_dir, variant))
    print(f"tiny Qwen2 engine start, medians of {args.repeats} (load1 {os.getloadavg()[0]:.1f})")
    print("variant | wall s | CPU s | objects the collector tracks")
    for variant, m in med.items():
        print(f"{variant} | {m['wall_s']:.2f} | {m['cpu_s']:.2f} | {m['tracked']:.0f}")
    print(json.dumps({"bench": "engine_start", "repeats": args.repeats, "medians": med,
                      "frozen_over_unfrozen": round(med["frozen"]["wall_s"] / med["unfrozen"]["wall_s"], 3),
                      "all": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
