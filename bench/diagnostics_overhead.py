"""Step-time overhead of the bias diagnostics: an A/B of ``train_step`` on the tiny-char model
(configs/tiny.yaml's model; 8 completions, 120-token prompts) with the step observer (D1/D2 batch
part, the D2 micro-batch parts, D4, the mismatch metrics: train/observer.py) and with a no-op
observer in its place, alternating in one process; median CPU time of this process over 10 steps
each. Single rank (gloo world of 1). Ends with one JSON line.

    .venv/bin/python bench/diagnostics_overhead.py gtpo        # or dapo_mu3 (mu = 3: D4 too)
    .venv/bin/python bench/diagnostics_overhead.py --quick     # 2 steps each (the suite's smoke run)
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402

from bench.quick import parse_quick  # noqa: E402
from megatron_gtpo.algo import AlgoConfig  # noqa: E402
from megatron_gtpo.models.hf_config import read_hf_config  # noqa: E402
from megatron_gtpo.models.resolve import resolve_model  # noqa: E402
from megatron_gtpo.parallel.dims import init_distributed  # noqa: E402
from megatron_gtpo.train import model as M, step as S  # noqa: E402
from megatron_gtpo.train.optim import OptimConfig, build_optimizer, wrap_ddp  # noqa: E402
from tests.dist.scripts import _trainstep_common as C  # noqa: E402

QUICK = {"steps": 2, "warmup": 0}
ALGOS = {"gtpo": AlgoConfig(name="gtpo", entropy_threshold=777.0, entropy_gamma=0.0),
         "dapo_mu3": AlgoConfig(name="dapo", mu=3)}


class NoObserver:
    """The step observer's interface, doing nothing."""

    def __init__(self, plan):
        pass

    def micro_batch(self, *args):
        pass

    def after_update(self, optimizer):
        pass

    def finish(self, host_prepared, first_update):
        return {}


def setup(name: str):
    """The tiny-char policy (Adam), a tiny.yaml-shaped batch and the step settings of ``name``."""
    dims = init_distributed(tp=1, pp=1, seed=7)
    hf = read_hf_config(resolve_model("tiny-char"))
    chunks = wrap_ddp(M.build_model(hf, dims=dims), OptimConfig())
    opt, sched = build_optimizer(chunks, OptimConfig(optimizer={"optimizer": "adam", "lr": 1e-3}), total_steps=1000)
    policy = SimpleNamespace(chunks=chunks, optimizer=opt, scheduler=sched)
    g = torch.Generator().manual_seed(0)
    batch = C.make_batch(0, num_groups=2, group_size=4)
    # tiny.yaml geometry: prompts ~120 tokens, completions <= 24
    batch.prompt_ids = torch.randint(3, 128, (8, 120), generator=g)
    batch.prompt_lengths = torch.full((8,), 120)
    # the test batch's ids reach 200; tiny-char's vocabulary is 128 (ids >= 3 stay >= 3: no new EOS or pad)
    batch.token_ids = torch.where(batch.token_ids >= 128, batch.token_ids - 125, batch.token_ids)
    settings = S.StepSettings(spec=ALGOS[name].resolve(max_completion_tokens=24), micro_batch_size=4, temperature=1.0)
    return policy, batch, settings, dims


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("algo", nargs="?", choices=sorted(ALGOS), default="gtpo")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per variant (default 10)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per variant first (default 2)")
    args = parse_quick(parser, argv, QUICK)
    torch.set_num_threads(1)
    policy, batch, settings, dims = setup(args.algo)
    real, times = S.StepObserver, {"on": [], "off": []}
    try:
        for i in range(2 * (args.warmup + args.steps)):
            mode = "on" if i % 2 else "off"
            S.StepObserver = real if mode == "on" else NoObserver
            start = time.process_time()
            S.train_step(policy, batch, settings, dims)
            if i >= 2 * args.warmup:
                times[mode].append(time.process_time() - start)
    finally:
        S.StepObserver = real
    on, off = statistics.median(times["on"]), statistics.median(times["off"])
    print(f"{args.algo}: train_step CPU median on {1e3 * on:.1f} ms, off {1e3 * off:.1f} ms, "
          f"overhead {1e3 * (on - off):.1f} ms ({100 * (on / off - 1):.1f}%)")
    print(json.dumps({"bench": "diagnostics_overhead", "algo": args.algo, "on_ms": round(1e3 * on, 2),
                      "off_ms": round(1e3 * off, 2), "overhead_frac": round(on / off - 1, 4), "steps": args.steps}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
