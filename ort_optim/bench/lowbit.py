"""Low-bit optimizer states: FusedAdam with 8-bit (``torch.uint8``), 4-bit (``torch.uint4``) and fp8
(``torch.float8_e4m3fn`` / ``float8_e5m2``) moments against its
own fp32 moments and against torchao's ``AdamW8bit``/``AdamW4bit`` and bitsandbytes' ``AdamW8bit``.

    python -m ort_optim.bench --sections lowbit [--quick]          # step time, bytes/param, loss
    python -m ort_optim.bench --sections lowbit_memory [--quick]   # bytes/param of every configuration
    python -m ort_optim.bench --sections lowbit_limit [--quick]    # where the step's time goes (compute vs bytes)

Three sections of the benchmark (registered in ``EXTRA_SECTIONS`` of ``__main__``):

* ``lowbit``: the step on GPT-2-small parameter shapes and on 2000 x 1K, every implementation on the same kind of
  params, interleaved (round robin after a warm-up step, which also compiles torchao's kernels), medians; the state's
  bytes per parameter measured from ``optimizer.state`` (see :func:`state_bytes`); and the mean training loss of the
  same optimizer configuration on the Zipf bag-of-tokens task (:func:`zipf_task`, one seed): speed and accuracy side
  by side. ``ort_optim_same_bits_speedup``: a library's step time over ours with moments of the same bits (uint8,
  uint4), given only where the library's state is that small (SAME_BITS_STATE_ALLOWANCE): torchao and bitsandbytes
  keep tensors under 4096 elements (all of 2000 x 1K) in fp32, and their row says so instead. Targets: 8-bit and
  4-bit moments at least 1.2x faster than fp32 moments; 10x the CPU step speed of torchao and bitsandbytes at their
  accuracy or better.
* ``lowbit_memory``: params + state bytes per parameter for every configuration (param dtype x moment formats),
  measured the same way on GPT-2-small shapes.
* ``lowbit_limit``: the limit probe (:func:`run_limit`): each format's step cold against the bytes it must move at
  the bandwidth measured in the same loop, and hot on a cache-resident tensor (its compute alone), so that the table
  shows with arithmetic why the 1.2x goal is or is not reachable on the machine.

What is not installed (torchao, bitsandbytes: newest-torch environment only) or not supported by this FusedAdam
becomes a row that says why. torchao's optimizers are torch.compile'd (minutes of compilation per parameter shape on
a loaded 2-core machine): with ``TORCHDYNAMO_DISABLE=1`` the ``lowbit`` section skips them (an eager run would
misstate their speed) and ``lowbit_memory`` counts their bytes eagerly. The configurations, the bytes counter and the Zipf task are shared with
``guides/examples/lowbit_quality.py``, the quality harness (3 tasks x 3 seeds).
"""

from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from . import probes
from .common import WORKLOADS, make_params, time_interleaved_one_thread

UINT4 = getattr(torch, "uint4", None)


# ---- optimizer configurations ------------------------------------------------------------------------------------

class Unavailable(Exception):
    """A configuration that cannot run here (library not installed, format not supported): the reason."""


@dataclass(frozen=True)
class Config:
    """One optimizer configuration of the comparison.

    bits: storage bits of the moments (32, 16, 8 or 4): the quality tolerance class (8-bit: 1%, 4-bit: 3%).
    baseline: the configuration whose loss this one is judged against (fp32 moments, or for bf16 params without
    master weights the bf16 run with fp32 master weights).
    """

    name: str
    library: str  # "ort_optim", "torchao" or "bitsandbytes"
    bits: int
    param_dtype: torch.dtype = torch.float32
    baseline: str = "fp32"
    options: dict = field(default_factory=dict)  # FusedAdam keyword arguments, or the library's
    note: str = ""


def _fused(name, bits, param_dtype=torch.float32, baseline="fp32", note="", **options) -> Config:
    return Config(name, "ort_optim", bits, param_dtype, baseline, options, note)


CONFIGS: dict[str, Config] = {c.name: c for c in [
    _fused("fp32", 32, note="fp32 params and moments (the baseline of the low-bit formats)"),
    _fused("bf16 moments", 16, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16),
    _fused("fp16 moments", 16, exp_avg_dtype=torch.float16, exp_avg_sq_dtype=torch.float16,
           note="fp16 codes with a power-of-two scale per 1024 elements"),
    _fused("uint8", 8, exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8),
    _fused("uint4", 4, exp_avg_dtype=UINT4, exp_avg_sq_dtype=UINT4),
    _fused("fp8", 8, exp_avg_dtype=torch.float8_e4m3fn, exp_avg_sq_dtype=torch.float8_e4m3fn,
           note="float8_e4m3fn codes with a power-of-two scale per 256 elements, sqrt(v) for the second moment"),
    _fused("fp8 e5m2", 8, exp_avg_dtype=torch.float8_e5m2, exp_avg_sq_dtype=torch.float8_e5m2),
    _fused("fp8 e4m3 m + e5m2 v", 8, exp_avg_dtype=torch.float8_e4m3fn, exp_avg_sq_dtype=torch.float8_e5m2),
    _fused("bf16 + fp32 master", 32, torch.bfloat16, "bf16 + fp32 master", master_weights=True,
           note="bf16 params, fp32 master weights and moments (the baseline of the bf16 configurations)"),
    _fused("bf16 no master", 32, torch.bfloat16, "bf16 + fp32 master", master_weights=False,
           note="bf16 params updated in place with round-to-nearest (what stochastic rounding fixes)"),
    _fused("bf16 SR + uint8", 8, torch.bfloat16, "bf16 + fp32 master", master_weights=False,
           stochastic_rounding=True, exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8),
    _fused("bf16 SR + uint4", 4, torch.bfloat16, "bf16 + fp32 master", master_weights=False,
           stochastic_rounding=True, exp_avg_dtype=UINT4, exp_avg_sq_dtype=UINT4),
    _fused("bf16 SR + fp8", 8, torch.bfloat16, "bf16 + fp32 master", master_weights=False,
           stochastic_rounding=True, exp_avg_dtype=torch.float8_e4m3fn, exp_avg_sq_dtype=torch.float8_e4m3fn),
    Config("torchao AdamW8bit", "torchao", 8, options=dict(cls="AdamW8bit")),
    Config("torchao AdamW4bit", "torchao", 4, options=dict(cls="AdamW4bit")),
    Config("torchao AdamW8bit bf16 SR", "torchao", 8, torch.bfloat16, "bf16 + fp32 master",
           options=dict(cls="AdamW8bit", bf16_stochastic_round=True)),
    Config("bitsandbytes AdamW8bit", "bitsandbytes", 8, options=dict(cls="AdamW8bit")),
]}


def make_optimizer(config: Config, params, lr: float, betas=(0.9, 0.999), eps: float = 1e-8,
                   weight_decay: float = 1e-2, eager_ok: bool = False) -> torch.optim.Optimizer:
    """The optimizer of a configuration, with torch.optim.AdamW's math (decoupled decay, eps outside the sqrt) in every
    library. Raises Unavailable with the reason when it cannot run here. torchao's optimizers are torch.compile'd
    kernels: with compilation disabled (TORCHDYNAMO_DISABLE=1) they run eagerly, many times slower than they are,
    so they are refused unless eager_ok (what only counts bytes may say so)."""
    hyper = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    if config.library == "ort_optim":
        from ..fused_adam import AdamWMode, FusedAdam

        if any(v is None for v in config.options.values()):
            raise Unavailable(f"torch {torch.__version__} has no torch.uint4")
        try:
            return FusedAdam(params, adam_w_mode=AdamWMode.ADAMW_TORCH, **hyper, **config.options)
        except (TypeError, ValueError) as exc:  # an option this FusedAdam does not have (yet)
            raise Unavailable(f"FusedAdam does not accept {config.options}: {exc}") from None
    options = dict(config.options)
    cls_name = options.pop("cls")
    if config.library == "torchao":
        try:
            import torchao.optim as module
        except Exception as exc:  # not installed (.venv), or broken against this torch
            raise Unavailable(f"torchao is not installed here ({type(exc).__name__})") from None
    elif config.library == "bitsandbytes":
        try:
            import bitsandbytes.optim as module
        except Exception as exc:
            raise Unavailable(f"bitsandbytes is not installed here ({type(exc).__name__})") from None
    else:
        raise ValueError(f"unknown library {config.library!r}")
    if config.library == "torchao":
        if os.environ.get("TORCHDYNAMO_DISABLE", "0") not in ("", "0") and not eager_ok:
            raise Unavailable("torchao's optimizers run compiled, and torch.compile is disabled here "
                              "(TORCHDYNAMO_DISABLE=1): an eager run would misstate them")
        hyper["lr"] = torch.tensor(lr)  # torchao keeps lr as a tensor (changing it must not recompile)
    return getattr(module, cls_name)(params, **hyper, **options)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Sets every group's lr, in place where the optimizer keeps it as a tensor (torchao)."""
    for group in optimizer.param_groups:
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


# ---- bytes ---------------------------------------------------------------------------------------------------------

def _leaf_tensors(value):
    """The plain tensors that hold a state value: tensor subclasses (torchao's quantised states) are flattened into
    their inner tensors (codes, scales, code map)."""
    if isinstance(value, torch.Tensor):
        if type(value) is not torch.Tensor and hasattr(value, "__tensor_flatten__"):
            names, _ = value.__tensor_flatten__()
            for name in names:
                yield from _leaf_tensors(getattr(value, name))
        else:
            yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _leaf_tensors(item)


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind tensors (each storage counted once, in full: views of one flat buffer,
    padding included, and shared code maps count once)."""
    seen: dict[tuple, int] = {}
    for t in tensors:
        for leaf in _leaf_tensors(t):
            storage = leaf.untyped_storage()
            seen[(leaf.device, storage.data_ptr(), storage.nbytes())] = storage.nbytes()
    return sum(seen.values())


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every storage in optimizer.state except the step counts (the bytes the targets count): moments, their scales
    and code maps, master weights."""
    return storage_bytes(value for state in optimizer.state.values() for key, value in state.items()
                         if key != "step" and isinstance(value, torch.Tensor))


def params_of(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return list({id(p): p for group in optimizer.param_groups for p in group["params"]}.values())


def memory(optimizer: torch.optim.Optimizer) -> dict:
    """Bytes per parameter of the state, of the params, and of both, measured from the optimizer after a step."""
    params = params_of(optimizer)
    numel = sum(p.numel() for p in params)
    state = state_bytes(optimizer)
    param = storage_bytes(params)
    return dict(state_bytes_per_param=state / numel, param_bytes_per_param=param / numel,
                params_and_state_bytes_per_param=(state + param) / numel)


# ---- the Zipf bag-of-tokens task ---------------------------------------------------------------------------------

@dataclass
class TrainingRun:
    """What one training run needs: the model (params already in the run's dtype), its param groups, one batch per
    step, the loss, the lr schedule, and the optimizer hyperparameters shared by every configuration."""

    model: torch.nn.Module
    groups: list
    batches: list
    loss: Callable
    lr_at: Callable[[int], float]
    betas: tuple = (0.9, 0.999)
    eps: float = 1e-8


ZIPF_SIZES = {
    # vocabulary, embedding width, classes, tokens per document, batch, steps
    "quick": dict(vocab=4096, dim=32, classes=8, doc_len=24, batch=64, steps=80),
    "default": dict(vocab=16384, dim=32, classes=8, doc_len=24, batch=64, steps=300),
}
ZIPF_EXPONENT = 1.1
ZIPF_LR = 1e-2


def zipf_task(seed: int, param_dtype: torch.dtype, size: str = "default") -> TrainingRun:
    """A bag-of-tokens classifier whose token frequencies follow Zipf's law (p(rank r) ~ r^-1.1).

    Documents are ``doc_len`` tokens drawn from the Zipf distribution; token ids are a random permutation of the
    ranks, so frequent and rare tokens share every quantisation block. The label is the argmax of a hidden random
    linear function of the bag (a teacher), so every token carries signal. Model: mean-pooled ``EmbeddingBag``, then
    LayerNorm and a linear layer. Most embedding rows see a gradient only rarely, and tiny when they do: their second
    moment decays towards zero between visits, which is where a quantised second moment that rounds to zero makes the
    update explode. Fresh batches every step (training loss = test loss in expectation)."""
    s = ZIPF_SIZES[size]
    gen = torch.Generator().manual_seed(10_000 + seed)
    ranks = torch.arange(1, s["vocab"] + 1, dtype=torch.float64)
    probs = ranks.pow(-ZIPF_EXPONENT)
    probs /= probs.sum()
    token_of_rank = torch.randperm(s["vocab"], generator=gen)
    teacher = torch.randn(s["vocab"], s["classes"], generator=gen)
    batches = []
    for _ in range(s["steps"]):
        docs = token_of_rank[torch.multinomial(probs, s["batch"] * s["doc_len"], replacement=True, generator=gen)]
        docs = docs.view(s["batch"], s["doc_len"])
        labels = teacher[docs].sum(dim=1).argmax(dim=1)
        batches.append((docs, labels))
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.EmbeddingBag(s["vocab"], s["dim"], mode="mean"),
                                torch.nn.LayerNorm(s["dim"]), torch.nn.Linear(s["dim"], s["classes"]))
    torch.nn.init.normal_(model[0].weight, std=0.1)
    model = model.to(param_dtype)

    def loss(m, batch):
        docs, labels = batch
        return torch.nn.functional.cross_entropy(m(docs).float(), labels)

    groups = [dict(params=[model[0].weight, model[2].weight], weight_decay=1e-2),
              dict(params=[model[1].weight, model[1].bias, model[2].bias], weight_decay=0.0)]
    warmup = max(1, s["steps"] // 20)
    return TrainingRun(model, groups, batches, loss,
                       lambda step: ZIPF_LR * min(1.0, (step + 1) / warmup))


def train(run: TrainingRun, config: Config) -> dict:
    """Trains run.model with the configuration's optimizer; the per-step training losses, the state's bytes and the
    time. A loss that is not finite stops the run (diverged=True)."""
    optimizer = make_optimizer(config, run.groups, lr=run.lr_at(0), betas=run.betas, eps=run.eps,
                               weight_decay=0.0)  # weight decay comes from the groups
    losses = []
    start = time.perf_counter()
    for step, batch in enumerate(run.batches):
        set_lr(optimizer, run.lr_at(step))
        loss = run.loss(run.model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        if not math.isfinite(losses[-1]):
            break
    seconds = time.perf_counter() - start
    diverged = len(losses) < len(run.batches) or not math.isfinite(losses[-1])
    result = dict(losses=losses, mean_loss=statistics.fmean(losses) if not diverged else float("inf"),
                  final_loss=statistics.fmean(losses[-max(1, len(losses) // 10):]) if not diverged else float("inf"),
                  diverged=diverged, seconds=seconds)
    result.update(memory(optimizer))
    return result


# ---- the benchmark sections --------------------------------------------------------------------------------------

BENCH_CONFIGS = ["fp32", "uint8", "uint4", "fp8", "bf16 SR + uint8", "bf16 SR + uint4", "bf16 SR + fp8",
                 "torchao AdamW8bit", "torchao AdamW4bit", "bitsandbytes AdamW8bit"]
BENCH_HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)
SLOW_STEP_S = 1.0  # implementations slower than this per step get fewer timed repetitions (at least 2)
# A library's step is compared with ours of the same bits where its state holds at most this multiple of two moments
# of that many bits per param (block scales, small tensors left unquantised): a state far above it is not low-bit.
SAME_BITS_STATE_ALLOWANCE = 1.25


def _time_round_robin(steps: dict[str, Callable[[], None]], reps: int, first: dict[str, float]) -> dict[str, float]:
    """Median seconds per step, round robin (noise hits all alike); a slow implementation (first step over
    SLOW_STEP_S) is timed at most max(2, 10 s / its step) times."""
    budget = {name: reps if first[name] < SLOW_STEP_S else max(2, min(reps, int(10.0 / first[name])))
              for name in steps}
    times: dict[str, list[float]] = {name: [] for name in steps}
    for rep in range(reps):
        for name, step in steps.items():
            if rep < budget[name]:
                start = time.perf_counter()
                step()
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def _zipf_losses(names: list[str], quick: bool) -> dict[str, dict]:
    """Mean training loss of each configuration on the Zipf task (seed 0), or the reason it could not run."""
    out = {}
    for name in names:
        config = CONFIGS[name]
        try:
            out[name] = train(zipf_task(0, config.param_dtype, "quick" if quick else "default"), config)
        except Unavailable as exc:
            out[name] = dict(error=str(exc))
    return out


def run(quick: bool) -> list[dict]:
    """The ``lowbit`` section: one row per (workload, implementation)."""
    reps = 3 if quick else 5
    losses = _zipf_losses(BENCH_CONFIGS, quick)
    reference_loss = losses["fp32"].get("mean_loss")
    rows = []
    for workload in ("gpt2-small", "2000x1K"):
        shapes = WORKLOADS[workload](quick)
        param_sets = {dtype: make_params(shapes, dtype) for dtype in {CONFIGS[n].param_dtype for n in BENCH_CONFIGS}}
        numel = sum(p.numel() for p in param_sets[torch.float32])
        steps, first, info = {}, {}, {}
        for name in BENCH_CONFIGS:
            config = CONFIGS[name]
            base = dict(workload=workload, tensors=len(shapes), params=numel, implementation=name)
            try:
                optimizer = make_optimizer(config, param_sets[config.param_dtype], **BENCH_HYPER)
            except Unavailable as exc:
                rows.append(dict(base, skipped=str(exc)))
                continue
            start = time.perf_counter()
            optimizer.step()  # creates the state; torchao compiles its kernels here
            optimizer.step()
            first[name] = time.perf_counter() - start
            steps[name] = optimizer.step
            info[name] = (base, memory(optimizer))
        medians = _time_round_robin(steps, reps, first)
        fp32_ms = medians["fp32"] * 1e3 if "fp32" in medians else None
        ours_by_bits = {CONFIGS[n].bits: medians[n] * 1e3 for n in ("uint8", "uint4") if n in medians}
        for name, seconds in medians.items():
            config = CONFIGS[name]
            base, mem = info[name]
            ms = seconds * 1e3
            loss = losses[name]
            row = dict(base, median_ms=ms,
                       speedup_vs_fp32_moments=fp32_ms / ms if fp32_ms else None,
                       state_bytes_per_param=mem["state_bytes_per_param"],
                       params_and_state_bytes_per_param=mem["params_and_state_bytes_per_param"],
                       zipf_mean_loss=loss.get("mean_loss", loss.get("error")),
                       zipf_loss_vs_fp32=(loss["mean_loss"] / reference_loss - 1.0
                                          if "mean_loss" in loss and reference_loss else None))
            if config.library != "ort_optim" and config.bits in ours_by_bits:
                if mem["state_bytes_per_param"] <= SAME_BITS_STATE_ALLOWANCE * 2 * config.bits / 8:
                    row["ort_optim_same_bits_speedup"] = ms / ours_by_bits[config.bits]
                else:  # (torchao and bitsandbytes keep tensors under 4096 elements unquantised)
                    row["note"] = (f"its moments are not {config.bits}-bit here ({mem['state_bytes_per_param']:.3g} "
                                   f"state bytes/param): no same-bits ratio")
            rows.append(row)
        del steps, info, param_sets
    return rows


# ---- where the low-bit step's time goes: the limit probe ------------------------------------------------------

LIMIT_CONFIGS = ["fp32", "uint8", "uint4", "fp8", "fp8 e5m2"]  # (fp8 moves uint8's bytes: the 8-bit probe is its floor)
FLOOR_NAMES = {8: "linear 8-bit floor", 4: "linear 4-bit floor"}  # probes.LowBitFloorStep: bounds, not formats
HOT_NUMEL = 256 * 1024  # one tensor whose step stays in the caches (fp32: 4 MB of p, g, m, v; low-bit: 2.6 MB)
TINY_NUMEL = 1024  # a step that is all overhead (dispatch, plan), subtracted from the hot step


def moved_bytes_per_param(config: Config) -> float:
    """Bytes a step must move per parameter (fp32 params, no master weights): param read and write 8, gradient read
    4, and each moment read and written in its storage (fp32: 4 bytes; low-bit: its codes and its block's share of
    a scale, _spec.LowBitFormat.bytes_per_element and _spec.Fp8Format.bytes_per_element)."""
    from .._spec import FP8_FORMATS, LOW_BIT_FORMATS

    def moment(dtype):
        fmt = LOW_BIT_FORMATS.get(dtype) or FP8_FORMATS.get(dtype)
        return fmt.bytes_per_element() if fmt else 4.0

    return 12.0 + 2 * moment(config.options.get("exp_avg_dtype")) + 2 * moment(config.options.get("exp_avg_sq_dtype"))


def run_limit(quick: bool) -> list[dict]:
    """The ``lowbit_limit`` section: why the low-bit step is (or is not) faster than the fp32-moment step here.

    Per configuration (fp32 params): the bytes its step must move per parameter; its cold time per parameter on
    GPT-2-small shapes, each step right after an in-place probe that evicts the caches and measures the bandwidth
    at that moment (common.time_after_probe); the floor those bytes set at the probe's bandwidth; and its hot time
    per parameter, the same step on one cache-resident tensor (HOT_NUMEL elements, the per-step overhead of a
    TINY_NUMEL-element step subtracted) on one thread, divided by the thread count: the compute alone. A step cannot
    beat max(hot, floor), so
    ``bound_speedup_vs_fp32_cold`` (the fp32-moment step's cold time over that maximum) is the most the format could
    gain on this machine, and ``hot_ns_needed_for_1.2x`` is the compute budget that the 1.2x target would need.

    Two more rows (``kind`` "floor probe") time :class:`probes.LowBitFloorStep` the same ways: the cheapest
    block-quantised step of each width (linear codes, round to nearest, no tables). Their cold speed-up says what
    ANY 8-bit or 4-bit block format could reach here; a floor well inside the budget, with our step outside it,
    says the cost is our format's encoder and decoder, not the machine."""
    from .common import time_after_probe

    reps = 3 if quick else 7
    shapes = WORKLOADS["gpt2-small"](quick)
    cold_steps, hot_steps, tiny_steps, moved, numel = {}, {}, {}, {}, 0
    for name in LIMIT_CONFIGS:
        config = CONFIGS[name]
        try:
            params = make_params(shapes)
            numel = sum(p.numel() for p in params)
            optimizers = [make_optimizer(config, ps, **BENCH_HYPER)
                          for ps in (params, make_params([(HOT_NUMEL,)]), make_params([(TINY_NUMEL,)]))]
        except Unavailable:
            continue
        for optimizer in optimizers:
            optimizer.step()  # creates the state and the plan
        cold_steps[name], hot_steps[name], tiny_steps[name] = (o.step for o in optimizers)
        moved[name] = moved_bytes_per_param(config) * numel
    # The floor probes: the cheapest block-quantised step of each width over the same shapes (probes.LowBitFloorStep).
    for bits in (8, 4):
        try:
            floors = [probes.LowBitFloorStep(make_params(s), bits) for s in (shapes, [(HOT_NUMEL,)], [(TINY_NUMEL,)])]
        except probes.ProbeUnavailable as reason:
            print(f"lowbit_limit: no floor probe rows ({reason})")
            break
        name = FLOOR_NAMES[bits]
        for floor in floors:
            floor()
        cold_steps[name], hot_steps[name], tiny_steps[name] = floors
        block = 256 if bits == 8 else 128  # the probe's float32 scales: 4 bytes per block
        moved[name] = (12.0 + 4 * (bits / 8 + 4 / block)) * numel
    # The hot steps on one thread; compute scales with the cores, so the bound below divides by the thread count.
    threads = torch.get_num_threads()
    hot_reps = 20 if quick else 50
    hot = time_interleaved_one_thread(hot_steps, warmup=0, reps=hot_reps)  # (each optimizer stepped once above)
    tiny = time_interleaved_one_thread(tiny_steps, warmup=0, reps=hot_reps)
    cold, _, probe_gbps = time_after_probe(cold_steps, moved, quick, warmup=1, reps=reps)
    fp32_cold_ns = cold["fp32"] * 1e9 / numel if "fp32" in cold else None
    rows = []
    for name in cold:
        bytes_per_param = moved[name] / numel
        cold_ns = cold[name] * 1e9 / numel
        hot_ns = max(hot[name] - tiny[name], 0.0) * 1e9 / (HOT_NUMEL - TINY_NUMEL)  # one thread
        floor_ns = bytes_per_param / probe_gbps
        row = dict(implementation=name, kind="floor probe" if name in FLOOR_NAMES.values() else "step",
                   threads=threads, params=numel,
                   bytes_moved_per_param=bytes_per_param, probe_GBps=probe_gbps, cold_ns_per_param=cold_ns,
                   bytes_floor_ns_per_param=floor_ns, hot_ns_per_param_one_thread=hot_ns,
                   hot_ns_per_param=hot_ns / threads,
                   cold_speedup_vs_fp32_cold=fp32_cold_ns / cold_ns if fp32_cold_ns else None,
                   bound_speedup_vs_fp32_cold=fp32_cold_ns / max(hot_ns / threads, floor_ns) if fp32_cold_ns else None)
        if fp32_cold_ns:
            row["hot_ns_needed_for_1.2x"] = fp32_cold_ns / 1.2
        # the step's cold time over the floor probe's of its width, in the same run (fp8 moves 8-bit's bytes)
        width = {"uint8": 8, "fp8": 8, "fp8 e5m2": 8, "uint4": 4}.get(name)
        if width and FLOOR_NAMES[width] in cold:
            row["cold_vs_floor_probe"] = cold[name] / cold[FLOOR_NAMES[width]]
        rows.append(row)
    return rows


MEMORY_MOMENTS = [
    ("fp32", torch.float32, torch.float32), ("bf16", torch.bfloat16, torch.bfloat16),
    ("fp16", torch.float16, torch.float16), ("uint8", torch.uint8, torch.uint8), ("uint4", UINT4, UINT4),
    ("uint8 m + uint4 v", torch.uint8, UINT4),
    ("fp8 (e4m3fn)", torch.float8_e4m3fn, torch.float8_e4m3fn),
    ("fp8 e4m3fn m + e5m2 v", torch.float8_e4m3fn, torch.float8_e5m2),
]
MEMORY_PARAMS = [("fp32 params", torch.float32, {}), ("bf16 params + fp32 master", torch.bfloat16,
                                                       dict(master_weights=True)),
                 ("bf16 params, no master", torch.bfloat16, dict(master_weights=False))]


def run_memory(quick: bool) -> list[dict]:
    """The ``lowbit_memory`` section: bytes per parameter of params and state (no gradients) for every param setup x
    moment format of FusedAdam, and for torchao's and bitsandbytes' optimizers, after one step on GPT-2-small shapes
    (amsgrad off). The moment formats an environment does not support are rows that say why."""
    shapes = WORKLOADS["gpt2-small"](quick)
    rows = []
    for setup, dtype, options in MEMORY_PARAMS:
        params = make_params(shapes, dtype)
        numel = sum(p.numel() for p in params)
        for moments, m_dtype, v_dtype in MEMORY_MOMENTS:
            config = _fused(f"{setup}, {moments} moments", 0, dtype, exp_avg_dtype=m_dtype, exp_avg_sq_dtype=v_dtype,
                            **options)
            row = dict(params=setup, moments=moments, numel=numel)
            try:
                optimizer = make_optimizer(config, params, **BENCH_HYPER)
                optimizer.step()
                row.update(memory(optimizer))
            except Unavailable as exc:
                row["skipped"] = str(exc)
            rows.append(row)
            optimizer = None
    params = make_params(shapes)
    for name in ("torchao AdamW8bit", "torchao AdamW4bit", "bitsandbytes AdamW8bit"):
        row = dict(params="fp32 params", moments=name, numel=sum(p.numel() for p in params))
        try:
            optimizer = make_optimizer(CONFIGS[name], params, **BENCH_HYPER, eager_ok=True)  # bytes only
            optimizer.step()
            row.update(memory(optimizer))
        except Unavailable as exc:
            row["skipped"] = str(exc)
        rows.append(row)
    return rows
