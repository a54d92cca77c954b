// One Adam step over validated inputs, shared by the adam_step_ op and AdamPlan: the per-step scalars, contiguous
// stand-ins for strided params and gradients, autograd's version counters, then the kernel. Also the adam_step_ op
// itself (adam_step_cpu), which validates its lists and takes this step.
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <vector>

#include "adam_kernel.h"
#include "validation.h"

namespace ort_optim {

struct StepOptions {
  double lr, beta1, beta2, eps, weight_decay;
  int64_t mode;
  bool bias_correction, maximize;
  c10::optional<at::Tensor> lr_tensor, inv_grad_scale, found_inf, grad_scale;
  c10::optional<at::Tensor> rounding_keys;  // stochastic rounding of bfloat16 params (README.md)
  c10::optional<at::Tensor> betas_tensor;   // float64 [2] on the CPU: replaces beta1 and beta2 (README.md)
  c10::optional<at::Tensor> group_hyperparameters;  // float64 [G, 3] on the CPU: every group's (lr, beta1, beta2)
  // Set by AdamPlan::step(grad_norm=true): receives the sum of squares of the gradients the update read, added per
  // work item in item order (deterministic whatever the thread count); NaN when the step was skipped.
  double* grad_square_sum = nullptr;
};

// The state pointers and sizes of every parameter; the param, grad and per-step fields are filled by update().
std::vector<TensorWork> state_work(at::TensorList params, const StateLists& s);

std::vector<WorkItem> work_items(const std::vector<TensorWork>& work);

// ---- autograd's version counters ------------------------------------------------------------------------------

// The kernels write through data pointers, which autograd does not see. A step marks every tensor it wrote as
// modified in place, as torch's own in-place ops do (torch.optim.AdamW's foreach and for-loop steps): it bumps the
// tensor's version counter, so that a backward still needing the old value (a second backward over a retained graph
// that saved a param, a p.detach() saved by a later forward) raises autograd's "modified by an inplace operation"
// error instead of silently computing with the new one. update() marks them once it knows that the step is taken,
// before the kernel runs (a skipped step writes nothing and marks nothing). Tensors without a version counter (made
// under torch.inference_mode()) are skipped, as torch.autograd.graph.increment_version skips them. Views of one
// buffer share one counter (FusedAdam's flat state buffers): consecutive tensors with the same counter are bumped
// once, so a bucket's moments cost one atomic increment, not one per param.
static_assert(sizeof(c10::VariableVersion) == sizeof(void*), "c10::VariableVersion is one intrusive_ptr");

// The counter object a tensor's version counter points to (shared by a view and its base); nullptr without one.
inline const void* counter_of(const c10::TensorImpl* impl) {
  return *reinterpret_cast<const void* const*>(&impl->version_counter());
}

// Brings a tensor's counter into the cache ahead of its bump (with the intent to write it).
inline void prefetch_counter(const c10::TensorImpl* impl) {
  if (const void* counter = counter_of(impl)) __builtin_prefetch(static_cast<const char*>(counter) + 16, 1);
}

class VersionBumps {
 public:
  void add(const at::Tensor& t) { add(t.unsafeGetTensorImpl()); }
  void add(c10::TensorImpl* impl) {
    const void* counter = counter_of(impl);
    if (counter == nullptr || counter == last_) return;  // (an inference tensor; or a view of the last one's base)
    last_ = counter;
    impl->bump_version();
  }
  void add(at::TensorList tensors) {
    for (const at::Tensor& t : tensors) add(t);
  }

 private:
  const void* last_ = nullptr;
};

// Called by update() once the step is known to be taken, with whether it unscales the gradients in place too.
using MarkWritten = std::function<void(bool grads)>;

// The step itself: params[i] and grads[i] are validated, work[i] holds their states. Writes nothing when skipped;
// otherwise calls mark_written first (see "autograd's version counters").
void update(std::vector<TensorWork>& work, const std::vector<WorkItem>& items,
            const std::vector<const at::Tensor*>& params, const std::vector<const at::Tensor*>& grads,
            double* steps, bool is_double, bool amsgrad, const StepOptions& o, const MarkWritten& mark_written);

// The adam_step_ op (schema.cpp) on CPU tensors.
void adam_step_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                   at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs, at::TensorList master_params,
                   at::TensorList exp_avg_scales, at::TensorList exp_avg_sq_scales,
                   at::TensorList max_exp_avg_sq_scales, const at::Tensor& steps, double lr, double beta1,
                   double beta2, double eps, double weight_decay, int64_t mode, bool bias_correction,
                   bool maximize, const c10::optional<at::Tensor>& lr_tensor,
                   const c10::optional<at::Tensor>& inv_grad_scale, const c10::optional<at::Tensor>& found_inf,
                   const c10::optional<at::Tensor>& grad_scale, const c10::optional<at::Tensor>& rounding_keys,
                   const c10::optional<at::Tensor>& betas_tensor,
                   const c10::optional<at::Tensor>& group_hyperparameters);

}  // namespace ort_optim
