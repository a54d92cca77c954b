"""guides/examples/distributed.py under torchrun, as the guide launches it: gpt.py's GPT trained by FSDP2 on 2 CPU
ranks with FusedAdam (torch >= 2.6), saved with torch.distributed.checkpoint and resumed in one process; where FSDP2
cannot run (torch 2.4, .venv), the DDP mode instead."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import torch

EXAMPLE = Path(__file__).resolve().parent.parent / "guides" / "examples" / "distributed.py"
FSDP2 = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 6)


def torchrun(tmp_path: Path, nproc: int, *args: str) -> dict:
    out = tmp_path / f"summary-{len(list(tmp_path.glob('summary-*')))}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(EXAMPLE),
           *args, "--json", str(out)]
    proc = subprocess.run(cmd, cwd=tmp_path, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300)
    assert proc.returncode == 0, proc.stdout[-6000:]
    return json.loads(out.read_text())


def test_example_trains_saves_and_resumes_on_another_world_size(tmp_path):
    parallel = ["--parallel", "fsdp2", "--model", "gpt"] if FSDP2 else ["--parallel", "ddp"]
    first = torchrun(tmp_path, 2, *parallel, "--steps", "8", "--save", str(tmp_path / "ckpt"))
    assert first["world"] == 2 and first["finite"]
    assert first["final_loss"] < first["first_loss"]
    resumed = torchrun(tmp_path, 1, *parallel, "--steps", "2", "--load", str(tmp_path / "ckpt"))
    assert resumed["start"] == 8 and resumed["world"] == 1 and math.isfinite(resumed["final_loss"])
    # the optimizer state came back: the resumed loss continues from where training stopped, not from scratch
    assert resumed["first_loss"] < first["first_loss"]
