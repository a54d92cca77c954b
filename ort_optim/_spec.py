"""The numeric specification every backend shares (ops/README.md states the math): one place for its constants.

Backends (``ort_optim/backends/``) import this module and never one another; ops/adam_cpu.cpp mirrors these values
(``kBlock``, ``kFp16Limit``), and the tests check that the native library agrees.
"""

from __future__ import annotations

import enum

import torch

# Elements per quantisation block of scaled fp16 states (one float32 scale each) and per unit of kernel work.
QUANT_BLOCK = 1024
# Scaled fp16 states: each block's absolute maximum is scaled into (FP16_LIMIT / 2, FP16_LIMIT]: half of fp16's range
# stays free as headroom for the next step, and the rule is idempotent (ops/README.md, "fp16 states").
FP16_LIMIT = 32768.0

LOW_PRECISION = (torch.float16, torch.bfloat16)
SUPPORTED_PARAM_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class AdamWMode(enum.IntEnum):
    """Weight-decay variants, with ONNX Runtime's names and values (ops/README.md has the exact math)."""

    ADAM_L2_REGULARIZATION = 0  # g += wd * p before the moments; eps outside the bias-corrected sqrt
    ADAMW_TRANSFORMERS = 1  # HF transformers AdamW: p -= lr * wd * p after the update (ORT's default)
    ADAMW_TORCH = 2  # torch.optim.AdamW: p *= 1 - lr * wd before the update; torch's eps placement


def num_blocks(numel: int) -> int:
    """Quantisation blocks (QUANT_BLOCK elements each, the last one partial) of a tensor with numel elements."""
    return (numel + QUANT_BLOCK - 1) // QUANT_BLOCK
