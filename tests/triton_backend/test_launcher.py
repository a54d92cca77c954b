"""The launch path of compiled Triton kernels (ort_optim.backends.triton._Launcher): a kept compiled kernel called
directly gets exactly the arguments that JITFunction.run gives it, and a new specialisation goes through
JITFunction.run. Checked without a GPU: in a subprocess (compiled kernels, no interpreter) with a driver that
compiles for sm_90 with Triton's own ptxas and records the launches instead of making them."""

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent('''
    import torch, triton
    from triton.runtime.driver import driver
    from triton.backends.compiler import GPUTarget
    from triton.compiler import compiler

    launches = []

    class RecordingDriver:  # the current device and stream of a GPU, its target; launches are recorded
        def get_current_device(self): return 0
        def get_current_stream(self, device=None): return 1234
        def get_current_target(self): return GPUTarget("cuda", 90, 32)
        def is_active(self): return True

    def init_handles(self):  # instead of loading the binary on a GPU
        if self.module is None:
            self.module, self.function, self._run = "module", 5678, lambda *a: launches.append(a)

    driver.set_active(RecordingDriver())
    compiler.CompiledKernel._init_handles = init_handles
    from ort_optim.backends import triton as tb
    k = tb.kernels()
    assert tb._fast_launch_supported()
    tb._Launcher(k.adam_kernel)  # (its constexprs follow the other arguments)

    steps = torch.zeros(4, dtype=torch.float64)
    partial = torch.zeros(9, dtype=torch.float64)
    stats = torch.zeros(2, dtype=torch.float32)
    flags = dict(HAS_FOUND_INF=True, HAS_NORM=True, BLOCK=1024, num_warps=8)

    def launch(steps_arg, n):
        tb._launch(k.step_finish_kernel, (1,), (steps_arg, steps_arg, n, partial, 8, stats), flags)

    launch(steps, 3)        # compiles through JITFunction.run, which launches
    launch(steps, 3)        # the kept kernel, called directly
    launch(steps, 2**40)    # n as int64: another specialisation, through JITFunction.run
    unaligned = steps[1:]
    launch(unaligned, 3)    # an address 8 bytes past 16-byte alignment: another one
    launch(unaligned, 3)
    jit, direct, jit_wide, jit_unaligned, direct_unaligned = launches
    same = lambda a, b: len(a) == len(b) and all(x is y for x, y in zip(a[:6] + a[9:], b[:6] + b[9:]))
    assert same(jit, direct), (jit, direct)
    assert same(jit_unaligned, direct_unaligned)
    assert direct[6:9] == (None, None, None)  # no launch hooks: no launch metadata either
    assert jit[:5] == (1, 1, 1, 1234, 5678) and jit[14:] == (stats, True, True, 1024)
    assert jit_wide[11] == 2**40
    launcher = tb._launchers[k.step_finish_kernel]
    assert len(launcher.compiled) == 3 and len({id(b) for b in launcher.compiled.values()}) == 3
    print("ok")
''')


def _ptxas_present() -> bool:
    """Without importing triton in this process: test_triton.py, collected after this module, selects Triton's
    interpreter before its first import."""
    spec = importlib.util.find_spec("triton")
    return spec is not None and spec.origin is not None and (
        Path(spec.origin).parent / "backends" / "nvidia" / "bin" / "ptxas").exists()


@pytest.mark.skipif(not _ptxas_present(), reason="needs triton with its bundled ptxas")
def test_a_kept_compiled_kernel_gets_what_jitfunction_run_gives_it(tmp_path):
    from importlib.metadata import version

    if not version("triton").startswith("3.6."):
        pytest.skip(f"the direct launch path is used with triton 3.6 only (here {version('triton')})")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "ORT_OPTIM_TRITON_FAST_LAUNCH")}
    env.update(PYTHONPATH=str(ROOT), TRITON_CACHE_DIR=str(tmp_path / "cache"), ORT_OPTIM_TRITON_FAST_LAUNCH="1")
    result = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stdout[-3000:] + result.stderr[-3000:]


def test_the_gpu_check_passes_its_correctness_checks_in_a_dry_run(tmp_path):
    """tools/gpu_check.py, the one script a lent GPU runs, goes through its checks on CPU tensors in Triton's
    interpreter: a check it could not even set up (a moment combination the optimizer no longer offers, say) fails
    here, not on the GPU."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("needs triton")
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check.py"), "--out", str(tmp_path), "--dry-run",
                           "--skip-bench", "--skip-pytest"], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={k: v for k, v in os.environ.items() if k != "ORT_OPTIM_BACKEND"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "0 failed" in proc.stdout, proc.stdout[-3000:]
