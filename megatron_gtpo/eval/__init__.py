"""Sampling-based evaluation (``megatron-gtpo eval``): the GTPO paper's pass@k / maj@k protocol.

    config.py  EvalConfig (every field is a CLI flag)
    (--model -> HF dir through megatron_gtpo.models.resolve.as_hf_dir, then a RolloutEngine)
    harness.py prompts -> n samples -> verdicts (reward scorer) -> BenchmarkResult, JSON, table, MLflow
    metrics.py pass@k (unbiased), maj@k (deterministic ties), mean@k
    cli.py     argparse front end: ``main(argv)``

Importing this package is light; vLLM, torch and transformers load inside the functions that use them.
"""
