// The one place where ort_optim's operator schemas are declared. Backends only register implementations:
// registration.cpp (TORCH_LIBRARY_IMPL for CPU) and ort_optim/backends/__init__.py (CUDA: the Triton kernels,
// registered from Python).
// The math each op performs is specified in ops/README.md. The CPU backend also registers a helper class,
// ort_optim.AdamPlan (adam_plan.h, registered in registration.cpp): adam_step_ over lists kept across steps, not a
// separate schema.
#include <torch/library.h>

TORCH_LIBRARY(ort_optim, m) {
  // One multi-tensor Adam step over n parameters. Optional per-parameter lists are either empty or of length n:
  // max_exp_avg_sqs (amsgrad), master_params (fp32 masters of fp16/bf16 params), and the per-block scales of fp16
  // and low-bit moment states. steps holds each parameter's step count (float64, exact to 2**53) and is advanced by
  // one unless found_inf is non-zero, in which case nothing at all is written. grad_scale: the loss scale the
  // gradients carry; when given, every gradient is written back unscaled, grads[i] / grad_scale (as torch's fused
  // AdamW does), while the update itself uses inv_grad_scale. rounding_keys (int64 [n]) asks for stochastic rounding
  // of bfloat16 params without masters, from a hash of (key, step, element index). betas_tensor (float64 [2] =
  // [beta1, beta2], on the steps' device) replaces beta1 and beta2 when given (bias corrections included), as lr_tensor
  // replaces lr: betas that change at every step without changing a traced graph. group_hyperparameters (float64
  // [G, 3], one row (lr, beta1, beta2) per param group of the optimizer step this call is part of) is checked in full
  // before anything is written: the first call of a traced step passes it, so a bad value in any group refuses the
  // whole step, not the groups after the first.
  m.def(
      "adam_step_(Tensor(a!)[] params, Tensor(j!)[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
      "Tensor(d!)[] max_exp_avg_sqs, Tensor(e!)[] master_params, Tensor(f!)[] exp_avg_scales, "
      "Tensor(g!)[] exp_avg_sq_scales, Tensor(h!)[] max_exp_avg_sq_scales, Tensor(i!) steps, *, "
      "float lr, float beta1, float beta2, float eps, float weight_decay, int adam_w_mode, bool bias_correction, "
      "bool maximize, Tensor? lr_tensor=None, Tensor? inv_grad_scale=None, Tensor? found_inf=None, "
      "Tensor? grad_scale=None, Tensor? rounding_keys=None, Tensor? betas_tensor=None, "
      "Tensor? group_hyperparameters=None) -> ()");
  // One pass over many gradients: returns float32 [2] = [sum of squares, 1.0 if any element is inf/NaN else 0.0].
  // The sum is accumulated in float64 on the CPU, in a fixed order (deterministic for any thread count).
  m.def("grad_stats(Tensor[] tensors) -> Tensor");
}
