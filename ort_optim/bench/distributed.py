"""The distributed row of ``make bench``: the optimizer step of a GPT-2-small-shaped model sharded by FSDP2 on 2 ranks.

Two gloo ranks (``torch.multiprocessing.spawn``, a FileStore rendezvous, each rank with half the machine's threads)
hold a module with GPT-2 small's parameter shapes, ``fully_shard``-ed per layer and at the root, with random
sharded gradients. Interleaved on the same params: FusedAdam, FusedAdam with ``max_grad_norm`` (its one all-reduce
of [sum of squares, inf flag] per step), torch's AdamW with foreach and with fused (where fused runs on DTensors),
and AdamW(foreach) + ``clip_grad_norm_`` (torch's global norm on DTensors). Rank 0's medians are reported; a
barrier before each call keeps the ranks in step. The communication FusedAdam's step adds is counted by wrapping
``torch.distributed.all_reduce`` during one step.

Needs torch >= 2.6 (FSDP2 on CPU with gloo); elsewhere the section reports why it did not run.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from .common import gpt2_small_shapes

WORLD = 2


def _model(shapes):
    from torch import nn

    class Layer(nn.Module):
        def __init__(self, layer_shapes):
            super().__init__()
            self.weights = nn.ParameterList(nn.Parameter(torch.randn(s) * 0.02) for s in layer_shapes)

    # GPT-2's shapes come as 2 embeddings, 12 layers of 12 tensors, a final LayerNorm: one FSDP unit per layer
    head, body, tail = shapes[:2], shapes[2:-2], shapes[-2:]
    layers = [head] + [body[i:i + 12] for i in range(0, len(body), 12)] + [tail]
    class Model(nn.Module):  # (never run forward: the benchmark times the optimizer step only)
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(Layer(s) for s in layers)

    return Model()


def _worker(rank: int, tmp_dir: str, quick: bool, reps: int) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from .. import FusedAdam
    from .._spec import AdamWMode
    from ..integrations import dtensor

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // WORLD))
    dist.init_process_group("gloo", store=dist.FileStore(str(Path(tmp_dir) / "store"), WORLD), rank=rank,
                            world_size=WORLD)
    try:
        torch.manual_seed(0)
        shapes = gpt2_small_shapes() if not quick else [(s[0] // 8,) + s[1:] for s in gpt2_small_shapes()]
        model = _model(shapes)
        mesh = init_device_mesh("cpu", (WORLD,))
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        params = list(model.parameters())
        generator = torch.Generator().manual_seed(rank)
        for p in params:
            p.grad = dtensor.wrap_like(p, torch.randn(dtensor.local(p).shape, generator=generator) * 1e-2)
        kwargs = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
        optimizers = {
            "ort_optim FusedAdam": FusedAdam(params, adam_w_mode=AdamWMode.ADAMW_TORCH, **kwargs),
            "ort_optim FusedAdam + max_grad_norm": FusedAdam(params, adam_w_mode=AdamWMode.ADAMW_TORCH,
                                                              max_grad_norm=1.0, **kwargs),
            "torch AdamW foreach": torch.optim.AdamW(params, foreach=True, **kwargs),
            "torch AdamW fused": torch.optim.AdamW(params, fused=True, **kwargs),
        }
        clip_opt = torch.optim.AdamW(params, foreach=True, **kwargs)

        def clip_then_step():
            torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
            clip_opt.step()

        candidates = {name: opt.step for name, opt in optimizers.items()}
        candidates["torch AdamW foreach + clip_grad_norm_"] = clip_then_step
        errors = {}
        for name, fn in list(candidates.items()):  # warm-up, which also finds what does not run on DTensors
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 - reported in the table
                errors[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
                del candidates[name]
        dist.barrier()

        calls = []
        original = dist.all_reduce

        def counting_all_reduce(tensor, *args, **kwargs):
            calls.append(tensor.numel() * tensor.element_size())
            return original(tensor, *args, **kwargs)

        if "ort_optim FusedAdam + max_grad_norm" in candidates:  # (not where it does not run here)
            dist.all_reduce = counting_all_reduce
            try:
                optimizers["ort_optim FusedAdam + max_grad_norm"].step()
            finally:
                dist.all_reduce = original

        times = {name: [] for name in candidates}
        for _ in range(reps):
            for name, fn in candidates.items():
                dist.barrier()
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
        result = {"medians": {name: statistics.median(t) for name, t in times.items()}, "errors": errors,
                  "allreduce_bytes": calls, "params": sum(torch.Size(s).numel() for s in shapes),
                  "tensors": len(shapes)}
        if rank == 0:
            torch.save(result, Path(tmp_dir) / "result.pt")
    finally:
        dist.destroy_process_group()


def bench_distributed(quick: bool) -> list[dict]:
    """Rows: one per implementation (median ms of rank 0, FusedAdam's speed-up over it), or why it did not run."""
    if tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) < (2, 6):
        return [{"workload": "gpt2-small FSDP2 x2", "impl": "-", "note":
                 f"FSDP2 on CPU with gloo needs torch >= 2.6; this is torch {torch.__version__}"}]
    import torch.multiprocessing as mp

    reps = 3 if quick else 7
    with tempfile.TemporaryDirectory() as tmp_dir:
        mp.spawn(_worker, args=(tmp_dir, quick, reps), nprocs=WORLD)
        result = torch.load(Path(tmp_dir) / "result.pt", weights_only=False)
    workload = f"gpt2-small{' /8' if quick else ''} FSDP2 x{WORLD}"
    medians = result["medians"]
    ours, ours_clip = medians.get("ort_optim FusedAdam"), medians.get("ort_optim FusedAdam + max_grad_norm")
    comm = f"{len(result['allreduce_bytes'])} all-reduce of {sum(result['allreduce_bytes'])} bytes"
    rows = []
    for impl, seconds in medians.items():
        clipped = "clip" in impl or "max_grad_norm" in impl
        reference = ours_clip if clipped else ours  # (None where ours did not run: no ratio, its row says why)
        row = {"workload": workload, "params": result["params"], "tensors": result["tensors"], "impl": impl,
               "median_ms": seconds * 1e3}
        if reference is not None:
            row["ours_speedup"] = seconds / reference
        row["note"] = f"step adds {comm}" if impl == "ort_optim FusedAdam + max_grad_norm" else ""
        rows.append(row)
    for impl, error in result["errors"].items():
        rows.append({"workload": workload, "impl": impl, "note": f"does not run: {error}"})
    return rows
