"""ort-optim: fused, mixed-precision optimizers and ORTModule configuration for ONNX Runtime training.

Nothing native is loaded at import time: the op library is built/loaded on first use (see ort_optim._native).
"""

from ._native import native_available
from .fused_adam import AdamWMode, FusedAdam

__all__ = ["AdamWMode", "FusedAdam", "native_available"]
__version__ = "0.1.0"
