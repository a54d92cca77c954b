// Gradient statistics: the grad_stats op (a deterministic float64 sum of squares over many tensors, for the global
// gradient norm and the overflow check), and the loss-scale unscaling, inf/NaN check and global-norm clipping of a
// plan's scaled step, computed on the host from the same sum.
#pragma once

#include <ATen/ATen.h>

#include <vector>

#include "adam_kernel.h"

namespace ort_optim {

struct Scaling {
  c10::optional<double> grad_scale, max_grad_norm;  // inputs (FusedAdam's step(grad_scale=...) and max_grad_norm)
  float norm = 0.0f;  // output: the global L2 norm of the unscaled gradients, before clipping
  bool skip = false;  // output: the step was skipped (inf/NaN gradients, an overflowing unscale, or found_inf)
};

// grad_stats' float32 [sum of squares, 1.0 if not finite] of a float64 total of squares.
at::Tensor stats_tensor(double total);

// grad_stats over validated dense CPU tensors of float dtypes.
at::Tensor grad_stats_of(const std::vector<const at::Tensor*>& tensors);

// Loss-scale unscaling, the inf/NaN check and global-norm clipping of a plan's scaled step, computed on the host from
// the gradients' statistics with no tensor ops. The arithmetic is FusedAdam._scaling's, in float32 and in torch's
// order (max_norm / x is reciprocal(x) * max_norm there), so both paths multiply the gradients by the same bits.

// The multiplier of every gradient (1/grad_scale times the clip coefficient), or nothing when the step must be
// skipped; sets scaling's outputs.
c10::optional<double> scaled_grad_multiplier(Scaling& scaling, const std::vector<TensorWork>& work,
                                             const std::vector<WorkItem>& items, bool found_inf);

// The grad_stats op (schema.cpp) on CPU tensors.
at::Tensor grad_stats_cpu(at::TensorList tensors);

}  // namespace ort_optim
