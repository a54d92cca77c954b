#!/usr/bin/env python
"""Compile ort_optim's Triton kernels ahead of time to PTX and cubin for sm_80 and sm_90, without a GPU.

    python tools/aot_compile.py [--quick] [--check] [--out DIR] [--arch 80,90]

It compiles every kernel variant (constexpr combination) the optimizer uses, with the same options as the launches
(num_warps, enable_fp_fusion=False), through ``triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))``:
the API differs between triton 3.0 (signature keyed by argument index, ``constants=``, ``AttrsDescriptor``) and
triton >= 3.2 (keyed by name, ``constexprs=``, attribute dicts), both are handled here. Then it runs ptxas -v on the
PTX for the register/spill report and, with ``--check``, reads the PTX for what the interpreter cannot show:

* no approximate division or square root (``div.approx``/``div.full``/``sqrt.approx``) and no contracted ``fma`` in
  fp32 code (results must round like the CPU kernel's),
* no register spills,
* 16-byte vector loads (``ld.global.v4``) in the aligned fp32 variant (memory-bound kernel: access width matters).

Exit status: 0 ok, 1 a check failed or a compile failed, 3 this triton cannot compile ahead of time (no API, no
ptxas): the reason is the last line printed. TRITON_INTERPRET must not be set (the kernels would be interpreted).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# Kernel variants: (name, kernel, constexprs). The quick set covers each storage path once; --full every combination
# of storage dtypes, modes and amsgrad that FusedAdam can create.
ADAM_COMMON = dict(BIAS_CORRECTION=True, HAS_LR_TENSOR=False, HAS_INV_SCALE=False, HAS_FOUND_INF=False,
                   UNSCALE_GRADS=False, BLOCK=1024, BLOCKS_PER_PROGRAM=1, ALIGNED=True, HAS_SR=False,
                   HAS_BETAS_TENSOR=False)
# Flags of a loss-scaled or clipped step; FusedAdam's plain steps (none of them) sum the gradients' squares (HAS_NORM).
SCALED_STEP_FLAGS = ("HAS_INV_SCALE", "HAS_FOUND_INF", "UNSCALE_GRADS")
F32, F16, BF16, F64, Q8, Q4, FP8_E4M3, FP8_E5M2 = 0, 1, 2, 3, 4, 5, 6, 7
COMBOS = {
    "fp32": (F32, F32, F32, F32, False, False, False),
    "fp32-bf16states": (F32, F32, BF16, BF16, False, False, False),
    "fp32-fp16states": (F32, F32, F16, F16, False, True, True),
    "fp16-master": (F16, F16, F32, F32, True, False, False),
    "bf16-master-fp16m-bf16v": (BF16, BF16, F16, BF16, True, True, False),
    "bf16": (BF16, BF16, BF16, BF16, False, False, False),
    "fp16-master-fp16states": (F16, F16, F16, F16, True, True, True),
    "fp64": (F64, F64, F64, F64, False, False, False),
    "fp32-q8": (F32, F32, Q8, Q8, False, True, True),
    "fp32-q4": (F32, F32, Q4, Q4, False, True, True),
    "bf16-master-q8m-q4v": (BF16, BF16, Q8, Q4, True, True, True),
    "bf16-q4m-q8v": (BF16, BF16, Q4, Q8, False, True, True),
    "fp16-master-q4m-fp16v": (F16, F16, Q4, F16, True, True, True),
    "fp32-fp8": (F32, F32, FP8_E4M3, FP8_E4M3, False, True, True),
    "bf16-master-fp8m-e5m2v": (BF16, BF16, FP8_E4M3, FP8_E5M2, True, True, True),
    "bf16-e5m2m-fp8v": (BF16, BF16, FP8_E5M2, FP8_E4M3, False, True, True),
}


def adam_variant(combo: str, mode: int, amsgrad: bool, **overrides) -> dict:
    p, g, m, v, master, ms, vs = COMBOS[combo]
    c = dict(ADAM_COMMON, P_DT=p, G_DT=g, M_DT=m, V_DT=v, HAS_MASTER=master, M_SCALED=ms, V_SCALED=vs,
             AMSGRAD=amsgrad, MODE=mode)
    c.update(overrides)
    c.setdefault("HAS_NORM", not any(c[flag] for flag in SCALED_STEP_FLAGS))
    return c


def variants(full: bool) -> list:
    out = []
    if full:
        for combo in COMBOS:
            for mode in (0, 1, 2):
                for amsgrad in (False, True):
                    out.append((f"adam-{combo}-mode{mode}{'-ams' if amsgrad else ''}", "adam_kernel",
                                adam_variant(combo, mode, amsgrad)))
            if COMBOS[combo][0] == BF16 and not COMBOS[combo][4]:  # bf16 params without masters: stochastic rounding
                out.append((f"adam-{combo}-mode2-sr", "adam_kernel", adam_variant(combo, 2, False, HAS_SR=True)))
    else:
        out += [
            ("adam-fp32-mode2", "adam_kernel", adam_variant("fp32", 2, False)),
            ("adam-fp32-fp16states-mode1-ams-scaling", "adam_kernel",
             adam_variant("fp32-fp16states", 1, True, HAS_LR_TENSOR=True, HAS_INV_SCALE=True, HAS_FOUND_INF=True,
                          UNSCALE_GRADS=True)),
            ("adam-bf16-master-fp16m-bf16v-mode0", "adam_kernel", adam_variant("bf16-master-fp16m-bf16v", 0, False)),
            ("adam-fp16-master-mode2-ams", "adam_kernel", adam_variant("fp16-master", 2, True)),
            ("adam-bf16-mode1-nobc", "adam_kernel", adam_variant("bf16", 1, False, BIAS_CORRECTION=False)),
            ("adam-fp64-mode2-ams", "adam_kernel", adam_variant("fp64", 2, True)),
            ("adam-fp32-q8-mode2-ams", "adam_kernel", adam_variant("fp32-q8", 2, True)),
            ("adam-bf16-master-q8m-q4v-mode0-unaligned", "adam_kernel",
             adam_variant("bf16-master-q8m-q4v", 0, False, ALIGNED=False, BLOCKS_PER_PROGRAM=2)),
            ("adam-bf16-sr-q4m-q8v-mode2", "adam_kernel", adam_variant("bf16-q4m-q8v", 2, False, HAS_SR=True)),
            # fp8 moments: e4m3 both (the full set has every fp8 combination, masters, e5m2 and rounding too)
            ("adam-fp32-fp8-mode2-ams", "adam_kernel", adam_variant("fp32-fp8", 2, True)),
        ]
    out += [
        ("adam-fp32-mode2-unaligned-4blocks", "adam_kernel",
         adam_variant("fp32", 2, False, ALIGNED=False, BLOCKS_PER_PROGRAM=4)),
        # the raw op without grad_norm (a plain step of FusedAdam always asks for the norm)
        ("adam-fp32-mode2-no-norm", "adam_kernel", adam_variant("fp32", 2, False, HAS_NORM=False)),
        # the step traced by torch.compile: lr and betas from tensors, no norm
        ("adam-fp32-mode2-traced", "adam_kernel",
         adam_variant("fp32", 2, False, HAS_LR_TENSOR=True, HAS_BETAS_TENSOR=True, HAS_NORM=False)),
        ("adam-bf16-master-q8m-q4v-mode0-ams-no-norm", "adam_kernel",
         adam_variant("bf16-master-q8m-q4v", 0, True, HAS_NORM=False)),
        # the loss-scaled step that writes the unscaled gradients back (a correctly rounded division per element)
        ("adam-fp32-mode2-unscale-grads", "adam_kernel",
         adam_variant("fp32", 2, False, HAS_INV_SCALE=True, HAS_FOUND_INF=True, UNSCALE_GRADS=True)),
        ("adam-fp16-master-mode2-unscale-grads", "adam_kernel",
         adam_variant("fp16-master", 2, False, HAS_INV_SCALE=True, HAS_FOUND_INF=True, UNSCALE_GRADS=True)),
        ("adam-bf16-master-fp16m-bf16v-mode1-unscale-grads", "adam_kernel",
         adam_variant("bf16-master-fp16m-bf16v", 1, True, HAS_INV_SCALE=True, HAS_FOUND_INF=True,
                      UNSCALE_GRADS=True)),
        ("adam-bf16-q4m-q8v-mode2-sr-unscale-grads", "adam_kernel",
         adam_variant("bf16-q4m-q8v", 2, False, HAS_INV_SCALE=True, HAS_FOUND_INF=True, UNSCALE_GRADS=True,
                      HAS_SR=True)),
        # what follows the Adam launches: the step counts, and the norm's sum on plain steps
        ("step_finish", "step_finish_kernel", dict(HAS_FOUND_INF=True, HAS_NORM=False, BLOCK=1024)),
        ("step_finish-norm", "step_finish_kernel", dict(HAS_FOUND_INF=False, HAS_NORM=True, BLOCK=1024)),
        ("step_finish-norm-found-inf", "step_finish_kernel", dict(HAS_FOUND_INF=True, HAS_NORM=True, BLOCK=1024)),
    ]
    for name, dt in (("fp32", F32), ("fp16", F16), ("bf16", BF16), ("fp64", F64)):
        out.append((f"grad_stats-{name}", "grad_stats_kernel", dict(DT=dt, BLOCK=1024, BLOCKS_PER_PROGRAM=1,
                                                                    ALIGNED=True)))
    out.append(("grad_stats_finish", "grad_stats_finish_kernel", dict(BLOCK=1024)))
    return out


# Types of the runtime (non-constexpr) arguments, by name.
ARG_TYPES = {
    "meta_ptr": "*i64", "grads_ptr": "*i64", "work_ptr": "*i64", "steps_ptr": "*fp64", "lr_ptr": "*fp32",
    "betas_ptr": "*fp64", "inv_scale_ptr": "*fp32", "found_inf_ptr": "*fp32", "grad_scale_ptr": "*fp32",
    "m_lut_ptr": "*fp32",
    "v_lut_ptr": "*fp32", "keys_ptr": "*i64", "norm_partial_ptr": "*fp64", "norm_partial_base": "i32",
    "lr_bits": "i64", "beta1_bits": "i64",
    "beta2_bits": "i64", "eps_bits": "i64", "wd_bits": "i64", "sign_bits": "i64", "n": "i32",
    "addr_ptr": "*i64", "numel_ptr": "*i64", "partial_ptr": "*fp64", "partial_base": "i32", "out_ptr": "*fp32",
    "parts": "i32", "stats_ptr": "*fp32",
}


def find_ptxas(arch: int) -> str | None:
    """The ptxas that triton compiles for arch with, so that ``-v`` reads PTX of an ISA it knows: a triton with
    ``get_ptxas(arch)`` (3.6, 3.8 and 3.9 here) chooses one per arch through its knobs (TRITON_PTXAS_PATH,
    TRITON_PTXAS_BLACKWELL_PATH; triton 3.9 takes its CUDA 13 build for sm_90 and newer and writes PTX that its
    CUDA 12 ptxas refuses); an older one (3.0) takes TRITON_PTXAS_PATH, then its bundled ptxas, then PATH's."""
    import triton

    try:
        from triton.backends.nvidia.compiler import get_ptxas
    except ImportError:
        get_ptxas = None
    if get_ptxas is not None:
        try:
            return get_ptxas(arch).path
        except RuntimeError:  # (the knob found no such binary)
            return None
    candidates = [os.environ.get("TRITON_PTXAS_PATH"),
                  str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"), shutil.which("ptxas")]
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return None


def make_source(triton, fn, constexprs: dict):
    """An ASTSource for this triton version: pointer args get the divisibility-16 hint the JIT gives torch tensors."""
    from triton.compiler import ASTSource

    names = list(fn.arg_names)
    params = [n for n in names if n not in constexprs]
    missing = [n for n in params if n not in ARG_TYPES]
    if missing:
        raise KeyError(f"no type for arguments {missing} of {fn.__name__}")
    new_api = "constexprs" in ASTSource.__init__.__code__.co_varnames
    if new_api:  # triton >= 3.2: keyed by name, constexprs in the signature
        signature = {n: ("constexpr" if n in constexprs else ARG_TYPES[n]) for n in names}
        attrs = {(names.index(n), ): [["tt.divisibility", 16]] for n in params if ARG_TYPES[n].startswith("*")}
        return ASTSource(fn=fn, signature=signature, constexprs=dict(constexprs), attrs=attrs)
    from triton.compiler import AttrsDescriptor  # triton 3.0/3.1: keyed by index

    signature = {names.index(n): ARG_TYPES[n] for n in params}
    constants = {names.index(n): v for n, v in constexprs.items()}
    divisible = [names.index(n) for n in params if ARG_TYPES[n].startswith("*")]
    return ASTSource(fn=fn, signature=signature, constants=constants,
                     attrs=AttrsDescriptor(divisible_by_16=divisible, equal_to_1=[]))


def spill_limit(constexprs: dict) -> int:
    """Spill bytes a variant may have. ptxas trades a few bytes of spills (held in L1) for occupancy on its own: at
    256 threads a program gets 2 CTAs per SM only at <= 128 registers, and for the quantised-moment variants (the
    levels' lookups and the stochastic rounding's hashes) it picks 128 registers and up to ~100 bytes of spills on
    sm_80 (84 with amsgrad, 4-bit m, 8-bit v) over ~190-210 registers and 1 CTA per SM. The kernel is memory-bound,
    so we keep ptxas's choice (unmeasured on a GPU: ORT_OPTIM_TRITON_MAXNREG=255 gives the other one, for
    tools/gpu_check.py to compare). Anything beyond these limits is a register blow-up worth failing on."""
    quantised = constexprs.get("M_DT") in (Q8, Q4, FP8_E4M3, FP8_E5M2) or constexprs.get("V_DT") in (
        Q8, Q4, FP8_E4M3, FP8_E5M2)
    return 128 if quantised else 64


FORBIDDEN = [
    (re.compile(r"\bdiv\.(approx|full)\.f32"), "approximate fp32 division"),
    (re.compile(r"\bsqrt\.approx\.f32"), "approximate fp32 square root"),
    (re.compile(r"\bfma\.rn\.f32"), "contracted fp32 multiply-add"),
    (re.compile(r"\bfma\.rn\.f64"), "contracted fp64 multiply-add"),
    (re.compile(r"\b(add|sub|mul|div|sqrt)\.[a-z.]*ftz[a-z.]*\.f32"), "flush-to-zero fp32 arithmetic"),
]


def ptx_report(ptx: str) -> dict:
    return {
        "v4_loads": len(re.findall(r"ld\.global(\.[a-z_]+)*\.v4", ptx)),
        "v2_loads": len(re.findall(r"ld\.global(\.[a-z_]+)*\.v2", ptx)),
        "scalar_loads": len(re.findall(r"ld\.global(\.[a-z_]+)*\.(b|u|f|s)(16|32|64)\b", ptx)),
        "v4_stores": len(re.findall(r"st\.global(\.[a-z_]+)*\.v4", ptx)),
        "forbidden": sorted({what for pattern, what in FORBIDDEN if pattern.search(ptx)}),
    }


def run_ptxas(ptxas: str, ptx: str, arch: int, workdir: Path) -> dict:
    src = workdir / "k.ptx"
    src.write_text(ptx)
    target = re.search(r"^\.target\s+(sm_\w+)", ptx, re.M)
    result = subprocess.run([ptxas, f"-arch={target.group(1) if target else f'sm_{arch}'}", "-v", str(src), "-o",
                             str(workdir / "k.cubin")],
                            capture_output=True, text=True)
    text = result.stdout + result.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spills = re.findall(r"(\d+) bytes spill (stores|loads)", text)
    stack = re.search(r"(\d+) bytes stack frame", text)
    return {"registers": int(regs.group(1)) if regs else None,
            "spill_bytes": sum(int(s[0]) for s in spills), "stack_bytes": int(stack.group(1)) if stack else None,
            "ptxas_ok": result.returncode == 0, "ptxas_output": text.strip()[-500:]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one variant per storage path (default: all)")
    parser.add_argument("--check", action="store_true", help="fail on forbidden PTX, spills or missing v4 loads")
    parser.add_argument("--out", type=Path, help="write PTX, cubin and report.json here")
    parser.add_argument("--arch", default="80,90", help="compute capabilities (default 80,90)")
    parser.add_argument("--num-warps", type=int, default=8, help="warps per program (default 8, as the launches)")
    args = parser.parse_args(argv)

    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("TRITON_INTERPRET is set: the kernels would be interpreted; unset it")
        return 1
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource  # noqa: F401
    except ImportError as exc:
        print(f"cannot compile ahead of time: this triton lacks the API ({exc})")
        return 3
    archs = [int(a) for a in args.arch.split(",")]
    ptxas = {arch: find_ptxas(arch) for arch in archs}
    if None in ptxas.values():
        print(f"cannot compile ahead of time: no ptxas for sm_{min(a for a in archs if ptxas[a] is None)} (set "
              "TRITON_PTXAS_PATH)")
        return 3
    from ort_optim.backends import triton_kernels as k

    workdir = args.out or Path(os.environ.get("TMPDIR", "/tmp")) / f"ort_optim_aot_{os.getpid()}"
    workdir.mkdir(parents=True, exist_ok=True)
    report = {"triton": triton.__version__, "ptxas": {f"sm_{arch}": path for arch, path in ptxas.items()},
              "kernels": []}
    failures = []
    print(f"triton {triton.__version__}, ptxas " + ", ".join(f"{path} (sm_{arch})" for arch, path in ptxas.items()))
    print(f"{'variant':48} {'arch':>5} {'sec':>5} {'regs':>5} {'spill':>5} {'v4 ld':>6} {'scalar ld':>9}  notes")
    for name, kernel_name, constexprs in variants(full=not args.quick):
        fn = getattr(k, kernel_name)
        for arch in archs:
            t0 = time.time()
            entry = {"variant": name, "kernel": kernel_name, "arch": arch, "constexprs": constexprs}
            try:
                src = make_source(triton, fn, constexprs)
                compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                                          options={"num_warps": args.num_warps, "enable_fp_fusion": False})
                ptx = compiled.asm["ptx"]
                entry.update(ptx_report(ptx))
                entry.update(run_ptxas(ptxas[arch], ptx, arch, workdir))
                entry["cubin_bytes"] = len(compiled.asm["cubin"])
                if args.out:
                    (args.out / f"{name}.sm{arch}.ptx").write_text(ptx)
                    (args.out / f"{name}.sm{arch}.cubin").write_bytes(compiled.asm["cubin"])
            except Exception as exc:  # report every variant, then fail
                entry["error"] = f"{type(exc).__name__}: {str(exc)[-2000:]}"
            entry["seconds"] = round(time.time() - t0, 2)
            notes = []
            if "error" in entry:
                failures.append(f"{name} sm_{arch}: {entry['error']}")
                notes.append("COMPILE ERROR")
            else:
                if entry["forbidden"]:
                    notes.append("forbidden: " + ", ".join(entry["forbidden"]))
                    failures.append(f"{name} sm_{arch}: {entry['forbidden']}")
                if entry["spill_bytes"]:
                    notes.append(f"spills {entry['spill_bytes']} B")
                    if entry["spill_bytes"] > spill_limit(constexprs):
                        failures.append(f"{name} sm_{arch}: register spills ({entry['spill_bytes']} bytes, "
                                        f"limit {spill_limit(constexprs)})")
                if not entry["ptxas_ok"]:
                    failures.append(f"{name} sm_{arch}: ptxas failed: {entry['ptxas_output']}")
                if name == "adam-fp32-mode2" and entry["v4_loads"] == 0:
                    notes.append("no 16-byte loads")
                    failures.append(f"{name} sm_{arch}: no ld.global.v4 in the aligned fp32 variant")
            report["kernels"].append(entry)
            print(f"{name:48} {arch:>5} {entry['seconds']:>5} {str(entry.get('registers')):>5} "
                  f"{str(entry.get('spill_bytes')):>5} {str(entry.get('v4_loads')):>6} "
                  f"{str(entry.get('scalar_loads')):>9}  {'; '.join(notes)}")
    if args.out:
        (args.out / "report.json").write_text(json.dumps(report, indent=1))
    if failures:
        print("\n".join(["FAILED:"] + failures))
        return 1 if (args.check or any("COMPILE ERROR" in f or "Error" in f for f in failures)) else 0
    print(f"ok: {len(report['kernels'])} compilations")
    return 0


if __name__ == "__main__":
    sys.exit(main())
