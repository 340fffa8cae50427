"""Benchmarks and the GPU smoke (scripts run as ``python bench/NAME.py``); a package so that
``bench.gpu_smoke_setup`` imports the same way from the scripts and from the tests."""
