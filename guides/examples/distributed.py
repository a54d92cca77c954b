"""FusedAdam under torch.distributed: DDP, FSDP2, tensor parallel and 2D, with distributed checkpoints.

Launch with torchrun (CPU: gloo; the same command on GPUs uses NCCL, one GPU per rank):

    torchrun --standalone --nproc-per-node 2 guides/examples/distributed.py --parallel fsdp2 --model gpt
    torchrun --standalone --nproc-per-node 2 guides/examples/distributed.py --parallel ddp
    torchrun --standalone --nproc-per-node 2 guides/examples/distributed.py --parallel tp
    torchrun --standalone --nproc-per-node 4 guides/examples/distributed.py --parallel 2d
    torchrun --standalone --nproc-per-node 2 guides/examples/distributed.py --parallel fsdp2 --save ckpt --steps 10
    torchrun --standalone --nproc-per-node 4 guides/examples/distributed.py --parallel fsdp2 --load ckpt --steps 10

``--model gpt`` trains gpt.py's byte-level GPT on the Python standard library's source (gpt.py's model, data, lr
schedule and weight decay groups; ``--config quick|demo``); ``--model mlp`` a small regression MLP. The optimizer is
``FusedAdam(adam_w_mode=ADAMW_TORCH, max_grad_norm=1.0)``: FSDP2/TP/2D params are DTensors, which FusedAdam steps
through their local shards, with the clipping norm and the inf/NaN skip decided over all ranks in one all-reduce of
two floats per step; DDP's plain params get the same through ``process_group=``. Checkpoints are
``torch.distributed.checkpoint`` (``dcp.save``/``dcp.load`` of ``get_optimizer_state_dict``), which reshards: a
checkpoint saved by 2 ranks loads into 4, or into one process. FSDP2 on CPU needs torch >= 2.6.

Rank 0 prints the loss every ``--log-every`` steps and, at the end, a JSON line (``--json PATH`` writes it).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
for path in (REPO, HERE):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))  # run from a checkout without installing the package; gpt.py beside us

import gpt  # noqa: E402  (model, data and schedule of the GPT example; importing it loads neither ORT nor data)

from ort_optim import AdamWMode, FusedAdam  # noqa: E402

MAX_GRAD_NORM = 1.0


def setup() -> tuple[int, int, str]:
    """Joins the process group torchrun describes; (rank, world size, device type)."""
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    return rank, world, "cuda" if cuda else "cpu"


# ---- models and data ---------------------------------------------------------------------------------------------------


class MLP(nn.Module):
    def __init__(self, d_in=32, d_hidden=128, d_out=8):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d_in, d_hidden), nn.Linear(d_hidden, d_out)

    def forward(self, x, y):
        return nn.functional.mse_loss(self.fc2(nn.functional.gelu(self.fc1(x))), y)


def mlp_batches(step: int, batch: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed * 100003 + step)
    x = torch.randn(batch, 32, generator=g)
    return x, torch.sin(x[:, :8]) + 0.1 * x[:, 8:16]


def build(args, device: str):
    """(model, per-step batch function, config) for --model."""
    if args.model == "mlp":
        torch.manual_seed(0)
        model = MLP().to(device)
        return model, (lambda step: mlp_batches(step, args.batch)), {"lr": 1e-2, "steps": args.steps, "warmup": 0}
    cfg = dict(gpt.CONFIGS[args.config])
    cfg["steps"] = args.steps or cfg["steps"]
    model = gpt.build_model(cfg["n_layer"], cfg["d_model"], cfg["n_head"], cfg["block"], tie=True, seed=0).to(device)
    train, _, _ = gpt.load_corpus()
    starts = gpt.batch_starts(len(train), cfg["block"], cfg["batch"], cfg["steps"], seed=0)
    return model, (lambda step: gpt.get_batch(train, starts[step], cfg["block"])), cfg


# ---- parallelism: the engines do it ----------------------------------------------------------------------------------


def parallelize(model, args, world: int, device: str):
    """Wraps the model for --parallel; returns (model, data-parallel rank, data-parallel size, process_group)."""
    rank = dist.get_rank()
    if args.parallel == "ddp":
        return nn.parallel.DistributedDataParallel(model), rank, world, dist.group.WORLD
    from torch.distributed.device_mesh import init_device_mesh

    if args.parallel == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device, (world,))
        for layer in getattr(model, "blocks", [model.fc1, model.fc2] if args.model == "mlp" else []):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, rank, world, None
    if args.model != "mlp":
        raise SystemExit(f"--parallel {args.parallel} is written for --model mlp")
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
    if args.parallel == "tp":  # every rank sees the same batch
        parallelize_module(model, init_device_mesh(device, (world,)), plan)
        return model, 0, 1, None
    if world % 2:
        raise SystemExit("--parallel 2d needs an even number of ranks (data parallel x 2-way tensor parallel)")
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device, (world // 2, 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], plan)
    for layer in (model.fc1, model.fc2):
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model, mesh.get_local_rank("dp"), world // 2, None


def optimizer_for(model, args, cfg: dict, process_group) -> FusedAdam:
    groups = gpt.param_groups(model) if args.model == "gpt" else [{"params": list(model.parameters())}]
    return FusedAdam(groups, lr=cfg["lr"], betas=gpt.BETAS, eps=gpt.EPS, adam_w_mode=AdamWMode.ADAMW_TORCH,
                     weight_decay=0.0, max_grad_norm=MAX_GRAD_NORM, process_group=process_group)


# ---- checkpoints (torch.distributed.checkpoint) -----------------------------------------------------------------------


def save(model, opt, path: str, step: int) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd, "step": torch.tensor(step)}, checkpoint_id=path)


def load(model, opt, path: str) -> int:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd, "step": torch.tensor(0)}
    dcp.load(state, checkpoint_id=path)  # reshards onto this run's world size and layout
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return int(state["step"])


# ---- training ----------------------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parallel", choices=("ddp", "fsdp2", "tp", "2d"), default="fsdp2")
    parser.add_argument("--model", choices=("gpt", "mlp"), default="mlp")
    parser.add_argument("--config", choices=tuple(gpt.CONFIGS), default="quick", help="gpt.py's size (--model gpt)")
    parser.add_argument("--steps", type=int, default=None, help="default: 40 (mlp), the config's (gpt)")
    parser.add_argument("--batch", type=int, default=32, help="global batch (mlp)")
    parser.add_argument("--log-every", type=int, default=5)
    parser.add_argument("--save", help="write a distributed checkpoint here at the end")
    parser.add_argument("--load", help="resume from a distributed checkpoint (any world size)")
    parser.add_argument("--json", help="rank 0 writes its summary here")
    args = parser.parse_args(argv)
    if args.model == "mlp" and args.steps is None:
        args.steps = 40

    rank, world, device = setup()
    try:
        summary = train(args, rank, world, device)
        if rank == 0:
            print(json.dumps(summary), flush=True)
            if args.json:
                Path(args.json).write_text(json.dumps(summary))
        # The model, the optimizer and their DTensors are gone with train()'s frame; collecting their reference
        # cycles now frees whatever they held of the process group while it is alive, not at interpreter exit,
        # where a gloo worker thread still running can abort the process. With torch 2.4, destroy_process_group()
        # can also deadlock if a gloo worker thread is still freeing the tensors of the last collective (DCP's save
        # ends with one): the destructor holds the GIL while it joins that thread, and the thread needs the GIL. A
        # barrier first lets that thread finish. (Not in `finally`: after an error on one rank the others would wait
        # in it.)
        gc.collect()
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


def train(args, rank: int, world: int, device: torch.device) -> dict:
    """Builds, parallelizes, optionally resumes, trains and optionally saves; returns this rank's summary of the run."""
    model, batches, cfg = build(args, device)
    model, dp_rank, dp_size, group = parallelize(model, args, world, device)
    opt = optimizer_for(model, args, cfg, group)
    start = load(model, opt, args.load) if args.load else 0
    losses, opt_ms = [], []
    for step in range(start, start + cfg["steps"]):
        if args.model == "gpt":
            for g in opt.param_groups:
                g["lr"] = gpt.lr_at(min(step, cfg["steps"] - 1), cfg)
        x, y = batches(step % cfg["steps"] if args.model == "gpt" else step)
        x, y = x.chunk(dp_size)[dp_rank].to(device), y.chunk(dp_size)[dp_rank].to(device)
        opt.zero_grad()
        loss = model(x, y)
        loss.backward()
        t0 = time.perf_counter()
        opt.step()
        opt_ms.append((time.perf_counter() - t0) * 1e3)
        loss = loss.detach().clone()
        if dp_size > 1:  # the mean over the data-parallel ranks (for the log only)
            dist.all_reduce(loss)
            loss /= world  # (tp ranks of a 2d row hold equal losses: summing them all and dividing by world works)
        losses.append(float(loss))
        if rank == 0 and (step - start) % args.log_every == 0:
            print(f"step {step:4d}  loss {losses[-1]:.4f}  optimizer {opt_ms[-1]:.2f} ms"
                  f"{'  (skipped)' if opt.last_step_skipped else ''}", flush=True)
    if args.save:
        save(model, opt, args.save, start + cfg["steps"])
    return dict(parallel=args.parallel, model=args.model, world=world, start=start, steps=cfg["steps"],
                first_loss=losses[0], final_loss=losses[-1], finite=all(map(math.isfinite, losses)),
                optimizer_ms_median=sorted(opt_ms)[len(opt_ms) // 2], saved=args.save, loaded=args.load)


if __name__ == "__main__":
    sys.exit(main())
