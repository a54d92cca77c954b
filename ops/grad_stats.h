// Gradient statistics: the grad_stats op, a deterministic float64 sum of squares over many tensors, for the global
// gradient norm and the overflow check. The unscaling, clipping and skip decision made from them are one function for
// every backend (ort_optim.backends.scaling), whose multiplier and skip flag the step takes as inv_grad_scale and
// found_inf.
#pragma once

#include <ATen/ATen.h>

#include <vector>

#include "adam_kernel.h"

namespace ort_optim {

// grad_stats' float32 [sum of squares, 1.0 if not finite] of a float64 total of squares.
at::Tensor stats_tensor(double total);

// grad_stats over validated dense CPU tensors of float dtypes.
at::Tensor grad_stats_of(const std::vector<const at::Tensor*>& tensors);

// The grad_stats op (schema.cpp) on CPU tensors.
at::Tensor grad_stats_cpu(at::TensorList tensors);

}  // namespace ort_optim
