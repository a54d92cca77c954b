#!/usr/bin/env python
"""The peak memory of one optimizer load_state_dict, in a fresh process (the table in guides/migration.md).

    python tools/load_peak.py CASE IMPL [NUMEL]

CASE: fp32 (fp32 moments), bf16master (bf16 params with fp32 masters), 8bit, 4bit, fp8 (moments in those formats,
from an fp32-moment checkpoint), torchao8, bnb8 (a torchao / bitsandbytes AdamW8bit checkpoint into 8-bit moments;
their libraries need not be installed for bnb8, torchao for torchao8). IMPL: fused (FusedAdam) or torch
(torch.optim.AdamW; fp32 and bf16master only). NUMEL: the param's elements (50M by default).

Prints the rise of VmHWM over VmRSS across the load (VmHWM reset through /proc/self/clear_refs right before it: the
params and the checkpoint are already resident) and the new state's size, both in MiB. Linux only.
"""

import re
import sys

import torch


def status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        return int(re.search(field + r":\s+(\d+)", f.read()).group(1)) / 1024


def state_mib(opt: torch.optim.Optimizer) -> float:
    seen, total = set(), 0
    for state in opt.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() not in seen:
                seen.add(value.untyped_storage().data_ptr())
                total += value.untyped_storage().nbytes()
    return total / 2**20


def checkpoint(case: str, impl: str, p: torch.Tensor, g: torch.Generator) -> dict:
    shape, n = p.shape, p.numel()
    group = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01, "amsgrad": False, "params": [0]}
    if case == "torchao8":
        from torchao.optim.subclass_8bit import OptimState8bit

        def moment(signed):
            codes = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
            return OptimState8bit(codes, torch.rand(n // 256, generator=g), torch.linspace(-1 if signed else 0, 1, 256),
                                  signed)
        return {"state": {0: {"step": torch.tensor(10.0), "exp_avg": moment(True), "exp_avg_sq": moment(False)}},
                "param_groups": [{**group, "lr": torch.tensor(1e-3)}]}
    if case == "bnb8":
        quant = {}
        for i in (1, 2):
            quant[f"state{i}"] = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
            quant[f"qmap{i}"] = torch.linspace(-1 if i == 1 else 0, 1, 256)
            quant[f"absmax{i}"] = torch.rand(-(-n // 256), generator=g) * 0.1
        del group["amsgrad"]
        return {"state": {0: {"step": 10, "__bnb_optimizer_quant_state__": quant}},
                "param_groups": [{**group, "alpha": 0.0, "t_alpha": None, "t_beta3": None}]}
    state = {"step": torch.tensor(10.0), "exp_avg": torch.randn(shape, generator=g) * 1e-3,
             "exp_avg_sq": torch.rand(shape, generator=g) * 1e-6}
    if case == "bf16master" and impl == "fused":
        state["master_param"] = p.detach().float() + 1e-4
    return {"state": {0: state}, "param_groups": [group]}


def main() -> None:
    case, impl = sys.argv[1], sys.argv[2]
    n = int(sys.argv[3]) if len(sys.argv) > 3 else 50_000_000
    cases = ("fp32", "bf16master", "8bit", "4bit", "fp8", "torchao8", "bnb8")
    if case not in cases or impl not in ("fused", "torch") or (impl == "torch" and case not in cases[:2]):
        sys.exit(f"load_peak.py: CASE {case!r} with IMPL {impl!r} is not measured here: CASE is one of {cases}, IMPL "
                 "fused or torch (torch.optim.AdamW keeps fp32 moments: fp32 and bf16master only)")
    if case == "torchao8":
        n -= n % 256000  # (torchao's blocks of 256 divide the tensor)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16 if case == "bf16master" else torch.float32
    p = torch.nn.Parameter(torch.randn((n // 1000, 1000), generator=g).to(dtype))
    sd = checkpoint(case, impl, p, g)
    if impl == "torch":
        opt = torch.optim.AdamW([p])
    else:
        from ort_optim import FusedAdam
        low_bit = {"8bit": torch.uint8, "4bit": torch.uint4, "fp8": torch.float8_e4m3fn, "torchao8": torch.uint8,
                   "bnb8": torch.uint8}.get(case)
        opt = FusedAdam([p], master_weights=case == "bf16master", exp_avg_dtype=low_bit, exp_avg_sq_dtype=low_bit)
    before = status_mib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    opt.load_state_dict(sd)
    peak, state = status_mib("VmHWM") - before, state_mib(opt)
    print(f"{case} {impl} numel={p.numel()}: peak {peak:.1f} MiB over the resident checkpoint, new state "
          f"{state:.1f} MiB ({peak / state:.2f}x)")


if __name__ == "__main__":
    main()
