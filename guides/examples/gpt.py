#!/usr/bin/env python
"""A small GPT trained on the Python standard library's own source, with ORTModule + FusedAdam + FP16_Optimizer,
next to the same model in eager PyTorch with torch.optim.AdamW.

    .venv/bin/python guides/examples/gpt.py                  # demo: a few minutes on 2 CPU cores
    .venv/bin/python guides/examples/gpt.py --quick          # seconds (what the tests run)
    .venv/bin/python guides/examples/gpt.py --config memopt --legs ort-fp32 --memory-opt-level 1
    .venv-latest/bin/python guides/examples/gpt.py --no-ort  # eager legs only (no ORTModule in this environment)

Data: every ``*.py`` file of the running interpreter's standard library (``sysconfig.get_paths()["stdlib"]``, sorted
by path, site-packages excluded), read as bytes: vocabulary 256, no download, no tokenizer. Every 10th file goes to
the validation split, the others to training. The corpus differs between Python versions; the summary records its
size and SHA-256.

Model: GPT-2 style, pre-LayerNorm blocks with hand-written causal attention (one Linear for q, k, v;
view/transpose; matmul; masked softmax) and a GELU MLP; token and position embeddings; the output head tied to the
token embedding unless ``--no-tie``. ``torch.nn.MultiheadAttention`` is avoided on purpose: it fails at ORTModule's
export in onnxruntime-training 1.19.2 (symbolic shape inference of Reshape).

Legs (each runs in its own process, so peak RSS is per leg and ORT's environment variables are read fresh):

* ``eager-adamw``  eager PyTorch, fp32, torch.optim.AdamW: the baseline.
* ``ort-fp32``     ORTModule, fp32, FusedAdam(adam_w_mode=ADAMW_TORCH, eps=1e-8): the same math as the baseline,
                   so its losses must track the baseline's (same seed, same init, same batches).
* ``ort-fp16``     ORTModule, fp16 parameters, FP16_Optimizer(FusedAdam(master_weights=True)): dynamic loss
                   scaling, fp32 master weights and moments inside FusedAdam.
* ``eager-fused``, ``eager-fp16``: the same two optimizers without ORTModule (used by ``--no-ort``).

Every leg uses the same hyperparameters: lr with linear warm-up then cosine decay, betas (0.9, 0.95), eps 1e-8,
weight decay 0.1 on the matrices (embeddings included), none on biases and LayerNorm weights.

Reported per leg: train loss per step, validation loss, tokens/s, forward+backward time, optimizer time (step +
zero_grad, including FP16_Optimizer's unscale/overflow check), the optimizer's share of the step, peak RSS of the
leg's process (VmHWM from ``/proc/self/status``, ``peak_rss_mb``; RSS, not tracemalloc, which does not see tensor
memory). Written to ``--out`` (default ``results/``): ``gpt_summary.json`` and ``gpt_loss.png``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # run from a checkout without installing the package

# Model and run sizes. "demo" is the default; "memopt" is the configuration of the memory-optimizer measurement;
# "grads" makes the gradients (about 100 MB) dominate the activations (a few MB), to measure step_in_backward's
# memory saving, which the other configurations hide under their activations.
CONFIGS = {
    "quick": dict(n_layer=2, d_model=64, n_head=2, block=64, batch=8, steps=16, warmup=4, eval_every=8,
                  eval_batches=2, lr=3e-3),
    "demo": dict(n_layer=4, d_model=128, n_head=4, block=128, batch=16, steps=150, warmup=15, eval_every=50,
                 eval_batches=8, lr=3e-3),
    "memopt": dict(n_layer=4, d_model=256, n_head=4, block=256, batch=16, steps=8, warmup=2, eval_every=0,
                   eval_batches=0, lr=1e-3),
    "grads": dict(n_layer=8, d_model=512, n_head=8, block=32, batch=2, steps=8, warmup=2, eval_every=0,
                  eval_batches=0, lr=1e-3),
}
BETAS = (0.9, 0.95)
EPS = 1e-8
WEIGHT_DECAY = 0.1
ALL_LEGS = ("eager-adamw", "ort-fp32", "ort-fp16", "eager-fused", "eager-fp16")
ORT_LEGS = ("eager-adamw", "ort-fp32", "ort-fp16")
NO_ORT_LEGS = ("eager-adamw", "eager-fused", "eager-fp16")
BASELINE = "eager-adamw"
# How closely ort-fp32 must track eager-adamw: same init, same batches, same optimizer math; only the kernels'
# floating-point order differs, and the difference grows with training. Checked by tests/guides/test_examples.py.
PARITY_STEPS = 5  # the first steps compared
PARITY_ATOL_FIRST = 2e-3  # max |loss difference| over the first PARITY_STEPS steps (nats)
PARITY_RTOL_FINAL = 0.03  # |final train loss difference| / baseline's, averaged over the last 10% of steps


# ---------------------------------------------------------------------------------------------------------------
# Environment
# ---------------------------------------------------------------------------------------------------------------


def ortmodule_status() -> tuple[bool, str]:
    """(usable, reason): ORTModule needs onnxruntime-training 1.19.2, which works with torch 2.4.x only."""
    import torch

    try:
        import onnxruntime.training.ortmodule  # noqa: F401
    except Exception as e:  # ImportError, or torch.onnx internals that moved in newer torch
        return False, (f"onnxruntime-training's ORTModule needs torch 2.4.x; this environment has torch "
                       f"{torch.__version__} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
    return True, ""


def rss_mb() -> float:
    """Current resident set size of this process, MB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far, MB: VmHWM, which starts afresh at exec. (ru_maxrss does not:
    Linux keeps it across execve, so a leg started from a larger parent process would report the parent's peak.)"""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ---------------------------------------------------------------------------------------------------------------
# Data: the standard library's source, byte-level
# ---------------------------------------------------------------------------------------------------------------


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__"))
        files.extend(Path(dirpath) / name for name in sorted(filenames) if name.endswith(".py"))
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def load_corpus():
    """(train bytes, validation bytes, info): every 10th file (in path order) is validation."""
    import torch

    files = stdlib_files()
    if not files:
        raise SystemExit(f"no .py files under {sysconfig.get_paths()['stdlib']}")
    train, val = bytearray(), bytearray()
    digest = hashlib.sha256()
    for i, path in enumerate(files):
        data = path.read_bytes()
        digest.update(data)
        (val if i % 10 == 9 else train).extend(data + b"\n")
    info = dict(root=sysconfig.get_paths()["stdlib"], files=len(files), train_bytes=len(train),
                val_bytes=len(val), sha256=digest.hexdigest()[:16])
    # Kept as uint8 (28 MB, not 228 MB as int64); batches are converted to int64 when they are cut.
    as_tensor = lambda b: torch.frombuffer(b, dtype=torch.uint8)  # noqa: E731
    return as_tensor(train), as_tensor(val), info


def batch_starts(n_tokens: int, block: int, batch: int, count: int, seed: int):
    """`count` batches of random window starts, the same for every leg."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, n_tokens - block - 1, (count, batch), generator=g)


def get_batch(data, starts, block: int):
    import torch

    x = torch.stack([data[s:s + block] for s in starts.tolist()]).long()
    y = torch.stack([data[s + 1:s + 1 + block] for s in starts.tolist()]).long()
    return x, y


# ---------------------------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------------------------


def build_model(n_layer: int, d_model: int, n_head: int, block: int, tie: bool, seed: int):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class CausalSelfAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.n_head, self.head_dim = n_head, d_model // n_head
            self.scale = 1.0 / math.sqrt(self.head_dim)
            self.qkv = nn.Linear(d_model, 3 * d_model)
            self.proj = nn.Linear(d_model, d_model)
            self.register_buffer("mask", torch.ones(block, block, dtype=torch.bool).tril(), persistent=False)

        def forward(self, x):
            B, T, C = x.shape
            q, k, v = self.qkv(x).split(C, dim=2)
            q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, H, T, hd)
            k = k.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
            v = v.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
            att = (q @ k.transpose(-2, -1)) * self.scale
            att = att.masked_fill(~self.mask[:T, :T], float("-inf")).softmax(dim=-1)
            y = (att @ v).transpose(1, 2).reshape(B, T, C)
            return self.proj(y)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.attn = nn.LayerNorm(d_model), CausalSelfAttention()
            self.ln2, self.fc, self.fc_out = nn.LayerNorm(d_model), nn.Linear(d_model, 4 * d_model), \
                nn.Linear(4 * d_model, d_model)

        def forward(self, x):
            x = x + self.attn(self.ln1(x))
            return x + self.fc_out(F.gelu(self.fc(self.ln2(x))))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(256, d_model)
            self.pos = nn.Embedding(block, d_model)
            self.blocks = nn.ModuleList(Block() for _ in range(n_layer))
            self.ln_f = nn.LayerNorm(d_model)
            self.head = nn.Linear(d_model, 256, bias=False)
            if tie:
                self.head.weight = self.tok.weight
            self.register_buffer("positions", torch.arange(block), persistent=False)

        def forward(self, idx, targets):
            T = idx.shape[1]
            x = self.tok(idx) + self.pos(self.positions[:T])
            for blk in self.blocks:
                x = blk(x)
            logits = self.head(self.ln_f(x))
            # The loss in fp32 even for an fp16 model (a Cast in the exported graph).
            return F.cross_entropy(logits.float().view(-1, 256), targets.reshape(-1))

    torch.manual_seed(seed)
    model = GPT()
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            nn.init.zeros_(p)
        elif "ln" in name:
            nn.init.ones_(p)
        elif name.endswith(("proj.weight", "fc_out.weight")):  # GPT-2: residual projections scaled by depth
            nn.init.normal_(p, std=0.02 / math.sqrt(2 * n_layer))
        else:
            nn.init.normal_(p, std=0.02)
    return model


def param_groups(model):
    """Weight decay on matrices (dim >= 2), none on biases and LayerNorm weights."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [dict(params=decay, weight_decay=WEIGHT_DECAY), dict(params=no_decay, weight_decay=0.0)]


def lr_at(step: int, cfg: dict) -> float:
    """Linear warm-up, then cosine decay to 10% of the peak."""
    if step < cfg["warmup"]:
        return cfg["lr"] * (step + 1) / cfg["warmup"]
    progress = (step - cfg["warmup"]) / max(1, cfg["steps"] - cfg["warmup"])
    return cfg["lr"] * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


# ---------------------------------------------------------------------------------------------------------------
# One leg, in this process
# ---------------------------------------------------------------------------------------------------------------


def run_leg(leg: str, cfg: dict, args) -> dict:
    import torch

    torch.set_num_threads(args.threads or torch.get_num_threads())
    rss_start, load_start = rss_mb(), os.getloadavg()[0]
    use_ort, fp16 = leg.startswith("ort-"), leg.endswith("fp16")
    train, val, corpus = load_corpus()
    starts = batch_starts(len(train), cfg["block"], cfg["batch"], cfg["steps"], args.seed + 1)
    val_starts = batch_starts(len(val), cfg["block"], cfg["batch"], cfg["eval_batches"], args.seed + 2)
    model = build_model(cfg["n_layer"], cfg["d_model"], cfg["n_head"], cfg["block"], not args.no_tie, args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    if fp16:
        model = model.half()

    from ort_optim import AdamWMode, FusedAdam

    groups = param_groups(model)
    fused = None
    if leg == "eager-adamw":
        optimizer = torch.optim.AdamW(groups, lr=cfg["lr"], betas=BETAS, eps=EPS)
        opt_name = "torch.optim.AdamW"
    else:
        # FusedAdam with torch's AdamW math; ORT's own defaults (eps=1e-6, ADAMW_TRANSFORMERS) would not match.
        # --step-in-backward: each param is updated in backward as its gradient completes (not with FP16_Optimizer's
        # loss scaling, which needs every gradient first).
        fused = FusedAdam(groups, lr=cfg["lr"], betas=BETAS, eps=EPS, adam_w_mode=AdamWMode.ADAMW_TORCH,
                          master_weights=fp16, step_in_backward=args.step_in_backward and not fp16)
        if fp16:
            from ort_optim.fp16_optimizer import FP16_Optimizer

            optimizer = FP16_Optimizer(fused, init_scale=2.0 ** 16)
            opt_name = "FP16_Optimizer(FusedAdam(master_weights=True))"
        else:
            optimizer = fused
            opt_name = "FusedAdam(adam_w_mode=ADAMW_TORCH, eps=1e-8)"

    ort_options = None
    if use_ort:
        from ort_optim.options import ORTModuleOptions, wrap

        ort_options = ORTModuleOptions(memory_opt_level=args.memory_opt_level,
                                       log_level="INFO" if args.ort_log_info else None)
        model = wrap(model, ort_options)
    model.train()

    def evaluate() -> float:
        losses = []
        for starts_ in val_starts:
            x, y = get_batch(val, starts_, cfg["block"])
            # ORTModule switches to a second, inference-only graph (a second export) under no_grad or eval();
            # a forward in training mode computes the same loss (no dropout here) and reuses the training graph.
            with torch.enable_grad() if use_ort else torch.no_grad():
                losses.append(float(model(x, y).detach()))
        return sum(losses) / len(losses) if losses else float("nan")

    def set_lr(lr: float) -> None:
        for group in optimizer.param_groups:
            group["lr"] = lr

    rss_before = rss_mb()
    losses, val_losses, fwd_bwd_s, opt_s, skipped, grad_norms = [], [], [], [], 0, []
    from tqdm import tqdm

    bar = tqdm(range(cfg["steps"]), desc=f"{leg:<11}", file=sys.stderr, ncols=100, disable=args.no_progress,
               mininterval=1.0)
    t_start = time.perf_counter()
    for step in bar:
        set_lr(lr_at(step, cfg))
        x, y = get_batch(train, starts[step], cfg["block"])
        t0 = time.perf_counter()
        loss = model(x, y)
        if fp16:
            optimizer.backward(loss)
        else:
            loss.backward()
        t1 = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad()
        t2 = time.perf_counter()
        if fp16 and optimizer.overflow:
            skipped += 1
        losses.append(float(loss.detach()))
        # FusedAdam's global norm of the unscaled gradients, from a pass that reads them anyway: the one that unscales
        # them (the fp16 leg: loss scaling), or the update itself (fp32 legs, native CPU plan).
        norm = None if fused is None else fused.last_grad_norm
        grad_norms.append(None if norm is None else float(norm))
        fwd_bwd_s.append(t1 - t0)
        opt_s.append(t2 - t1)
        if cfg["eval_every"] and ((step + 1) % cfg["eval_every"] == 0 or step + 1 == cfg["steps"]):
            val_losses.append((step + 1, evaluate()))
        bar.set_postfix(loss=f"{losses[-1]:.3f}", **({} if grad_norms[-1] is None else
                                                      {"grad_norm": f"{grad_norms[-1]:.3g}"}), refresh=False)
    bar.close()
    wall = time.perf_counter() - t_start

    # Timings: medians over the steps after the first ones (the first step of an ORT leg exports the model).
    skip = min(3, max(1, cfg["steps"] // 4))
    fb, op = statistics.median(fwd_bwd_s[skip:]), statistics.median(opt_s[skip:])
    tokens = cfg["batch"] * cfg["block"]
    result = dict(
        leg=leg, optimizer=opt_name, ortmodule=use_ort, dtype="float16" if fp16 else "float32",
        memory_opt_level=args.memory_opt_level if use_ort else None,
        ort_env=ort_options.to_env() if ort_options is not None else None,
        torch=torch.__version__, threads=torch.get_num_threads(), params=n_params, corpus=corpus,
        train_loss=losses, val_loss=val_losses,
        final_train_loss=statistics.mean(losses[-max(1, len(losses) // 10):]),
        final_val_loss=val_losses[-1][1] if val_losses else None,
        first_step_s=fwd_bwd_s[0] + opt_s[0], fwd_bwd_s=fb, optimizer_s=op, step_s=fb + op,
        optimizer_share=op / (fb + op), tokens_per_s=tokens / (fb + op), wall_s=wall,
        rss_at_start_mb=rss_start, rss_before_training_mb=rss_before, peak_rss_mb=peak_rss_mb(),
        skipped_steps=skipped, final_loss_scale=float(optimizer.loss_scale) if fp16 else None,
        step_in_backward=bool(getattr(optimizer, "step_in_backward", False)), grad_mb=4 * n_params / 2**20,
        grad_norm=grad_norms if any(n is not None for n in grad_norms) else None,
        # 1-minute load average of the machine at the start and end of the leg: other processes skew the timings.
        load_avg=(load_start, os.getloadavg()[0]), cpus=os.cpu_count(),
    )
    return result


# ---------------------------------------------------------------------------------------------------------------
# The driver: one process per leg, then the table, the plot and the JSON summary
# ---------------------------------------------------------------------------------------------------------------


def run_leg_subprocess(leg: str, args, log_path: Path | None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        result_path = Path(tmp) / "leg.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--leg", leg, "--leg-result", str(result_path),
               "--config", args.config, "--seed", str(args.seed), "--memory-opt-level", str(args.memory_opt_level)]
        for flag in ("steps", "threads"):
            if getattr(args, flag) is not None:
                cmd += [f"--{flag}", str(getattr(args, flag))]
        for flag in ("no_tie", "no_progress", "ort_log_info", "step_in_backward"):
            if getattr(args, flag):
                cmd.append("--" + flag.replace("_", "-"))
        if log_path is None:
            proc = subprocess.run(cmd)
        else:  # keep ORT's log (the memory optimizer's plans) in a file, and echo it
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            log_path.write_text(proc.stdout)
            sys.stdout.write(proc.stdout)
        if proc.returncode != 0:
            raise SystemExit(f"leg {leg} failed (exit code {proc.returncode}): {' '.join(cmd)}")
        return json.loads(result_path.read_text())


def parity(base: dict, other: dict) -> dict:
    a, b = base["train_loss"], other["train_loss"]
    n = min(len(a), len(b))
    first = max(abs(x - y) for x, y in zip(a[:PARITY_STEPS], b[:PARITY_STEPS]))
    k = max(1, n // 10)
    final_rel = abs(statistics.mean(a[n - k:n]) - statistics.mean(b[n - k:n])) / statistics.mean(a[n - k:n])
    return dict(max_abs_diff_first_steps=first, first_steps=min(PARITY_STEPS, n), atol_first=PARITY_ATOL_FIRST,
                final_rel_diff=final_rel, rtol_final=PARITY_RTOL_FINAL,
                ok=first <= PARITY_ATOL_FIRST and final_rel <= PARITY_RTOL_FINAL)


def table(results: dict) -> str:
    rows = [("leg", "optimizer", "train loss", "val loss", "step ms", "fwd+bwd ms", "optim ms", "optim %",
             "tokens/s", "peak RSS MB")]
    for leg, r in results.items():
        rows.append((leg, r["optimizer"], f"{r['final_train_loss']:.4f}",
                     "-" if r["final_val_loss"] is None else f"{r['final_val_loss']:.4f}",
                     f"{1e3 * r['step_s']:.1f}", f"{1e3 * r['fwd_bwd_s']:.1f}", f"{1e3 * r['optimizer_s']:.1f}",
                     f"{100 * r['optimizer_share']:.1f}", f"{r['tokens_per_s']:.0f}", f"{r['peak_rss_mb']:.0f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) if i >= 2 else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def plot(results: dict, path: Path, title: str) -> None:
    """Loss curves (top) and each leg's train loss minus the baseline's (bottom: where the legs track or drift)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, diff_ax) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True, gridspec_kw=dict(height_ratios=(3, 1.4)))
    base = results.get(BASELINE)
    for leg, r in results.items():
        steps = range(1, len(r["train_loss"]) + 1)
        line, = ax.plot(steps, r["train_loss"], lw=1, alpha=0.8, label=f"{leg} train")
        if r["val_loss"]:
            val_steps, vals = zip(*r["val_loss"])
            ax.plot(val_steps, vals, "o--", color=line.get_color(), ms=4, label=f"{leg} validation")
        if base is not None and leg != BASELINE:
            diff_ax.plot(steps, [a - b for a, b in zip(r["train_loss"], base["train_loss"])], lw=1,
                         color=line.get_color(), label=leg)
    ax.set_ylabel("cross-entropy (nats/byte)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    diff_ax.axhline(0, color="black", lw=0.5)
    diff_ax.set_ylabel(f"train loss −\n{BASELINE}", fontsize=8)
    diff_ax.set_xlabel("step")
    diff_ax.grid(alpha=0.3)
    if base is not None and len(results) > 1:
        diff_ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", choices=sorted(CONFIGS), default="demo", help="model and run size (default demo)")
    ap.add_argument("--quick", action="store_true", help="tiny model, a few steps: seconds (same as --config quick)")
    ap.add_argument("--steps", type=int, help="training steps (default: the config's)")
    ap.add_argument("--legs", help=f"comma-separated legs among {', '.join(ALL_LEGS)} "
                                   f"(default {','.join(ORT_LEGS)}, or {','.join(NO_ORT_LEGS)} without ORTModule)")
    ap.add_argument("--no-ort", action="store_true", help="eager legs only (automatic when ORTModule is unusable)")
    ap.add_argument("--memory-opt-level", type=int, choices=(0, 1), default=0,
                    help="ORTModuleOptions(memory_opt_level=...) for the ORT legs (default 0)")
    ap.add_argument("--ort-log-info", action="store_true",
                    help="ORTModuleOptions(log_level='INFO'): ORT prints its memory optimizer's plans")
    ap.add_argument("--no-tie", action="store_true", help="do not tie the output head to the token embedding")
    ap.add_argument("--step-in-backward", action="store_true",
                    help="FusedAdam(step_in_backward=True) in the fp32 FusedAdam legs: each param is updated during "
                         "backward and its gradient freed (compare peak_rss_mb and step_s with a run without it)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--out", default="results", help="folder for gpt_summary.json and gpt_loss.png (default results/)")
    ap.add_argument("--no-progress", action="store_true", help="no tqdm progress bars")
    ap.add_argument("--check", action="store_true", help="exit with status 1 if the losses do not track")
    ap.add_argument("--leg", choices=ALL_LEGS, help=argparse.SUPPRESS)  # internal: run one leg in this process
    ap.add_argument("--leg-result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.quick:
        args.config = "quick"
    cfg = dict(CONFIGS[args.config])
    if args.steps is not None:
        cfg["steps"] = args.steps
        cfg["warmup"] = min(cfg["warmup"], max(1, args.steps // 10))

    if args.leg:  # child process
        result = run_leg(args.leg, cfg, args)
        Path(args.leg_result).write_text(json.dumps(result))
        return 0

    # --no-ort does not even import onnxruntime (the check imports ORTModule, which takes a few seconds).
    usable, why = (False, "--no-ort was given") if args.no_ort else ortmodule_status()
    if args.legs:
        legs = [leg.strip() for leg in args.legs.split(",") if leg.strip()]
        unknown = [leg for leg in legs if leg not in ALL_LEGS]
        if unknown:
            ap.error(f"unknown legs {unknown}; choose among {', '.join(ALL_LEGS)}")
    else:
        legs = list(ORT_LEGS if usable and not args.no_ort else NO_ORT_LEGS)
    if not usable:
        if not args.no_ort:
            print(f"ORTModule is not usable here, running the eager legs only: {why}")
        dropped = [leg for leg in legs if leg.startswith("ort-")]
        if dropped:
            print(f"skipping {', '.join(dropped)} (--no-ort or no ORTModule)")
        legs = [leg for leg in legs if not leg.startswith("ort-")]

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"config {args.config}: {json.dumps(cfg)}; legs: {', '.join(legs)}; out: {out}/")
    results = {}
    for leg in legs:
        log = out / f"gpt_{leg}_level{args.memory_opt_level}.log" if args.ort_log_info and leg.startswith("ort") \
            else None
        results[leg] = run_leg_subprocess(leg, args, log)
        r = results[leg]
        print(f"[{leg}] loss {r['final_train_loss']:.4f}, step {1e3 * r['step_s']:.1f} ms, "
              f"peak RSS {r['peak_rss_mb']:.0f} MB", flush=True)

    checks = {leg: parity(results[BASELINE], r) for leg, r in results.items()
              if leg != BASELINE and BASELINE in results and r["dtype"] == "float32"}
    first = next(iter(results.values()))
    title = (f"GPT {cfg['n_layer']}x{cfg['d_model']}, T={cfg['block']}, batch {cfg['batch']}, "
             f"{first['params'] / 1e6:.2f}M params, stdlib bytes ({first['corpus']['train_bytes'] / 1e6:.1f} MB)")
    png = out / "gpt_loss.png"
    plot(results, png, title)
    summary = dict(config=args.config, cfg=cfg, legs=legs, ortmodule_usable=usable, ortmodule_reason=why or None,
                   memory_opt_level=args.memory_opt_level, command=" ".join([Path(sys.executable).name] + sys.argv),
                   parity=checks, plot=str(png), results=results)
    (out / "gpt_summary.json").write_text(json.dumps(summary, indent=1))

    print()
    print(title)
    print(table(results))
    print("step = forward+backward + optimizer (step and zero_grad); medians after the first steps; "
          "peak RSS of each leg's own process")
    for leg, c in checks.items():
        print(f"losses track ({leg} vs {BASELINE}): max |diff| over the first {c['first_steps']} steps "
              f"{c['max_abs_diff_first_steps']:.2e} (tolerance {c['atol_first']:.0e}); final train loss differs by "
              f"{100 * c['final_rel_diff']:.2f}% (tolerance {100 * c['rtol_final']:.0f}%): "
              f"{'OK' if c['ok'] else 'NOT OK'}")
    for leg, r in results.items():
        if r["dtype"] == "float16":
            print(f"{leg}: {r['skipped_steps']} step(s) skipped for overflow, final loss scale "
                  f"{r['final_loss_scale']:g}")
    loads = [x for r in results.values() for x in r["load_avg"]]
    print(f"machine: {first['cpus']} CPUs, torch {first['threads']} threads; 1-minute load average during the legs "
          f"{min(loads):.1f}-{max(loads):.1f} (timings are skewed when it exceeds the CPU count)")
    print(f"plot: {png}\nsummary: {out / 'gpt_summary.json'}")
    if args.check and not all(c["ok"] for c in checks.values()):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
