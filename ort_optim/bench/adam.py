"""FusedAdam's step against torch's AdamW (for-loop, foreach, fused), DeepSpeed's CPU Adam and the torch
mixed-precision composite; and where many-tensor steps lose time (op overhead)."""

from __future__ import annotations

import statistics
import time
from typing import Optional

import torch

from .. import backends
from ..fused_adam import AdamWMode, FusedAdam, _leaving_out
from . import probes
from .common import WORKLOADS, make_params, rows, time_after_probe, time_interleaved, time_interleaved_one_thread

def _deepspeed_cpu_adam(params) -> Optional[torch.optim.Optimizer]:
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception:  # not installed, or its JIT build failed
        return None
    try:
        return DeepSpeedCPUAdam(params, lr=1e-3, weight_decay=1e-2, adamw_mode=True)
    except Exception:
        return None


def bench_fp32(names: list[str], quick: bool, reps: int, with_deepspeed: bool) -> list[dict]:
    """fp32 params, grads and moments: 28 bytes per element (read p, g, m, v; write p, m, v)."""
    result = []
    for name in names:
        params = make_params(WORKLOADS[name](quick))
        numel = sum(p.numel() for p in params)
        optimizers: dict[str, torch.optim.Optimizer] = {
            "ort_optim.FusedAdam": FusedAdam(params, lr=1e-3, eps=1e-8, weight_decay=1e-2,
                                             adam_w_mode=AdamWMode.ADAMW_TORCH),
            "torch AdamW for-loop": torch.optim.AdamW(params, lr=1e-3, foreach=False),
            "torch AdamW foreach": torch.optim.AdamW(params, lr=1e-3, foreach=True),
            "torch AdamW fused": torch.optim.AdamW(params, lr=1e-3, fused=True),
        }
        if with_deepspeed:
            ds = _deepspeed_cpu_adam(params)
            if ds is not None:
                optimizers["DeepSpeed CPUAdam"] = ds
        medians = time_interleaved({k: o.step for k, o in optimizers.items()}, warmup=2, reps=reps)
        result += rows("fp32 AdamW", name, len(params), numel, medians, bytes_per_element=28,
                      state_bytes={k: 8 for k in medians})
    return result


def bench_mixed(names: list[str], quick: bool, reps: int) -> list[dict]:
    """fp16/bf16 params and grads, fp32 masters and moments, loss-scale unscale + inf check + clip + update.

    Ours: FusedAdam(master_weights=True, max_grad_norm=1.0).step(grad_scale=S), two passes over the gradients, the
    second also writing p.grad back unscaled (as torch's fused AdamW does); the row "p.grad left scaled" is the same
    step without that write (a private switch), so the two price it.
    Composite (the usual way with torch ops): copy grads into fp32 master grads, unscale and check with
    torch._amp_foreach_non_finite_check_and_unscale_, clip_grad_norm_(foreach=True), fused AdamW on the masters,
    copy the masters back into the low-precision params.

    Each step runs right after a cold 512 MB ``x.mul_(c)`` probe (bench.common.time_after_probe), as in training,
    where forward and backward evict the caches; ``of_probe`` is the step's bandwidth at its bytes per element as a
    fraction of that probe's.
    """
    result = []
    scale = 1024.0
    for dtype in (torch.float16, torch.bfloat16):
        for name in names:
            params = make_params(WORKLOADS[name](quick), dtype)
            for p in params:
                p.grad.mul_(scale)
            scaled_grads = [p.grad.clone() for p in params]
            numel = sum(p.numel() for p in params)
            ours = FusedAdam(params, lr=1e-3, eps=1e-8, weight_decay=1e-2, adam_w_mode=AdamWMode.ADAMW_TORCH,
                             master_weights=True, max_grad_norm=1.0)
            ours_scaled_grads = FusedAdam(params, lr=1e-3, eps=1e-8, weight_decay=1e-2,
                                          adam_w_mode=AdamWMode.ADAMW_TORCH, master_weights=True, max_grad_norm=1.0)
            masters = [p.detach().float() for p in params]
            for m in masters:
                m.grad = torch.zeros_like(m)
            torch_opt = torch.optim.AdamW(masters, lr=1e-3, fused=True)
            found_inf = torch.zeros(1)
            inv_scale = torch.full((1,), 1.0 / scale)

            def ours_leaving_grads_scaled():
                with _leaving_out(unscale_grads=True):
                    ours_scaled_grads.step(grad_scale=scale)

            def composite():
                torch._foreach_copy_([m.grad for m in masters], [p.grad for p in params])
                found_inf.zero_()
                torch._amp_foreach_non_finite_check_and_unscale_([m.grad for m in masters], found_inf, inv_scale)
                if not found_inf.item():
                    torch.nn.utils.clip_grad_norm_(masters, 1.0, foreach=True)
                    torch_opt.step()
                    torch._foreach_copy_(params, masters)

            # Ours writes the shared grads back divided by the scale, so every call starts from a copy of the scaled
            # grads (untimed, before the probe). Left divided, each call saw 1024x smaller grads: fp16 ones flushed to
            # zero after three calls, and bf16 ones made g * g underflow into float32 subnormals from about the
            # fifth, which slowed the bf16 steps 1.6-1.7x (one thread, AMD EPYC; tiny fp32 grads alone: 1.25x).
            # Fused: read g twice (norm, update) + write g + p16 write + master, m, v read+write = 2*3 + 2 + 24 = 32
            # B/elem (30 without the grad write-back).
            # Composite: grad copy 2+4, unscale 4+4, clip norm 4 + scale 4+4, AdamW 16+12, copy back 4+2 = 60.
            moved = {"ort_optim.FusedAdam": 32, "ort_optim.FusedAdam, p.grad left scaled": 30, "torch composite": 60}
            medians, of_probe, probe_GBps = time_after_probe(
                {"ort_optim.FusedAdam": lambda: ours.step(grad_scale=scale),
                 "ort_optim.FusedAdam, p.grad left scaled": ours_leaving_grads_scaled,
                 "torch composite": composite},
                {impl: per_element * numel for impl, per_element in moved.items()}, quick, warmup=2, reps=reps,
                prepare=lambda: torch._foreach_copy_([p.grad for p in params], scaled_grads))
            section = rows(f"mixed {str(dtype).replace('torch.', '')} params", name, len(params), numel, medians,
                           bytes_per_element=moved,
                           state_bytes={"ort_optim.FusedAdam": 12, "ort_optim.FusedAdam, p.grad left scaled": 12,
                                        "torch composite": 16})
            for row in section:  # its bandwidth as a fraction of the cold in-place probe's, run just before it
                row.update(probe_GBps=probe_GBps, of_probe=of_probe[row["impl"]])
            result += section
    return result


MIXED_BYTES_PER_ELEMENT = 32  # ours in bench_mixed: g read twice, g and p16 written, master, m, v read and written
MIXED_TARGETS = {"gpt2-small": 0.90, "2000x1K": 0.70}  # targets: fractions of the cold in-place probe
MIXED_HOT_NUMEL = 64 * 1024  # one tensor whose mixed step stays in L2 (16 B per element of state: 1 MB)
MIXED_TINY_NUMEL = 1024  # a step that is all overhead (dispatch, plan, norm reduction), subtracted from the hot step
MIXED_FLOOR_PREFETCH = (0, 2)  # probes.MixedFloorStep variants: work items prefetched ahead (0: none)
MIXED_HOT_TENSORS = 64  # MIXED_HOT_NUMEL elements as 1K tensors: the cost of each tensor beyond the first


def run_mixed_limit(quick: bool) -> list[dict]:
    """The ``mixed_limit`` section: how close to the cold probe bench_mixed's step (fp16/bf16 params, fp32 masters,
    unscale, inf check, clip, write-back) can get on this machine, and what stands between it and MIXED_TARGETS.

    Per param dtype, on one thread, with the caches warm (the compute alone):
    ``hot_ns_per_element``, one MIXED_HOT_NUMEL-element tensor minus a MIXED_TINY_NUMEL-element step (the per-step
    overhead); ``hot_ns_per_extra_tensor``, MIXED_HOT_TENSORS tensors of 1K against that one tensor.
    Per workload: the cold step (each right after the in-place probe, common.time_after_probe) and its fraction of
    the probe; the bytes floor (MIXED_BYTES_PER_ELEMENT at the probe's bandwidth) and the compute floor (numel x
    hot_ns_per_element + (tensors - 1) x hot_ns_per_extra_tensor, divided by the thread count, which assumes
    perfect scaling); ``bound_of_probe``, bytes floor / max(both floors): the most the step can reach with its present
    compute, if memory and compute overlapped perfectly. A bound below the target says the compute (or per-tensor
    cost) must shrink first; a bound above it with a lower ``of_probe`` says the time goes to memory stalls.
    ``floor_probe_of_probe``: :class:`probes.MixedFloorStep` timed the same way over the same layout (fp16 params,
    28 bytes per element, one multiply-add per array and no other work), the best of its MIXED_FLOOR_PREFETCH
    variants (whole work items prefetched that far ahead, or not at all): a floor far below the target says the
    layout, not our kernel, keeps any step from it."""
    threads = torch.get_num_threads()
    scale = 1024.0
    rows_out = []
    for dtype in (torch.float16, torch.bfloat16):
        def make(shapes):
            params = make_params(shapes, dtype)
            for p in params:
                p.grad.mul_(scale)
            grads = [p.grad.clone() for p in params]
            optimizer = FusedAdam(params, lr=1e-3, eps=1e-8, weight_decay=1e-2, adam_w_mode=AdamWMode.ADAMW_TORCH,
                                  master_weights=True, max_grad_norm=1.0)
            restore = lambda: torch._foreach_copy_([p.grad for p in params], grads)  # noqa: E731 (see bench_mixed)
            return (lambda: optimizer.step(grad_scale=scale)), restore, params

        hot = {"one": make([(MIXED_HOT_NUMEL,)]), "tiny": make([(MIXED_TINY_NUMEL,)]),
               "many": make([(MIXED_HOT_NUMEL // MIXED_HOT_TENSORS,)] * MIXED_HOT_TENSORS)}
        # Ours writes the grads back unscaled, so each call restores them first; the restore alone is subtracted.
        candidates = {name: (lambda step=step, restore=restore: (restore(), step()))
                      for name, (step, restore, _) in hot.items()}
        candidates.update({f"{name} restore": restore for name, (_, restore, _) in hot.items()})
        for step in candidates.values():
            step()  # state and plans
        hot_s = time_interleaved_one_thread(candidates, warmup=2, reps=20 if quick else 60)
        net = {name: max(hot_s[name] - hot_s[f"{name} restore"], 0.0) for name in hot}
        per_element = max(net["one"] - net["tiny"], 0.0) / (MIXED_HOT_NUMEL - MIXED_TINY_NUMEL)
        per_tensor = max(net["many"] - net["one"], 0.0) / (MIXED_HOT_TENSORS - 1)
        for workload, target in MIXED_TARGETS.items():
            step, restore, params = make(WORKLOADS[workload](quick))
            numel = sum(p.numel() for p in params)
            moved = MIXED_BYTES_PER_ELEMENT * numel
            candidates, moved_by = {"ours": step}, {"ours": moved}
            try:  # the same bytes over the same layout with no arithmetic: what any kernel could reach here
                for ahead in MIXED_FLOOR_PREFETCH:
                    candidates[f"floor {ahead}"] = probes.MixedFloorStep(
                        make_params(WORKLOADS[workload](quick), torch.float16), prefetch_ahead=ahead)
                    moved_by[f"floor {ahead}"] = probes.MixedFloorStep.BYTES_PER_ELEMENT * numel
            except probes.ProbeUnavailable as reason:
                print(f"mixed_limit: no floor probe ({reason})")
            medians, of_probe, probe_gbps = time_after_probe(candidates, moved_by, quick, warmup=1,
                                                             reps=3 if quick else 7, prepare=restore)
            floor = max((name for name in medians if name != "ours"), key=of_probe.get, default=None)
            bytes_floor = moved / (probe_gbps * 1e9)
            compute_floor = (numel * per_element + (len(params) - 1) * per_tensor) / threads
            rows_out.append(dict(
                params=str(dtype).replace("torch.", ""), workload=workload, threads=threads, elements=numel,
                tensors=len(params), hot_ns_per_element=per_element * 1e9, hot_ns_per_extra_tensor=per_tensor * 1e9,
                probe_GBps=probe_gbps, cold_ms=medians["ours"] * 1e3, of_probe=of_probe["ours"],
                bytes_floor_ms=bytes_floor * 1e3, compute_floor_ms=compute_floor * 1e3,
                bound_of_probe=bytes_floor / max(bytes_floor, compute_floor), target_of_probe=target,
                floor_probe_cold_ms=medians[floor] * 1e3 if floor else None,
                floor_probe_of_probe=of_probe[floor] if floor else None,
                floor_probe_prefetch_ahead=int(floor.split()[1]) if floor else None))
    return rows_out


def bench_low_precision_states(names: list[str], quick: bool, reps: int) -> list[dict]:
    """fp32 params with fp16 moments (ours, 1024-element block scales) against torch fused AdamW (fp32 moments)."""
    result = []
    for name in names:
        params = make_params(WORKLOADS[name](quick))
        numel = sum(p.numel() for p in params)
        medians = time_interleaved({
            "ort_optim.FusedAdam fp16 moments": FusedAdam(
                params, lr=1e-3, eps=1e-8, weight_decay=1e-2, adam_w_mode=AdamWMode.ADAMW_TORCH,
                exp_avg_dtype=torch.float16, exp_avg_sq_dtype=torch.float16).step,
            "torch AdamW fused": torch.optim.AdamW(params, lr=1e-3, fused=True).step,
        }, warmup=2, reps=reps)
        # fp16 moments: p, g, m, v read (4+4+2+2) and p, m, v written (4+2+2) = 20; torch's fp32 moments: 28.
        result += rows("fp32 params, fp16 moments", name, len(params), numel, medians,
                      bytes_per_element={"ort_optim.FusedAdam fp16 moments": 20, "torch AdamW fused": 28},
                      state_bytes={"ort_optim.FusedAdam fp16 moments": 4 + 8 / 1024, "torch AdamW fused": 8})
    return result


def bench_op_overhead(reps: int) -> list[dict]:
    """Where many-tensor steps lose time: 2000 one-element tensors (metadata only), 2000 x 1K and one 2M-element
    tensor, with warm caches and after a 256 MB pass has evicted them (as other work does in training). Ways in: the op
    with its four tensor lists, the native plan FusedAdam steps through (reads each param's .grad itself; its check()
    re-validates every tensor it holds, then it steps), that re-validation alone, and FusedAdam.step() as a whole
    (the plan plus Python)."""
    evictor = torch.empty(64 * 1024 * 1024)
    result = []
    for workload, shapes in {"2000x1": [(1,)] * 2000, "2000x1K": [(1024,)] * 2000, "1x2M": [(2048 * 1024,)]}.items():
        params = make_params(shapes)
        optimizer = FusedAdam(params)
        optimizer.step()  # creates the state and the plan
        (bucket,) = optimizer._plan.groups[0].buckets
        grads = [p.grad for p in params]
        hyper = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adam_w_mode=1,
                     bias_correction=True, maximize=False)
        calls = {
            "op, 4 tensor lists": lambda: backends.adam_step_(
                bucket.params, grads, bucket.exp_avgs, bucket.exp_avg_sqs, [], [], [], [], [], bucket.steps, **hyper),
            "plan (check + step)": lambda: bucket.native.check() < 0 and bucket.native.step(**hyper),
            "plan re-validation (check)": lambda: bucket.native.check(),
            "FusedAdam.step()": optimizer.step,
        }
        if bucket.native is None:  # no native library here: there is no plan to time
            del calls["plan (check + step)"], calls["plan re-validation (check)"]
        for call, run in calls.items():
            for caches in ("warm", "evicted"):
                times = []
                for _ in range(3 + 4 * reps):
                    if caches == "evicted":
                        evictor.add_(1.0)
                    start = time.perf_counter()
                    run()
                    times.append(time.perf_counter() - start)
                result.append({"section": "op overhead", "workload": workload, "call": call, "caches": caches,
                             "tensors": len(shapes), "median_ms": statistics.median(times[3:]) * 1e3})
    return result
