"""Scenarios of test_tensor_parallel.py on torch's own TP training test: a small transformer (token and position
embeddings, attention, MLP, LayerNorms, the output projection tied to the token embedding) parallelised as torch's
tensor-parallel transformer training test parallelises it, with and without sequence parallelism, on 2 gloo ranks.

Tensor parallelism leaves gradients laid out unlike their params: the position embedding is ``Shard(0)`` (rowwise)
but its gradient ``Replicate``; with sequence parallelism the LayerNorm weights are ``Replicate`` and their gradients
``Partial``. torch's AdamW steps them (DTensor redistributes each gradient to its param's placements); so does
FusedAdam, with a local slice where that suffices (Replicate -> Shard: no communication) and DTensor's
redistribution otherwise (Partial -> Replicate: an all-reduce).

Three references, all trained on the same token batches:
* **torch TP**: the same parallelised model stepped by ``torch.optim.AdamW`` (DTensor's op dispatch), clipped by
  ``torch.nn.utils.clip_grad_norm_`` where the case clips;
* **one process**: the unparallelised model with ``torch.optim.AdamW`` (as torch's test compares);
* **skip**: a step whose replicated gradient holds an inf only in the slice the other rank steps is skipped on every
  rank (the reference simply does not step then).
The update is per element in float32 on both sides, but torch's foreach AdamW and FusedAdam's kernel round
differently (``lr / bc1`` in double, ``m + (1 - beta1)(g - m)``): within TOL after the steps (the distance between
torch's own TP and one-process runs), and the ranks agree bit for bit.

torch's test runs on GPUs; on CPU, scaled_dot_product_attention has no DTensor sharding rule, so attention runs on
each rank's local heads (torch's test does the same for float64: ``local_output_for_attn``).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from distributed_harness import run_ranks, torch_too_old
from torch import nn

from ort_optim import AdamWMode, FusedAdam

WORLD = 2
STEPS = 5
SKIP_STEP = 2
LR, WEIGHT_DECAY, EPS = 0.25, 0.01, 1e-8  # torch's test steps Adam with lr 0.25
CLIP = 0.5  # far below the gradients' global norm (1100-2900 here, the loss is a sum): every step clips
# torch's own TP run and its one-process run of this model end up to 1.3e-5 apart after STEPS steps (measured): their
# gradients differ in rounding, and Adam's m / sqrt(v) magnifies that where a gradient is near 0; FusedAdam's kernel
# rounds its update differently from torch's foreach AdamW too (measured: up to 1.3e-5 from either reference)
TOL = 3e-5
VOCAB, SEQ_LEN, DIM, HEADS, LAYERS, BATCH = 8, 16, 16, 4, 2, (8, 8)
REASON = torch_too_old((2, 6), "tensor parallelism on CPU with gloo (DTensor redistribution, parallelize_module's "
                               "styles), tested with FSDP2")
needs_tp = pytest.mark.skipif(REASON is not None, reason=REASON or "")


# ---- the model: the shape of torch's TP test transformer ------------------------------------------------------------


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.heads = HEADS  # this rank's heads once parallelised
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))

    def forward(self, x):
        batch, seq, _ = x.shape
        q, k, v = (w(x).view(batch, seq, self.heads, -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w2 = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x):
        return self.w2(F.gelu(self.w1(x)))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm, self.attention = nn.LayerNorm(DIM), Attention()
        self.ffn_norm, self.feed_forward = nn.LayerNorm(DIM), FeedForward()

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings, self.pos_embeddings = nn.Embedding(VOCAB, DIM), nn.Embedding(SEQ_LEN, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)
        self.output.weight = self.tok_embeddings.weight  # weight tying

    def forward(self, tokens):
        h = self.tok_embeddings(tokens) + self.pos_embeddings(torch.arange(tokens.shape[1]))
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h)).float()


def make_model() -> Transformer:
    torch.manual_seed(0)
    return Transformer()


def parallelize(model: Transformer, mesh, sequence_parallel: bool) -> Transformer:
    """torch's plan for this model (Transformer.parallelize in torch's distributed test utilities)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    sp = sequence_parallel
    root = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1) if sp else Replicate()),
        "pos_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0) if sp else Replicate()),
    }
    if sp:
        root["norm"] = SequenceParallel()
    parallelize_module(model, mesh, root)
    for layer in model.layers:
        plan = {f"attention.w{x}": ColwiseParallel() for x in "qkv"}  # local heads (see the module docstring)
        plan["attention.wo"] = RowwiseParallel(output_layouts=Shard(1)) if sp else RowwiseParallel()
        plan["feed_forward.w1"] = ColwiseParallel(input_layouts=Shard(1)) if sp else ColwiseParallel()
        plan["feed_forward.w2"] = RowwiseParallel(output_layouts=Shard(1)) if sp else RowwiseParallel()
        if sp:
            plan["attention"] = PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate())
            plan["attention_norm"] = SequenceParallel()
            plan["ffn_norm"] = SequenceParallel()
        parallelize_module(layer, mesh, plan)
        layer.attention.heads = HEADS // mesh.size()
    parallelize_module(model.output, mesh, ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()) if sp
                       else ColwiseParallel(output_layouts=Replicate()))
    model.output.weight = model.tok_embeddings.weight
    return model


def tokens(step: int) -> torch.Tensor:
    return torch.randint(VOCAB, BATCH, generator=torch.Generator().manual_seed(100 + step))


def full(t: torch.Tensor) -> torch.Tensor:
    from ort_optim.integrations import dtensor

    return (t.full_tensor() if dtensor.is_dtensor(t) else t).detach().clone()


# ---- scenarios (inside the workers) ---------------------------------------------------------------------------------


def _poison(model, step: int) -> None:
    """At SKIP_STEP: an inf in the replicated gradient of the position embedding (a Shard(0) param), on every rank,
    in the rows that rank 1 steps: rank 0's slice holds none, so only the global decision can skip it there."""
    if step == SKIP_STEP:
        grad = model.pos_embeddings.weight.grad
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        local[SEQ_LEN - 1, 0] = float("inf")


def _train(model, step_fn, case: str) -> dict:
    out = {"skipped": []}
    for step in range(STEPS):
        model.zero_grad(set_to_none=True)
        model(tokens(step)).sum().backward()
        if case == "skip":
            _poison(model, step)
        out["skipped"].append(step_fn(step))
    out["params"] = {name: full(p) for name, p in model.named_parameters()}
    return out


def _clip(model) -> None:
    """torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP), which raises on this mix of plain and DTensor
    gradients (torch 2.13): the norm of the full gradients, each counted once, and every gradient's local piece (a
    partial sum's too) multiplied by the same coefficient."""
    from ort_optim.integrations import dtensor

    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm = torch.stack([full(g).double().square().sum() for g in grads]).sum().sqrt().float()
    coef = torch.clamp(CLIP / (norm + 1e-6), max=1.0)
    for g in grads:
        dtensor.local(g).mul_(coef)


def _torch_step(model, opt, case: str):
    from torch.distributed.tensor.experimental import implicit_replication

    def step(i):
        if case == "skip" and i == SKIP_STEP:
            return True
        if case in ("clip", "skip"):
            _clip(model)
        with implicit_replication():  # (plain LayerNorm params next to DTensor ones, as torch's test steps them)
            opt.step()
        return False
    return step


def _case(mesh, sequence_parallel: bool, case: str) -> dict:
    from torch.distributed.tensor.debug import CommDebugMode

    clip = CLIP if case in ("clip", "skip") else None
    one = make_model()
    tp_torch = parallelize(copy.deepcopy(one), mesh, sequence_parallel)
    tp_ours = parallelize(copy.deepcopy(one), mesh, sequence_parallel)
    out = {"layouts": {name: (str(tuple(p.placements)) if hasattr(p, "placements") else "plain",
                              None) for name, p in tp_ours.named_parameters()}}

    kwargs = dict(lr=LR, weight_decay=WEIGHT_DECAY, eps=EPS)
    one_opt = torch.optim.AdamW(one.parameters(), foreach=False, **kwargs)
    torch_opt = torch.optim.AdamW(tp_torch.parameters(), **kwargs)
    ours = FusedAdam(tp_ours.parameters(), adam_w_mode=AdamWMode.ADAMW_TORCH, max_grad_norm=clip, **kwargs)

    out["one-process"] = _train(one, _torch_step(one, one_opt, case), case)
    out["torch-tp"] = _train(tp_torch, _torch_step(tp_torch, torch_opt, case), case)
    comms, norms = [], []

    def our_step(i):
        with CommDebugMode() as mode:
            ours.step()
        comms.append({str(op): n for op, n in mode.get_comm_counts().items()})
        norms.append(None if ours.last_grad_norm is None else float(ours.last_grad_norm))
        return ours.last_step_skipped

    out["norms"] = norms
    out["ours"] = _train(tp_ours, our_step, case)
    out["comms"] = comms
    for name, p in tp_ours.named_parameters():
        if hasattr(p, "placements"):
            out["layouts"][name] = (str(tuple(p.placements)), str(tuple(p.grad.placements)))
    return out


def grad_norms() -> list[float]:
    """The unparallelised model's global gradient norm at each step, trained as the "clip" case trains."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), foreach=False, lr=LR, weight_decay=WEIGHT_DECAY, eps=EPS)
    norms = []
    for step in range(STEPS):
        model.zero_grad(set_to_none=True)
        model(tokens(step)).sum().backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP, foreach=False)))
        opt.step()
    return norms


def scenarios(rank: int, world: int, tmp_dir: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    out = {"rank": rank}
    for sequence_parallel in (False, True):
        for case in ("plain", "clip", "skip"):
            out[(sequence_parallel, case)] = _case(mesh, sequence_parallel, case)
    return out



def results(tmp_path_factory) -> list[dict]:
    """scenarios on WORLD ranks, by rank."""
    return run_ranks(scenarios, WORLD, tmp_path_factory.mktemp("tp_transformer"))

