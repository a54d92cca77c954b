"""Benchmarks of FP16_Optimizer: ``run(quick) -> list of rows {workload, impl, median_ms, ratio_vs_baseline}``.

Command that produced the numbers in guides/fp16-optimizer.md::

    PYTHONPATH=. .venv/bin/python -m ort_optim.bench.fp16_optimizer          # full
    PYTHONPATH=. .venv/bin/python -m ort_optim.bench.fp16_optimizer --quick  # seconds

Workloads (CPU tensors; the implementations are timed interleaved, after warm-up, and the median is reported;
every call of the step starts from the same scaled gradients, restored untimed before it):

1. ``fp16 step``: one optimizer step of an fp16 model with scaled fp16 gradients (GPT-2-small shapes, 148 tensors,
   124.4M params; quick: a 2-layer, width-256 GPT, 4.4M params):
   * ``torch GradScaler-style + fused AdamW`` (the baseline): copy the fp16 grads into fp32 master grads, unscale and
     check them (``torch._amp_foreach_non_finite_check_and_unscale_``), ``torch.optim.AdamW(fused=True)`` on the
     masters with the ``found_inf`` flag, copy the masters back into the fp16 params, update the scale
     (``torch._amp_update_scale_``);
   * ``FP16_Optimizer(FusedAdam)``: our wrapper with ort_optim's FusedAdam inside (fused unscale/check/skip, fp32
     masters inside the kernel);
   * ``FP16_Optimizer(torch fused AdamW)``: our wrapper's generic master-weight path around torch's fused AdamW.
2. ``DeepSpeed overflow+norm``: DeepSpeed ZeRO 1/2's ``has_overflow_partitioned_grads_serial()`` followed by
   ``get_grad_norm_direct()`` on fp16 gradients, as DeepSpeed ships them (baseline) and after FP16_Optimizer's
   patch, for 2000 tensors of 1K elements (quick: 200) and GPT-2-small shapes (quick: the small GPT). Runs only when
   DeepSpeed imports; it initialises a one-process gloo group for DeepSpeed's all-reduces.
"""

from __future__ import annotations

import argparse
import os
import socket
from typing import Callable, Optional

import torch

from ..fp16_optimizer import FP16_Optimizer
from ..fused_adam import AdamWMode, FusedAdam
from .common import gpt2_small_shapes, time_interleaved


def _shapes(quick: bool) -> list[tuple[int, ...]]:
    return gpt2_small_shapes(layers=2, dim=256, vocab=8192) if quick else gpt2_small_shapes()


def _interleaved(impls: dict[str, Callable[[], None]], repeats: int, warmup: int,
                 prepare: Optional[dict[str, Callable[[], None]]] = None) -> dict[str, float]:
    """Median milliseconds per call, timed round robin (``prepare``: common.interleaved_samples)."""
    return {name: seconds * 1e3 for name, seconds in time_interleaved(impls, warmup, repeats, prepare=prepare).items()}


def _rows(workload: str, medians: dict[str, float], baseline: str) -> list[dict]:
    return [{"workload": workload, "impl": name, "median_ms": round(ms, 3),
             "ratio_vs_baseline": round(ms / medians[baseline], 3)} for name, ms in medians.items()]


# ---- 1. the fp16 optimizer step ------------------------------------------------------------------------------------


def _fp16_params(shapes, seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    params = []
    for shape in shapes:
        p = torch.nn.Parameter((torch.randn(shape, generator=g) * 0.02).half())
        p.grad = (torch.randn(shape, generator=g) * 1e-2).half()  # already "scaled" by the loss scale
        params.append(p)
    return params


class _GradScalerFusedAdamW:
    """torch.amp.GradScaler's recipe written out for fp16 params with fp32 masters around torch's fused AdamW."""

    def __init__(self, params, lr: float, scale: float):
        self.params = params
        self.masters = [p.detach().float() for p in params]
        self.master_grads = [torch.empty_like(m) for m in self.masters]
        for m, g in zip(self.masters, self.master_grads):
            m.grad = g
        self.opt = torch.optim.AdamW(self.masters, lr=lr, weight_decay=0.0, eps=1e-6, fused=True)
        self.scale = torch.full((), scale)
        self.growth_tracker = torch.zeros((), dtype=torch.int32)

    @torch.no_grad()
    def step(self):
        torch._foreach_copy_(self.master_grads, [p.grad for p in self.params])
        found_inf = torch.zeros(())
        torch._amp_foreach_non_finite_check_and_unscale_(self.master_grads, found_inf,
                                                         self.scale.double().reciprocal().float())
        self.opt.found_inf = found_inf
        self.opt.step()
        torch._foreach_copy_(self.params, self.masters)
        torch._amp_update_scale_(self.scale, self.growth_tracker, found_inf, 2.0, 0.5, 2000)


STEP_IMPLS = ("torch GradScaler-style + fused AdamW", "FP16_Optimizer(FusedAdam)", "FP16_Optimizer(torch fused AdamW)")


def bench_step(quick: bool) -> list[dict]:
    shapes = _shapes(quick)
    numel = sum(torch.Size(s).numel() for s in shapes)
    scale = 1024.0
    params = {name: _fp16_params(shapes, 0) for name in STEP_IMPLS}
    baseline = _GradScalerFusedAdamW(params[STEP_IMPLS[0]], lr=1e-4, scale=scale)
    ours = FP16_Optimizer(
        FusedAdam(params[STEP_IMPLS[1]], lr=1e-4, adam_w_mode=AdamWMode.ADAMW_TORCH, master_weights=True),
        init_scale=scale, growth_interval=10**6, min_scale_action="clamp",
    )
    generic = FP16_Optimizer(
        torch.optim.AdamW(params[STEP_IMPLS[2]], lr=1e-4, weight_decay=0.0, eps=1e-6, fused=True),
        init_scale=scale, growth_interval=10**6, min_scale_action="clamp",
    )
    # Every call starts from the scaled gradients, as after a backward (untimed, right before it): the wrapper
    # writes FusedAdam's gradients back unscaled and remembers them as such, so without this its later calls would
    # skip the unscale and the write-back that the baseline does at every call.
    scaled = {name: [p.grad.clone() for p in ps] for name, ps in params.items()}

    def restore(name):
        return lambda: torch._foreach_copy_([p.grad for p in params[name]], scaled[name])

    medians = _interleaved(dict(zip(STEP_IMPLS, (baseline.step, ours.step, generic.step))),
                           repeats=31 if quick else 9, warmup=2, prepare={name: restore(name) for name in params})
    assert ours.skipped_steps == 0 and generic.skipped_steps == 0
    workload = f"fp16 step, {len(shapes)} tensors, {numel / 1e6:.1f}M params"
    return _rows(workload, medians, STEP_IMPLS[0])


# ---- 2. DeepSpeed's overflow check and gradient norm ---------------------------------------------------------------


def _deepspeed_ready() -> Optional[str]:
    try:
        import deepspeed  # noqa: F401
        import deepspeed.ops
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    import deepspeed.comm as ds_dist

    if not ds_dist.is_initialized():
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        for key, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1",
                               LOCAL_RANK="0", LOCAL_SIZE="1").items():
            os.environ.setdefault(key, value)
        deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    return None


def _zero_optimizer_stub(grads: list[torch.Tensor]):
    """A DeepSpeedZeroOptimizer with only what the two functions read (no engine, no model)."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    params = [torch.zeros(g.shape, dtype=g.dtype) for g in grads]
    opt = object.__new__(DeepSpeedZeroOptimizer)
    opt.bit16_groups = [params]
    opt.averaged_gradients = {0: grads}
    opt.params_in_partition = [params]
    opt.dp_process_group = None
    opt.model_parallel_group = None
    opt.model_parallel_world_size = 1
    opt.model_parallel_rank = 0
    opt.device = "cpu"
    return opt, params


def bench_deepspeed(quick: bool) -> list[dict]:
    from ..integrations import deepspeed as _deepspeed

    rows = []
    cases = {
        f"{200 if quick else 2000}x1K": [(1024,)] * (200 if quick else 2000),
        "GPT-2 shapes" if not quick else "small GPT shapes": _shapes(quick),
    }
    for label, shapes in cases.items():
        g = torch.Generator().manual_seed(0)
        grads = [(torch.randn(s, generator=g) * 1e-2).half() for s in shapes]
        plain, params = _zero_optimizer_stub(grads)
        patched, _ = _zero_optimizer_stub(grads)
        assert _deepspeed.patch_zero_optimizer(patched)

        def run(opt):
            def fn():
                overflow = opt.has_overflow_partitioned_grads_serial()
                norm = opt.get_grad_norm_direct(opt.averaged_gradients[0], opt.params_in_partition[0])
                return overflow, norm
            return fn

        a, b = run(plain)(), run(patched)()
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), (a, b)
        medians = _interleaved({"DeepSpeed 0.16 loops": run(plain), "FP16_Optimizer patch (grad_stats)": run(patched)},
                               repeats=31 if quick else 9, warmup=2)
        numel = sum(torch.Size(s).numel() for s in shapes)
        workload = f"DeepSpeed overflow+norm, {label}: {len(shapes)} tensors, {numel / 1e6:.1f}M fp16"
        rows += _rows(workload, medians, "DeepSpeed 0.16 loops")
    return rows


def run(quick: bool) -> list[dict]:
    rows = bench_step(quick)
    reason = _deepspeed_ready()
    if reason is None:
        rows += bench_deepspeed(quick)
    else:
        rows.append({"workload": "DeepSpeed overflow+norm", "impl": f"skipped: DeepSpeed not importable ({reason})",
                     "median_ms": float("nan"), "ratio_vs_baseline": float("nan")})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for row in run(args.quick):
        print(f"{row['workload']:<62} {row['impl']:<40} {row['median_ms']:>10} ms  x{row['ratio_vs_baseline']}")


if __name__ == "__main__":
    main()
