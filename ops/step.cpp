// One Adam step over validated inputs, and the adam_step_ op (declarations in step.h).
#include "step.h"

#include <ATen/MemoryOverlap.h>

#include <cmath>
#include <limits>
#include <string>

#include "rounding.h"

namespace ort_optim {

namespace {

// beta^t for a whole t in [0, 2^53] (a bias correction's power): binary exponentiation from t's lowest bit, so that
// every backend forms the same float64 products in the same order (_spec.beta_power; the Triton kernels, which
// cannot call libdevice's pow in Triton's interpreter, and the reference backend): float64 params step to the same
// bits on each. A few float64 ulps from a correctly rounded pow, far below what a float32 step can see.
double beta_power(double beta, double t) {
  double result = 1.0;
  for (uint64_t e = uint64_t(t); e != 0; e >>= 1) {
    if (e & 1) result *= beta;
    beta *= beta;
  }
  return result;
}

}  // namespace

std::vector<TensorWork> state_work(at::TensorList params, const StateLists& s) {
  std::vector<TensorWork> work(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    TensorWork& w = work[i];
    w.exp_avg = s.exp_avgs[i].data_ptr();
    w.exp_avg_sq = s.exp_avg_sqs[i].data_ptr();
    w.max_exp_avg_sq = s.max_exp_avg_sqs.empty() ? nullptr : s.max_exp_avg_sqs[i].data_ptr();
    w.master = s.master_params.empty() ? nullptr : s.master_params[i].data_ptr<float>();
    // (bfloat16 scales of 4-bit states are kept as raw pointers too; LowBit reads them as bfloat16)
    w.exp_avg_scale = s.exp_avg_scales.empty() ? nullptr : static_cast<float*>(s.exp_avg_scales[i].data_ptr());
    w.exp_avg_sq_scale =
        s.exp_avg_sq_scales.empty() ? nullptr : static_cast<float*>(s.exp_avg_sq_scales[i].data_ptr());
    w.max_exp_avg_sq_scale =
        s.max_exp_avg_sq_scales.empty() ? nullptr : static_cast<float*>(s.max_exp_avg_sq_scales[i].data_ptr());
    if (!s.exp_avg_scales.empty()) w.exp_avg_low_bit = low_bit_of(s.exp_avgs[i], s.exp_avg_scales[i]);
    if (!s.exp_avg_sq_scales.empty()) w.exp_avg_sq_low_bit = low_bit_of(s.exp_avg_sqs[i], s.exp_avg_sq_scales[i]);
    // a 4-bit exp_avg is decoded through its exp_avg_sq's codes (ort_optim/_spec.py, EXP_AVG_RELATIVE)
    TORCH_CHECK(!w.exp_avg_low_bit || !w.exp_avg_low_bit->relative || w.exp_avg_sq_low_bit == w.exp_avg_low_bit,
                "ort_optim::adam_step_: exp_avgs[", i, "] holds 4-bit codes, which are coded relative to a 4-bit "
                "exp_avg_sq, but exp_avg_sqs[", i, "] is not 4-bit codes: store both moments as torch.uint4");
    w.exp_avg_fp8 = fp8_of(s.exp_avgs[i].scalar_type());
    w.exp_avg_sq_fp8 = fp8_of(s.exp_avg_sqs[i].scalar_type());
    w.exp_avg_type = s.exp_avgs[i].scalar_type();
    w.exp_avg_sq_type = s.exp_avg_sqs[i].scalar_type();
    w.numel = params[i].numel();
  }
  return work;
}

// betas_tensor's (beta1, beta2), read on the host; a wrong tensor is refused before anything is written.
static void read_betas(const at::Tensor& betas, double& beta1, double& beta2) {
  TORCH_CHECK(betas.scalar_type() == at::kDouble && betas.dim() == 1 && betas.numel() == 2 &&
                  betas.device().is_cpu() && betas.layout() == at::kStrided,
              "ort_optim::adam_step_: betas_tensor must be a float64 tensor of shape [2] (beta1, beta2) on the "
              "steps' device (cpu), got ", betas.scalar_type(), " of shape ", betas.sizes(), " on ", betas.device());
  const double* b = betas.data_ptr<double>();
  const int64_t stride = betas.stride(0);
  beta1 = b[0];
  beta2 = b[stride];
}

// The rules for lr and betas; prefix names the group ("param_groups[k]: ") where the caller knows it.
static void check_hyperparameters(double lr, double beta1, double beta2, const std::string& prefix) {
  TORCH_CHECK_VALUE(std::isfinite(lr) && lr >= 0.0, "ort_optim::adam_step_: ", prefix, "lr must be finite and >= 0, "
                    "got ", lr);
  TORCH_CHECK_VALUE(beta1 >= 0.0 && beta1 < 1.0, "ort_optim::adam_step_: ", prefix, "betas[0] must be in [0, 1), got ",
                    beta1);
  TORCH_CHECK_VALUE(beta2 >= 0.0 && beta2 < 1.0, "ort_optim::adam_step_: ", prefix, "betas[1] must be in [0, 1), got ",
                    beta2);
}

// group_hyperparameters: float64 [G, 3] on the CPU, row k param_groups[k]'s (lr, beta1, beta2), each checked.
static void check_group_hyperparameters(const at::Tensor& t) {
  TORCH_CHECK(t.scalar_type() == at::kDouble && t.dim() == 2 && t.size(1) == 3 && t.device().is_cpu() &&
                  t.layout() == at::kStrided,
              "ort_optim::adam_step_: group_hyperparameters must be a float64 tensor of shape [groups, 3] (lr, "
              "beta1, beta2) on the steps' device (cpu), got ", t.scalar_type(), " of shape ", t.sizes(), " on ",
              t.device());
  const double* v = t.data_ptr<double>();
  for (int64_t k = 0; k < t.size(0); ++k) {
    const double* row = v + k * t.stride(0);
    check_hyperparameters(row[0], row[t.stride(1)], row[2 * t.stride(1)], "param_groups[" + std::to_string(k) + "]: ");
  }
}

void update(std::vector<TensorWork>& work, const std::vector<WorkItem>& items,
            const std::vector<const at::Tensor*>& params, const std::vector<const at::Tensor*>& grads,
            double* steps, bool is_double, bool amsgrad, const StepOptions& o, const MarkWritten& mark_written) {
  TORCH_CHECK(o.mode >= 0 && o.mode <= 2, "ort_optim::adam_step_: adam_w_mode must be 0, 1 or 2, got ", o.mode);
  check_rounding_keys(o.rounding_keys, params, work);
  double beta1 = o.beta1, beta2 = o.beta2;
  if (o.betas_tensor.has_value()) read_betas(*o.betas_tensor, beta1, beta2);
  const double lr = o.lr_tensor.has_value() ? scalar_value(o.lr_tensor, "lr_tensor") : o.lr;
  // The step's own rules for the values it reads (step() checks them first; a step traced by torch.compile with a
  // scheduler's lr or betas as graph inputs reaches here without that check): every group's first, then its own.
  // ValueErrors in Python, as step() raises them.
  if (o.group_hyperparameters.has_value()) check_group_hyperparameters(*o.group_hyperparameters);
  check_hyperparameters(lr, beta1, beta2, "");
  // grad_scale is checked before a skip returns: a zero or NaN scale makes the unscaled norm non-finite, so the
  // skip flag computed from it is set, and the bad scale would pass as an overflow. (0.0 below: none given.)
  const double grad_scale = o.grad_scale.has_value() ? scalar_value(o.grad_scale, "grad_scale") : 0.0;
  TORCH_CHECK_VALUE(!o.grad_scale.has_value() || (std::isfinite(grad_scale) && grad_scale != 0.0),
                    "ort_optim::adam_step_: grad_scale must be finite and non-zero, got ", grad_scale);
  const bool found_inf = o.found_inf.has_value() && scalar_value(o.found_inf, "found_inf") != 0.0;
  if (o.grad_square_sum != nullptr) *o.grad_square_sum = std::numeric_limits<double>::quiet_NaN();
  if (found_inf) return;  // skipped: nothing written
  double grad_mul = o.inv_grad_scale.has_value() ? scalar_value(o.inv_grad_scale, "inv_grad_scale") : 1.0;

  // Non-contiguous params and grads are processed through contiguous copies; params (and grads when they are
  // unscaled in place) are copied back at the end.
  std::vector<std::pair<size_t, at::Tensor>> param_copies, grad_copies;
  double last_t = -1.0, step_size = 0.0, bc2_sqrt = 1.0;
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& p = *params[i];
    const at::Tensor& g = *grads[i];
    TensorWork& w = work[i];
    TORCH_CHECK(grad_scale == 0.0 || !grad_in_param_memory(g, p), "ort_optim::adam_step_: grads[", i, "] shares ",
                "memory with the param itself (p.grad = p.detach(), or a view of it), so a step with grad_scale cannot ",
                "both update the param and leave the unscaled gradient in p.grad: give the gradient its own memory ",
                "(p.grad = p.grad.clone()) or step without grad_scale (a plain step, max_grad_norm and found_inf read ",
                "such a gradient before they write the param)");
    if (p.is_contiguous()) {
      w.param = p.data_ptr();
    } else {
      param_copies.emplace_back(i, p.contiguous());
      w.param = param_copies.back().second.data_ptr();
    }
    if (g.is_contiguous()) {
      w.grad = g.data_ptr();
    } else {
      // (checked here, before anything is written: an expand()ed gradient cannot receive one value per element)
      TORCH_CHECK(grad_scale == 0.0 || at::has_internal_overlap(g) != at::MemOverlap::Yes, "ort_optim::adam_step_: ",
                  "grads[", i, "] overlaps itself (an expand()ed tensor), so it cannot be unscaled in place: give it "
                  "its own memory (grad.contiguous()) or step without grad_scale");
      grad_copies.emplace_back(i, g.contiguous());
      w.grad = grad_copies.back().second.data_ptr();
    }
    w.param_type = p.scalar_type();
    w.grad_type = g.scalar_type();
    const double t = steps[i] + 1.0;
    if (t != last_t) {  // the params of a bucket usually share their step count: two powers per call, not per param
      // (a count written in place is not checked when written: one out of range would make the powers' conversion
      // to an integer undefined)
      TORCH_CHECK_VALUE(steps[i] >= 0.0 && steps[i] <= spec::kMaxStep && steps[i] == std::floor(steps[i]),
                        "ort_optim::adam_step_: steps[", i, "] is ", steps[i], "; a step count is a whole number in ",
                        "[0, 2**53], as a checkpoint's are (was it written in place?)");
      const double bc1 = o.bias_correction ? 1.0 - beta_power(beta1, t) : 1.0;
      const double bc2 = o.bias_correction ? 1.0 - beta_power(beta2, t) : 1.0;
      step_size = o.mode == kAdamWTorch ? lr / bc1 : lr * std::sqrt(bc2) / bc1;
      bc2_sqrt = std::sqrt(bc2);
      last_t = t;
    }
    w.step_size = step_size;
    w.bc2_sqrt = bc2_sqrt;
    w.step = uint32_t(uint64_t(t));
    w.stochastic = o.rounding_keys.has_value();
    if (w.stochastic) {
      w.round_key = splitmix64(uint64_t(o.rounding_keys->data_ptr<int64_t>()[i]) ^ splitmix64(uint64_t(t)));
    }
  }
  if (o.maximize) grad_mul = -grad_mul;
  mark_written(grad_scale != 0.0);
  const Hyper h{lr, beta1, beta2, o.eps, o.weight_decay, grad_mul, o.mode, grad_scale};
  std::vector<double> grad_squares(o.grad_square_sum != nullptr ? items.size() : 0, 0.0);
  double* squares = o.grad_square_sum != nullptr ? grad_squares.data() : nullptr;
  if (is_double) {
    dispatch_adam<double>(work, items, h, amsgrad, squares);
  } else {
    dispatch_adam<float>(work, items, h, amsgrad, squares);
  }
  if (o.grad_square_sum != nullptr) {
    double total = 0.0;
    for (double q : grad_squares) total += q;  // fixed order, as sum_of_squares
    *o.grad_square_sum = total;
  }
  for (const auto& [i, copy] : param_copies) params[i]->copy_(copy);
  if (grad_scale != 0.0) {
    for (const auto& [i, copy] : grad_copies) grads[i]->copy_(copy);
  }
  for (size_t i = 0; i < params.size(); ++i) steps[i] += 1.0;
}

std::vector<WorkItem> work_items(const std::vector<TensorWork>& work) {
  std::vector<int64_t> numels;
  for (const auto& w : work) numels.push_back(w.numel);
  return make_work_items(numels);
}

void adam_step_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                   at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs, at::TensorList master_params,
                   at::TensorList exp_avg_scales, at::TensorList exp_avg_sq_scales,
                   at::TensorList max_exp_avg_sq_scales, const at::Tensor& steps, double lr, double beta1,
                   double beta2, double eps, double weight_decay, int64_t mode, bool bias_correction,
                   bool maximize, const c10::optional<at::Tensor>& lr_tensor,
                   const c10::optional<at::Tensor>& inv_grad_scale, const c10::optional<at::Tensor>& found_inf,
                   const c10::optional<at::Tensor>& grad_scale, const c10::optional<at::Tensor>& rounding_keys,
                   const c10::optional<at::Tensor>& betas_tensor,
                   const c10::optional<at::Tensor>& group_hyperparameters) {
  const StateLists states{exp_avgs,       exp_avg_sqs,       max_exp_avg_sqs,      master_params,
                          exp_avg_scales, exp_avg_sq_scales, max_exp_avg_sq_scales};
  check_list_length(grads, params.size(), "grads", false);
  const bool is_double = check_params_and_states(params, states, steps);
  for (size_t i = 0; i < params.size(); ++i) check_grad(grads[i], params[i], i, is_double);
  std::vector<TensorWork> work = state_work(params, states);
  StepOptions options{lr,       beta1,     beta2,          eps,       weight_decay, mode, bias_correction,
                      maximize, lr_tensor, inv_grad_scale, found_inf, grad_scale, rounding_keys};
  options.betas_tensor = betas_tensor;
  options.group_hyperparameters = group_hyperparameters;
  update(work, work_items(work), pointers(params), pointers(grads), steps.data_ptr<double>(), is_double,
         !max_exp_avg_sqs.empty(), options, [&](bool unscaled_grads) {
           VersionBumps bumps;
           bumps.add(params);
           if (unscaled_grads) bumps.add(grads);
           for (at::TensorList list : {exp_avgs, exp_avg_sqs, max_exp_avg_sqs, master_params, exp_avg_scales,
                                       exp_avg_sq_scales, max_exp_avg_sq_scales}) {
             bumps.add(list);
           }
           bumps.add(steps);
         });
}

}  // namespace ort_optim
