"""ort-optim: fused, mixed-precision optimizers and ORTModule configuration for ONNX Runtime training.

Nothing native is loaded at import time: the op library is built/loaded on first use (see ort_optim.backends).
ORTModuleOptions, wrap and FP16_Optimizer are imported on first access, so `python -m ort_optim.options` and
`import ort_optim` stay light.
"""

import importlib

from .backends import native_available
from ._plan import GradientError
from .fused_adam import AdamWMode, FusedAdam, StateNameError

_LAZY = {
    "ORTModuleOptions": "ort_optim.options",
    "OptionsTooLateWarning": "ort_optim.options",
    "ORTFailureWarning": "ort_optim.options",
    "ORTIgnoresWarning": "ort_optim.options",
    "wrap": "ort_optim.options",
    "FP16_Optimizer": "ort_optim.fp16_optimizer",
    "DynamicLossScaler": "ort_optim.loss_scaler",
    "LossScaleUnderflowError": "ort_optim.loss_scaler",
}

__all__ = ["AdamWMode", "FusedAdam", "GradientError", "StateNameError", "native_available", *_LAZY]
__version__ = "0.1.0"


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ort_optim' has no attribute {name!r}")
