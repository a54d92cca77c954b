"""Benchmarks: ``python -m ort_optim.bench`` (see __main__.py). One module per section; common.py holds the shared
workloads, the bandwidth probe, interleaved timing and result rows."""
