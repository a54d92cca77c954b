"""Benchmarks: ``python -m ort_optim.bench`` (see __main__.py). One module per section; common.py holds the shared
workloads, the bandwidth probe, interleaved timing and result rows."""

import os

# Importing torch._inductor (DeepSpeed's import does, and so do torch.compile's users) starts a pool of compile
# worker processes in the background unless this is "0"; on a 2-core machine their start-up takes a core for
# seconds, and steps timed meanwhile on two intra-op threads waited for it (measured: FP16_Optimizer's DeepSpeed
# patch 13 ms instead of 2.3 ms on 2000 x 1K). With "0" the pool starts when something is compiled, which no
# timed call does.
os.environ.setdefault("TORCH_WARM_POOL", "0")
