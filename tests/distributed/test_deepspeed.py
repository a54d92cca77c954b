"""DeepSpeed 0.16.9 ZeRO stages 1-3 on two CPU processes (gloo), with ort_optim inside, as a specification.

This module's scenarios run in one spawn (tests/distributed_harness.py); the parent compares. The last section reads
torch_scenarios.py's spawn: FusedAdam as the client against torch's AdamW as the client under the same config, with
gradient accumulation and clipping (within 1e-6 at stages 1-3), and ``max_grad_norm`` on DeepSpeed's partitions, or
over param groups that ZeRO steps one at a time, refused before anything changes.

* FusedAdam as the client optimizer of ``deepspeed.initialize`` at stages 1, 2 and 3, in fp32 (against one process
  training the same model with FusedAdam on the concatenated batch, clipping active), bf16 and fp16 (against torch's
  AdamW as the client under the same config), and with ZeRO-Offload (``offload_optimizer: cpu``, where FusedAdam
  steps DeepSpeed's fp32 CPU partitions instead of DeepSpeedCPUAdam); at stage 0 (no ZeRO) in fp32 and fp16 (bf16:
  see CLIENT_CASES).
* FP16_Optimizer around DeepSpeed's ZeRO optimizers at stages 1-3: the same fp16 training with DeepSpeed as it is and
  after FP16_Optimizer patched its overflow check and gradient norm must agree step for step (bit for bit at stages
  1/2; stage 3 sums the norm in float64, ours in float32 per chunk, so its clip coefficient may differ in the last
  bit); before every patched step, the patched functions are compared with DeepSpeed's on the same gradients.
* FusedAdam(step_in_backward=True) as the client optimizer, at stage 0 (fp32, bf16, fp16), 1, 2 (fp16, and offloaded)
  and 3: refused with a ValueError naming step_in_backward and DeepSpeed before anything is updated (at the first
  hook, or at ``deepspeed.initialize`` where DeepSpeed steps the optimizer once there), with the params, the tensors
  the optimizer steps and its state unchanged; FP16_Optimizer around the engine or its optimizer refuses it too,
  patching nothing. Without that check, stage 0 fp32 would update each rank's params with its own unreduced gradient
  in backward, and every other config would silently take a normal step (DeepSpeed re-points param_groups to its fp32
  partitions or copies, so the hooks find nothing to update): no memory saved, no error. A FusedAdam(step_in_backward=True) that DeepSpeed does not hold (with DeepSpeed's WarmupLR, in the
  same processes) still steps in backward, bit for bit as step().

Setup facts (torch 2.4.1, DeepSpeed 0.16.9, CPU accelerator): DeepSpeed refuses fp16 on its CPU accelerator
(``ValueError: Type fp16 is not supported on your device.``) unless ``is_fp16_supported`` answers True, which these
tests force to exercise the fp16 loss-scaling code paths; ``deepspeed_shm_comm`` would be JIT-built (~80 s) unless
marked incompatible; a client optimizer under ZeRO needs ``zero_allow_untested_optimizer``, and under ZeRO-Offload
also ``zero_force_ds_cpu_optimizer: false``.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch_scenarios as against_torch
from distributed_harness import run_ranks
from torch_scenarios import full_params

try:
    import deepspeed  # noqa: F401

    DEEPSPEED_ERROR = None
except Exception as exc:  # not installed (the torch 2.13 env), or a missing dependency of it
    DEEPSPEED_ERROR = f"{type(exc).__name__}: {exc}"

pytestmark = [pytest.mark.distributed, pytest.mark.skipif(
    DEEPSPEED_ERROR is not None, reason=f"DeepSpeed is not importable here ({DEEPSPEED_ERROR})"
)]

WORLD = 2
MICRO_BATCH = 4
STEPS = 7
OVERFLOW_STEPS = (2, 3, 6)  # rank 0 only; hysteresis 2 absorbs 2 and 6, backs off at 3
CLIENT_STEPS = 5
LR, WD, CLIP = 1e-2, 1e-2, 0.5

# (stage, precision, offload) run with FusedAdam as the client optimizer
# Stage 0 bf16 (DeepSpeed's BF16_Optimizer) is left out: it fails inside DeepSpeed on this CPU accelerator whatever the
# client (torch.optim.AdamW too): its all_gather_into_tensor over gloo raises "A view was created in no_grad mode and is
# being modified inplace with grad mode enabled" at the first engine.step() (DeepSpeed 0.16.9, torch 2.4.1).
CLIENT_CASES = [(0, "fp32", False), (0, "fp16", False)] + [
    (stage, precision, False) for stage in (1, 2, 3) for precision in ("fp32", "bf16", "fp16")] + [
    (2, "fp32", True), (3, "fp32", True), (3, "bf16", True)]
# The optimizer DeepSpeed's engine wraps the client in at stage 0 (no ZeRO): none in fp32; fp16 keeps fp32 copies in
# DeepSpeed's FP16_UnfusedOptimizer (its fused FP16_Optimizer is for its own FusedAdam).
WRAPPERS = {(0, "fp32"): "FusedAdam", (0, "fp16"): "FP16_UnfusedOptimizer"}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def ds_config(stage: int, precision: str = "fp16", offload: bool = False, clip: float = CLIP) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 1e5, "allgather_bucket_size": 1e5},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": clip,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if stage == 3:  # every param partitioned, however small
        config["zero_optimization"].update(stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=1e5)
    if precision == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2, "hysteresis": 2,
                          "min_loss_scale": 1}
    elif precision == "bf16":
        config["bf16"] = {"enabled": True}
    if offload:
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        config["zero_force_ds_cpu_optimizer"] = False
    return config


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(MICRO_BATCH, 8, generator=g), torch.randn(MICRO_BATCH, 4, generator=g)


def make_client(kind: str, params):
    from ort_optim import AdamWMode, FusedAdam

    if kind == "FusedAdam":
        return FusedAdam(params, lr=LR, adam_w_mode=AdamWMode.ADAMW_TORCH, eps=1e-8, weight_decay=WD)
    return torch.optim.AdamW(params, lr=LR, eps=1e-8, weight_decay=WD)


def fp32_partitions(opt) -> list[torch.Tensor]:
    """The fp32 tensors the client optimizer steps: ZeRO's flat partitions, the fp32 copies of DeepSpeed's stage-0
    bf16/fp16 optimizers, or (stage 0 fp32, no wrapper) the params themselves."""
    for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat", "fp32_groups_flat_partition",
                 "fp32_groups_flat", "fp32_groups"):
        flat = getattr(opt, name, None)
        if flat:
            break
    else:
        flat = [p for group in opt.param_groups for p in group["params"]]
    flat = [t for item in flat for t in (item if isinstance(item, (list, tuple)) else [item])]
    return [t.detach().float().clone() for t in flat]


# ---- scenarios (run inside the worker processes) --------------------------------------------------------------------


def _client_run(rank: int, stage: int, precision: str, offload: bool, kind: str) -> dict:
    import deepspeed

    model = make_model()
    engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=make_client(kind, model.parameters()),
                                             config=ds_config(stage, precision, offload))
    losses = []
    for step in range(CLIENT_STEPS):
        x, y = batch(step, rank)
        loss = torch.nn.functional.mse_loss(engine(x.to(DTYPES[precision])).float(), y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    return {"zero": type(opt).__name__, "basic": type(getattr(opt, "optimizer", opt)).__name__, "losses": losses,
            "params": full_params(engine, stage), "fp32": fp32_partitions(opt)}


def _compare_functions(opt, rank: int, stage: int) -> list[str]:
    """Patched vs DeepSpeed's own functions on the gradients present now; returns descriptions of mismatches."""
    cls = type(opt)
    bad = []

    def same(got, want, what):
        if isinstance(got, bool) or isinstance(want, bool):
            ok = got == want
        elif stage == 3:  # float64 sums in DeepSpeed, float32 per chunk in ours: equal within float32 rounding
            ok = got.dtype == want.dtype and got.shape == want.shape and torch.allclose(got, want, rtol=1e-6, atol=0)
        else:
            ok = got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
        if not ok:
            bad.append(f"{what}: {got!r} vs {want!r}")

    if stage < 3:
        same(opt.has_overflow_partitioned_grads_serial(), cls.has_overflow_partitioned_grads_serial(opt),
             "has_overflow_partitioned_grads_serial")
        groups = [(opt.averaged_gradients[i], opt.params_in_partition[i]) for i in range(len(opt.bit16_groups))]
    else:
        # (a dict at stage 3, filled by the backward pass)
        groups = [(opt.averaged_gradients[i], opt.fp16_groups[i]) for i in range(len(opt.fp16_groups))
                  if opt.averaged_gradients.get(i)]
    for i, (grads, params) in enumerate(groups):
        for norm_type in (2, 2.0, float("inf")):
            same(opt.get_grad_norm_direct(grads, params, norm_type), cls.get_grad_norm_direct(opt, grads, params,
                                                                                              norm_type),
                 f"get_grad_norm_direct(group {i}, {norm_type})")
    # crafted gradients: finite, inf, NaN (on one rank: the norm is all-reduced, so both see it)
    g = torch.Generator().manual_seed(7)
    for poison in (None, float("inf"), float("nan")):
        tensors = [torch.randn(s, generator=g).half() * 100 for s in ((33, 7), (5,), (1000,))]
        if poison is not None and rank == 1:
            tensors[2][17] = poison
        holders = [torch.zeros(t.shape, dtype=torch.float16) for t in tensors]
        for h, t in zip(holders, tensors):
            h.grad = t
        same(opt.has_overflow_serial(holders), cls.has_overflow_serial(opt, holders), f"has_overflow_serial({poison})")
        same(opt.get_grad_norm_direct(tensors, holders), cls.get_grad_norm_direct(opt, tensors, holders),
             f"get_grad_norm_direct(crafted, {poison})")
    # finite fp32 gradients whose squares overflow float32 (norm 3e20): stage 3 sums in float64 and clips with that
    # norm; stages 1 and 2 round the sum to float32 and report -1, both DeepSpeed's and ours
    tensors = [torch.full((10,), 1e20), torch.ones(3)]
    holders = [torch.zeros(t.shape) for t in tensors]
    same(opt.get_grad_norm_direct(tensors, holders), cls.get_grad_norm_direct(opt, tensors, holders),
         "get_grad_norm_direct(norm beyond float32)")
    return bad


def _fp16_optimizer_run(rank: int, stage: int, wrap) -> dict:
    import deepspeed

    from ort_optim.fp16_optimizer import FP16_Optimizer

    model = make_model()
    engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=LR),
                                             config=ds_config(stage))
    mismatches = []
    if wrap == "optimizer":
        assert FP16_Optimizer(opt) is opt
    elif wrap == "engine":
        assert FP16_Optimizer(engine) is engine
    if wrap:
        assert FP16_Optimizer(opt) is opt  # idempotent
        assert "get_grad_norm_direct" in vars(opt)
    record = []
    for step in range(STEPS):
        x, y = batch(step, rank)
        x = x.half()
        if rank == 0 and step in OVERFLOW_STEPS:
            x[0, 0] = float("inf")
        loss = torch.nn.functional.mse_loss(engine(x).float(), y)
        engine.backward(loss)
        if wrap:
            mismatches += [f"step {step}: {m}" for m in _compare_functions(opt, rank, stage)]
        engine.step()
        record.append({"loss": loss.detach().clone(), "overflow": bool(opt.overflow), "scale": float(opt.loss_scale),
                       "fp32": fp32_partitions(opt), "params": full_params(engine, stage)})
    return {"record": record, "mismatches": mismatches, "patched": "get_grad_norm_direct" in vars(opt)}


# FusedAdam(step_in_backward=True) as the client optimizer: (stage, precision, offload) -> where it is refused. Each
# stage and each precision once (each costs an engine; ZeRO 1 bf16, 2 fp32 and 3 bf16 behaved the same when tried).
# DeepSpeed's FP16_UnfusedOptimizer (stage 0 fp16) calls the client's step() once in its constructor (to create the
# state), which refuses it there.
IN_BACKWARD_CASES = {
    (0, "fp32", False): "backward",  # the engine all-reduces the gradients after backward
    (0, "bf16", False): "backward",  # BF16_Optimizer (its own step fails on gloo here, also with torch's AdamW); see
    # IN_BACKWARD_BY_HOLDER
    (0, "fp16", False): "initialize",
    (1, "fp32", False): "backward",
    (2, "fp16", False): "backward",
    (2, "fp32", True): "backward",
    (3, "fp32", False): "backward",
}
# Where the refusal comes by the DeepSpeed optimizer that holds the client, where DeepSpeed releases differ: DeepSpeed
# 0.19.8 holds a bf16 client at stage 0 in its FP16_UnfusedOptimizer (0.16.9: BF16_Optimizer), which is refused when
# it wraps the client, as for fp16.
IN_BACKWARD_BY_HOLDER = {"FP16_UnfusedOptimizer": "initialize"}


def _steps_in_backward_run(rank: int, stage: int, precision: str, offload: bool) -> dict:
    """The first iteration with FusedAdam(step_in_backward=True) as the client: where it raises, what it says, and
    the model's params and the tensors the optimizer steps (DeepSpeed's fp32 partitions or copies, or the params)
    before and after."""
    import deepspeed

    from ort_optim import AdamWMode, FusedAdam
    from ort_optim.fp16_optimizer import FP16_Optimizer

    model = make_model()
    opt = FusedAdam(model.parameters(), lr=LR, adam_w_mode=AdamWMode.ADAMW_TORCH, eps=1e-8, weight_decay=WD,
                    step_in_backward=True)

    def stepped() -> list[torch.Tensor]:  # (stage 3 puts its fp32 partitions into param_groups only while stepping)
        tensors = [p for group in opt.param_groups for p in group["params"]]
        return [p.detach().clone() for p in tensors] if tensors else fp32_partitions(ds_opt)

    try:
        engine, ds_opt, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config(stage, precision,
                                                                                                  offload))
    except ValueError as exc:
        return {"where": "initialize", "error": str(exc), "state": len(opt.state),
                "params": [p.detach().float().clone() for p in model.parameters()]}
    before = {"params": full_params(engine, stage), "stepped": stepped()}
    fp16_refusals = []
    for target in (ds_opt, engine):
        try:
            FP16_Optimizer(target)
            fp16_refusals.append(None)
        except ValueError as exc:
            fp16_refusals.append(str(exc))
    patched = [name for name in ("get_grad_norm_direct", "has_overflow_serial") if name in vars(ds_opt)]
    x, y = batch(0, rank)
    loss = torch.nn.functional.mse_loss(engine(x.to(DTYPES[precision])).float(), y)
    where, error = None, None
    try:
        engine.backward(loss)
    except ValueError as exc:
        where, error = "backward", str(exc)
    return {"where": where, "error": error, "state": len(opt.state), "before": before, "fp16_refusals": fp16_refusals,
            "patched": patched, "after": {"params": full_params(engine, stage), "stepped": stepped()}}


def _not_held_by_deepspeed_run() -> dict:
    """FusedAdam with DeepSpeed's WarmupLR but no engine, in a process where DeepSpeed is imported and
    torch.distributed initialised: nothing refuses it, in backward it steps as step() does, and DeepSpeed's holder
    is looked up once."""
    from deepspeed.runtime.lr_schedules import WarmupLR

    from ort_optim import FusedAdam
    from ort_optim.integrations import deepspeed as _deepspeed

    out = {"holder lookups": {}}
    look_up = _deepspeed.holder_of
    for step_in_backward in (False, True):
        lookups = []
        _deepspeed.holder_of = lambda obj: lookups.append(obj) or look_up(obj)
        model = make_model()
        opt = FusedAdam(model.parameters(), lr=LR, weight_decay=WD, step_in_backward=step_in_backward)
        scheduler = WarmupLR(opt, warmup_max_lr=LR, warmup_num_steps=3)
        for step in range(4):
            x, y = batch(step, 0)
            torch.nn.functional.mse_loss(model(x), y).backward()
            if step_in_backward:
                assert all(p.grad is None for p in model.parameters())  # updated in backward
            opt.step()
            opt.zero_grad()
            scheduler.step()
        _deepspeed.holder_of = look_up
        out[step_in_backward] = [p.detach().clone() for p in model.parameters()]
        out["holder lookups"][step_in_backward] = len(lookups)
    return out


def scenarios(rank: int, world: int, tmp_dir: str) -> dict:
    import deepspeed
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # else a ~80 s JIT build per process
    accelerator = get_accelerator()
    fp16_supported = accelerator.is_fp16_supported()
    accelerator.is_fp16_supported = lambda: True  # the CPU accelerator refuses fp16 otherwise (see the docstring)
    deepspeed.init_distributed(dist_backend="gloo")  # joins the process group the harness created
    out = {"fp16_supported": fp16_supported}
    for stage, precision, offload in CLIENT_CASES:
        kinds = ("FusedAdam",) if precision == "fp32" else ("FusedAdam", "AdamW")
        for kind in kinds:
            out[("client", stage, precision, offload, kind)] = _client_run(rank, stage, precision, offload, kind)
    for stage, wrap in ((1, "optimizer"), (2, "engine"), (3, "optimizer")):
        out[("fp16", stage, "plain")] = _fp16_optimizer_run(rank, stage, None)
        out[("fp16", stage, "patched")] = _fp16_optimizer_run(rank, stage, wrap)
    # (last: these leave an engine in the middle of a backward)
    out["not held"] = _not_held_by_deepspeed_run()
    for stage, precision, offload in IN_BACKWARD_CASES:
        out[("in backward", stage, precision, offload)] = _steps_in_backward_run(rank, stage, precision, offload)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(scenarios, WORLD, tmp_path_factory.mktemp("deepspeed"))


# ---- FusedAdam as DeepSpeed's client optimizer ------------------------------------------------------------------------


def one_process_reference() -> tuple[list[float], list[torch.Tensor]]:
    """FusedAdam on one process, the two ranks' micro-batches concatenated (DeepSpeed averages the ranks'
    gradients, which equals the gradient of the mean loss over the whole batch), clipping like DeepSpeed."""
    from ort_optim import AdamWMode, FusedAdam

    model = make_model()
    opt = FusedAdam(model.parameters(), lr=LR, adam_w_mode=AdamWMode.ADAMW_TORCH, eps=1e-8, weight_decay=WD,
                    max_grad_norm=CLIP)
    losses = []
    for step in range(CLIENT_STEPS):
        pieces = [batch(step, rank) for rank in range(WORLD)]
        x, y = torch.cat([p[0] for p in pieces]), torch.cat([p[1] for p in pieces])
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses, [p.detach().clone() for p in model.parameters()]


# fp32: the ranks' gradients are averaged by an all-reduce instead of one batch's sum: float32 rounding in another
# order, carried through 5 clipped Adam steps (measured below 1e-6).
FP32_TOLERANCE = 5e-6
# bf16/fp16: FusedAdam vs torch's AdamW on the same fp32 partitions (the same formula, rounded in another order):
# within float32 rounding of the masters, at most one bf16/fp16 ulp apart in the params.
PARTITION_TOLERANCE = 1e-5


@pytest.mark.parametrize("stage,precision,offload", [c for c in CLIENT_CASES if c[1] == "fp32"])
def test_fused_adam_as_deepspeed_client_fp32_equals_one_process(results, stage, precision, offload):
    ref_losses, ref_params = one_process_reference()
    ranks = [r[("client", stage, precision, offload, "FusedAdam")] for r in results]
    assert ranks[0]["basic"] == "FusedAdam"
    assert ranks[0]["zero"] == WRAPPERS.get((stage, precision),
                                            "DeepSpeedZeroOptimizer_Stage3" if stage == 3 else "DeepSpeedZeroOptimizer")
    for a, b in zip(ranks[0]["params"], ranks[1]["params"]):
        assert torch.equal(a, b)  # the ranks agree exactly
    mean_losses = [(a + b) / 2 for a, b in zip(ranks[0]["losses"], ranks[1]["losses"])]
    assert mean_losses == pytest.approx(ref_losses, rel=1e-5)
    diff = max(float((got - want).abs().max()) for got, want in zip(ranks[0]["params"], ref_params))
    assert diff <= FP32_TOLERANCE, diff
    assert not torch.equal(ranks[0]["params"][0], make_model()[0].weight.detach())  # it trained


@pytest.mark.parametrize("stage,precision,offload", [c for c in CLIENT_CASES if c[1] != "fp32"])
def test_fused_adam_as_deepspeed_client_low_precision_equals_torch_adamw(results, stage, precision, offload):
    for rank, out in enumerate(results):
        fused = out[("client", stage, precision, offload, "FusedAdam")]
        torch_ = out[("client", stage, precision, offload, "AdamW")]
        assert fused["basic"] == "FusedAdam"
        assert fused["zero"] == WRAPPERS.get((stage, precision), fused["zero"])
        diff = max(float((a - b).abs().max()) for a, b in zip(fused["fp32"], torch_["fp32"]))
        assert diff <= PARTITION_TOLERANCE, (rank, diff)
        ulp = torch.finfo(DTYPES[precision]).eps
        for a, b in zip(fused["params"], torch_["params"]):
            assert torch.allclose(a, b, rtol=ulp, atol=ulp), (rank, float((a - b).abs().max()))
        assert fused["losses"] == pytest.approx(torch_["losses"], rel=1e-3)


# ---- FP16_Optimizer around DeepSpeed's ZeRO optimizers --------------------------------------------------------------


def test_deepspeed_cpu_accelerator_refuses_fp16_by_itself(results):
    # the reason the fp16 runs above override is_fp16_supported; the guide states it. DeepSpeed's CPU accelerator
    # reports fp16 support when oneDNN has fp16 kernels for this CPU (torch.ops.mkldnn._is_mkldnn_fp16_supported(),
    # true on CPUs with AVX512-FP16 or AMX-FP16): there the override changes nothing and the refusal cannot be seen.
    mkldnn_fp16 = getattr(torch.ops.mkldnn, "_is_mkldnn_fp16_supported", None)
    if mkldnn_fp16 is not None and mkldnn_fp16():
        pytest.skip("this CPU has oneDNN fp16 kernels: DeepSpeed's CPU accelerator supports fp16 here")
    assert not results[0]["fp16_supported"]


def deepspeed_scales(loss_scaler) -> list[float]:
    """The loss scale after each step of the fp16 runs, from DeepSpeed's own DynamicLossScaler fed their overflow
    flags with their config (ds_config). Its growth rule differs between releases: DeepSpeed 0.16.9 grows after
    loss_scale_window consecutive good steps, as torch's GradScaler does (256, 512, 512, 256, 256, 512, 512 here);
    0.19.8 one good step later (256, 256, 256, 128, 128, 128, 64)."""
    fp16 = ds_config(1)["fp16"]
    scaler = loss_scaler.DynamicLossScaler(init_scale=2.0 ** fp16["initial_scale_power"],
                                           scale_window=fp16["loss_scale_window"], min_scale=fp16["min_loss_scale"],
                                           delayed_shift=fp16["hysteresis"], consecutive_hysteresis=False)
    scales = []
    for step in range(STEPS):
        scaler.update_scale(step in OVERFLOW_STEPS)
        scales.append(float(scaler.cur_scale))
    return scales


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_patched_training_equals_deepspeed_step_for_step(results, stage, deepspeed_loss_scaler):
    scales = deepspeed_scales(deepspeed_loss_scaler)
    assert scales[3] == scales[2] / 2  # (the runs back off: hysteresis 2 absorbs the overflow of step 2, not of 3)
    for rank, out in enumerate(results):
        plain, patched = out[("fp16", stage, "plain")], out[("fp16", stage, "patched")]
        assert patched["patched"] and not plain["patched"]
        plain, patched = plain["record"], patched["record"]
        assert [r["overflow"] for r in plain] == [s in OVERFLOW_STEPS for s in range(STEPS)]
        assert [r["scale"] for r in plain] == scales
        for step, (a, b) in enumerate(zip(plain, patched)):
            where = f"rank {rank} step {step}"
            assert (a["overflow"], a["scale"]) == (b["overflow"], b["scale"]), where
            assert torch.equal(a["loss"].nan_to_num(), b["loss"].nan_to_num()), where
            for x, y in zip(a["fp32"] + a["params"], b["fp32"] + b["params"]):
                if stage < 3:
                    assert torch.equal(x, y), where
                else:  # the clip coefficient from a float32 vs float64 sum: equal within float32 rounding
                    assert torch.allclose(x, y, rtol=0, atol=1e-6), (where, float((x - y).abs().max()))
        assert not torch.equal(plain[0]["params"][0], plain[-1]["params"][0])  # it did train


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_patched_functions_equal_deepspeeds_on_the_same_gradients(results, stage):
    for rank, out in enumerate(results):
        assert out[("fp16", stage, "patched")]["mismatches"] == [], f"rank {rank}"


# ---- FusedAdam(step_in_backward=True) under DeepSpeed: refused before any update ----------------------------------


@pytest.mark.parametrize("stage,precision,offload", IN_BACKWARD_CASES)
def test_step_in_backward_client_is_refused_before_any_update(results, stage, precision, offload):
    for rank, out in enumerate(results):
        got = out[("in backward", stage, precision, offload)]
        holder = re.search(r"held by DeepSpeed's (\w+)", got["error"] or "")
        where = IN_BACKWARD_BY_HOLDER.get(holder and holder.group(1), IN_BACKWARD_CASES[(stage, precision, offload)])
        assert got["where"] == where, (rank, got["error"])
        assert "FusedAdam(step_in_backward=True) is held by DeepSpeed's" in got["error"]
        assert "Nothing was updated. Use step_in_backward=False with DeepSpeed" in got["error"]
        assert got["state"] == 0  # no state created, no step taken
        if got["where"] == "initialize":  # the model as built (DeepSpeed only cast it to fp16)
            want = [p.detach().to(DTYPES[precision]).float() for p in make_model().parameters()]
            assert all(torch.equal(a, b) for a, b in zip(got["params"], want))
            continue
        for key in ("params", "stepped"):  # the model and the tensors the optimizer steps, bit for bit unchanged
            assert len(got["before"][key]) == len(got["after"][key]) > 0
            assert all(torch.equal(a, b) for a, b in zip(got["before"][key], got["after"][key])), (rank, key)
        # FP16_Optimizer around the DeepSpeed optimizer and around the engine: refused, nothing patched
        refusals = got["fp16_refusals"]
        assert all(r is not None and "has step_in_backward=True" in r for r in refusals), refusals
        assert got["patched"] == []


def test_step_in_backward_not_held_by_deepspeed_still_steps_in_backward_bit_for_bit(results):
    for out in results:
        stepped, in_backward = out["not held"][False], out["not held"][True]
        assert all(torch.equal(a, b) for a, b in zip(stepped, in_backward))
        assert not torch.equal(stepped[0], make_model()[0].weight.detach())  # it trained
        # DeepSpeed's holder is looked for once, at the first hook: never per step, never without step_in_backward
        assert out["not held"]["holder lookups"] == {False: 0, True: 1}


# ---- against torch.optim.AdamW as the client under the same config ---------------------------------------------------


@pytest.fixture(scope="module")
def torch_results(tmp_path_factory):
    """torch_scenarios on 2 ranks, against torch.optim.AdamW in the same engine (one spawn per session)."""
    return against_torch.results(tmp_path_factory)


@against_torch.needs_deepspeed
@pytest.mark.parametrize("stage", against_torch.DS_STAGES)
def test_fused_adam_as_deepspeed_client_equals_torch_adamw_with_accumulation_and_clipping(torch_results, stage):
    for r in torch_results:
        want = r[("deepspeed", stage, "torch")]
        assert want["error"] is None
        for kind in ("fused", "fused-pipeline-group"):
            got = r[("deepspeed", stage, kind)]
            assert got["error"] is None, got["error"]
            diff = against_torch.max_diff(got["params"], want["params"])
            assert diff <= 1e-6, (r["rank"], kind, diff)  # fp32: the update's float32 operation order, the norm's


@against_torch.needs_deepspeed
@pytest.mark.parametrize("stage", against_torch.DS_STAGES)
def test_max_grad_norm_on_deepspeed_partitions_is_refused_before_anything_changes(torch_results, stage):
    """Regression: FusedAdam(max_grad_norm) as a ZeRO client clipped each rank by the norm of its own partition of
    the gradients (5e-3 away from DeepSpeed's gradient_clipping after 5 steps on 2 ranks)."""
    for r, kind in ((r, kind) for r in torch_results for kind in ("fused-refused", "fused-process-group-refused")):
        got = r[("deepspeed", stage, kind)]
        assert got["error"] is not None and "partition" in got["error"], got["error"]
        assert "gradient_clipping" in got["error"] and "pipeline_group" in got["error"], got["error"]
        assert got["state"] == 0
        for a, b in zip(got["params"], got["before"]):
            assert torch.equal(a, b)


@against_torch.needs_deepspeed
@pytest.mark.parametrize("stage", against_torch.DS_STAGES)
def test_max_grad_norm_over_param_groups_zero_steps_apart_is_refused_before_anything_changes(torch_results, stage):
    """ZeRO calls the client's step() once per param group (stage 3: per sub-group), each call seeing that group's
    gradients only, so FusedAdam(max_grad_norm) would clip each group by its own norm, with or without pipeline_group
    and on one rank too. It is refused at the first step, naming DeepSpeed's gradient_clipping, nothing updated."""
    for r in torch_results:
        got = r[("deepspeed", stage, "fused-groups-refused")]
        assert got["error"] is not None and "one param group at a time" in got["error"], got["error"]
        assert "gradient_clipping" in got["error"] and "2 step() calls per step" in got["error"], got["error"]
        assert got["state"] == 0
        for a, b in zip(got["params"], got["before"]):
            assert torch.equal(a, b)
