"""Triton kernels for CUDA tensors (work in progress in this commit)."""


def register_cuda_kernels() -> None:
    """Registers the CUDA implementations of the ort_optim ops (added with the GPU path)."""
