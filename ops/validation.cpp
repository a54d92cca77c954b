// Validation of adam_step_'s inputs (declarations and the public checks in validation.h).
#include "validation.h"

#include <ATen/MemoryOverlap.h>

#include "fp8.h"

namespace ort_optim {

void check_list_length(const at::TensorList& list, size_t n, const char* name, bool optional) {
  TORCH_CHECK(list.size() == n || (optional && list.empty()), "ort_optim::adam_step_: ", name, " has ",
              list.size(), " tensors but params has ", n, optional ? " (pass n tensors or none)" : "");
}

namespace {

// A storage freed or shrunk in place (untyped_storage().resize_(0), as CPU offload and FSDP do) under a tensor that
// still claims its elements: writing through it would write into freed memory.
void check_storage(const at::Tensor& t, const char* name, size_t i) {
  TORCH_CHECK(!t.has_storage() || t.storage().nbytes() >= bytes_needed(t), "ort_optim::adam_step_: ", name, "[", i,
              "] has a storage of ", t.has_storage() ? t.storage().nbytes() : 0, " bytes but needs ", bytes_needed(t),
              " (was its storage freed or resized in place?)");
}

void check_same_shape(const at::Tensor& t, const at::Tensor& p, const char* name, size_t i) {
  TORCH_CHECK(t.sizes() == p.sizes(), "ort_optim::adam_step_: ", name, "[", i, "] has shape ", t.sizes(),
              " but params[", i, "] has shape ", p.sizes());
  TORCH_CHECK(t.device() == p.device(), "ort_optim::adam_step_: ", name, "[", i, "] is on ", t.device(),
              " but params[", i, "] is on ", p.device());
  check_storage(t, name, i);
}

void check_state(const at::Tensor& t, const at::Tensor& p, const char* name, size_t i, bool is_double) {
  // uint8 (low-bit) codes have their own shape rules, checked with their scales (check_scales)
  if (t.scalar_type() != at::kByte || is_double) {
    check_same_shape(t, p, name, i);
  } else {
    check_storage(t, name, i);
  }
  TORCH_CHECK(t.is_contiguous(), "ort_optim::adam_step_: ", name, "[", i, "] must be contiguous");
  TORCH_CHECK(is_double ? t.scalar_type() == at::kDouble
                        : is_float_storage(t.scalar_type()) || t.scalar_type() == at::kByte || fp8_of(t.scalar_type()),
              "ort_optim::adam_step_: ", name, "[", i, "] has dtype ", t.scalar_type(),
              is_double ? "; float64 params need float64 states"
                        : "; states must be float32, bfloat16, float16, uint8 (low-bit codes) or float8_e4m3fn / "
                          "float8_e5m2 (fp8 codes)");
}

}  // namespace

const LowBit* low_bit_of(const at::Tensor& state, const at::Tensor& scales) {
  if (state.scalar_type() != at::kByte) return nullptr;
  return scales.scalar_type() == at::kBFloat16 ? &q4() : &q8();
}

namespace {

void check_scales(const at::TensorList& scales, const at::TensorList& states, size_t i, const char* name,
                  const at::Tensor& p) {
  const at::Tensor& t = states[i];
  if (scales.empty()) {
    TORCH_CHECK(t.scalar_type() != at::kByte, "ort_optim::adam_step_: the uint8 (low-bit) state scaled by ", name,
                "[", i, "] needs its block scales; ", name, " is empty");
    TORCH_CHECK(!fp8_of(t.scalar_type()), "ort_optim::adam_step_: the ", t.scalar_type(), " (fp8) state scaled by ",
                name, "[", i, "] needs its block scales; ", name, " is empty");
    return;
  }
  const at::Tensor& s = scales[i];
  if (fp8_of(t.scalar_type())) {  // (its shape is the param's: check_state)
    const int64_t blocks = (p.numel() + spec::kFp8Block - 1) / spec::kFp8Block;
    TORCH_CHECK(s.device() == t.device() && s.is_contiguous() && s.scalar_type() == at::kFloat &&
                    s.numel() == blocks,
                "ort_optim::adam_step_: ", name, "[", i, "] must be a contiguous float32 tensor of ", blocks,
                " block scales on the state's device (", t.scalar_type(), " codes, one scale per ", spec::kFp8Block,
                ")");
    check_storage(s, name, i);
    return;
  }
  TORCH_CHECK(t.scalar_type() == at::kHalf || t.scalar_type() == at::kByte, "ort_optim::adam_step_: ", name, "[", i,
              "] is given but the state it scales is ", t.scalar_type(), ", not float16, uint8 or fp8");
  TORCH_CHECK(s.device() == t.device() && s.is_contiguous(), "ort_optim::adam_step_: ", name, "[", i,
              "] must be contiguous, on the state's device");
  check_storage(s, name, i);
  if (t.scalar_type() == at::kHalf) {
    const int64_t blocks = (t.numel() + kBlock - 1) / kBlock;
    TORCH_CHECK(s.scalar_type() == at::kFloat && s.numel() == blocks, "ort_optim::adam_step_: ", name, "[", i,
                "] must be a contiguous float32 tensor of ", blocks, " block scales on the state's device");
    return;
  }
  TORCH_CHECK(s.scalar_type() == at::kFloat || s.scalar_type() == at::kBFloat16, "ort_optim::adam_step_: ", name,
              "[", i, "] has dtype ", s.scalar_type(), "; uint8 states take float32 scales (8-bit codes) or ",
              "bfloat16 scales (4-bit codes, two per byte)");
  const LowBit& f = *low_bit_of(t, s);
  const int64_t n = p.numel(), blocks = (n + f.block - 1) / f.block;
  TORCH_CHECK(s.numel() == blocks, "ort_optim::adam_step_: ", name, "[", i, "] has ", s.numel(), " scales; a ",
              f.bits, "-bit state of ", n, " elements has ", blocks, " blocks of ", f.block);
  if (f.bits == 8) {
    TORCH_CHECK(t.sizes() == p.sizes(), "ort_optim::adam_step_: the 8-bit state scaled by ", name, "[", i,
                "] has shape ", t.sizes(), " but params[", i, "] has shape ", p.sizes());
  } else {
    TORCH_CHECK(t.dim() == 1 && t.numel() == (n + 1) / 2, "ort_optim::adam_step_: the 4-bit state scaled by ", name,
                "[", i, "] must be a flat uint8 tensor of ", (n + 1) / 2, " bytes (two codes each), got shape ",
                t.sizes());
  }
  TORCH_CHECK(t.device() == p.device(), "ort_optim::adam_step_: the state scaled by ", name, "[", i,
              "] is on ", t.device(), " but params[", i, "] is on ", p.device());
}

// Returns whether the param is float64.
bool check_param(const at::Tensor& p, size_t i, bool has_master) {
  const at::ScalarType pt = p.scalar_type();
  TORCH_CHECK(pt == at::kDouble || is_float_storage(pt), "ort_optim::adam_step_: params[", i, "] has dtype ", pt,
              "; supported are float32, float64, float16 and bfloat16");
  TORCH_CHECK(p.layout() == at::kStrided && p.device().is_cpu(), "ort_optim::adam_step_: params[", i,
              "] must be a dense CPU tensor");
  TORCH_CHECK(!has_master || is_low_precision(pt), "ort_optim::adam_step_: master_params given but params[", i,
              "] is ", pt, "; master weights are for float16/bfloat16 params");
  check_storage(p, "params", i);
  TORCH_CHECK(at::has_internal_overlap(p) != at::MemOverlap::Yes, "ort_optim::adam_step_: params[", i,
              "] overlaps itself (an expand()ed tensor), so it cannot hold one updated value per element: give it its "
              "own memory (param.clone())");
  return pt == at::kDouble;
}

}  // namespace

double scalar_value(const c10::optional<at::Tensor>& t, const char* name) {
  TORCH_CHECK(t->numel() == 1, "ort_optim::adam_step_: ", name, " must have exactly one element, got ",
              t->numel());
  return t->item<double>();
}

void check_grad(const at::Tensor& g, const at::Tensor& p, size_t i, bool is_double) {
  TORCH_CHECK(g.layout() == at::kStrided, "ort_optim::adam_step_: grads[", i,
              "] is sparse; Adam needs dense gradients");
  check_same_shape(g, p, "grads", i);
  TORCH_CHECK(is_double ? g.scalar_type() == at::kDouble : is_float_storage(g.scalar_type()),
              "ort_optim::adam_step_: grads[", i, "] has dtype ", g.scalar_type(), " for a ", p.scalar_type(),
              " parameter");
}

bool check_params_and_states(at::TensorList params, const StateLists& s, const at::Tensor& steps) {
  const size_t n = params.size();
  check_list_length(s.exp_avgs, n, "exp_avgs", false);
  check_list_length(s.exp_avg_sqs, n, "exp_avg_sqs", false);
  check_list_length(s.max_exp_avg_sqs, n, "max_exp_avg_sqs", true);
  check_list_length(s.master_params, n, "master_params", true);
  check_list_length(s.exp_avg_scales, n, "exp_avg_scales", true);
  check_list_length(s.exp_avg_sq_scales, n, "exp_avg_sq_scales", true);
  check_list_length(s.max_exp_avg_sq_scales, n, "max_exp_avg_sq_scales", true);
  TORCH_CHECK(s.max_exp_avg_sq_scales.empty() || !s.max_exp_avg_sqs.empty(),
              "ort_optim::adam_step_: max_exp_avg_sq_scales given without max_exp_avg_sqs");
  TORCH_CHECK(steps.scalar_type() == at::kDouble && steps.dim() == 1 && size_t(steps.numel()) == n &&
                  steps.is_contiguous() && steps.device().is_cpu(),
              "ort_optim::adam_step_: steps must be a contiguous float64 CPU tensor of shape [", n, "]");
  check_storage(steps, "steps", 0);
  const bool amsgrad = !s.max_exp_avg_sqs.empty();
  TORCH_CHECK(s.exp_avg_sq_scales.empty() == s.max_exp_avg_sq_scales.empty() || !amsgrad,
              "ort_optim::adam_step_: max_exp_avg_sqs share exp_avg_sqs' dtype, so both or neither need scales");
  bool any_double = false, any_single = false;
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    const bool is_double = check_param(p, i, !s.master_params.empty());
    (is_double ? any_double : any_single) = true;
    check_state(s.exp_avgs[i], p, "exp_avgs", i, is_double);
    check_state(s.exp_avg_sqs[i], p, "exp_avg_sqs", i, is_double);
    if (amsgrad) {
      check_state(s.max_exp_avg_sqs[i], p, "max_exp_avg_sqs", i, is_double);
      TORCH_CHECK(s.max_exp_avg_sqs[i].scalar_type() == s.exp_avg_sqs[i].scalar_type(), "ort_optim::adam_step_: ",
                  "max_exp_avg_sqs[", i, "] must have the dtype of exp_avg_sqs[", i, "]");
    }
    if (!s.master_params.empty()) {
      check_same_shape(s.master_params[i], p, "master_params", i);
      TORCH_CHECK(s.master_params[i].scalar_type() == at::kFloat && s.master_params[i].is_contiguous(),
                  "ort_optim::adam_step_: master_params[", i, "] must be a contiguous float32 tensor");
    }
    check_scales(s.exp_avg_scales, s.exp_avgs, i, "exp_avg_scales", p);
    check_scales(s.exp_avg_sq_scales, s.exp_avg_sqs, i, "exp_avg_sq_scales", p);
    if (amsgrad) {
      check_scales(s.max_exp_avg_sq_scales, s.max_exp_avg_sqs, i, "max_exp_avg_sq_scales", p);
      TORCH_CHECK(s.max_exp_avg_sq_scales.empty() ||
                      s.max_exp_avg_sq_scales[i].scalar_type() == s.exp_avg_sq_scales[i].scalar_type(),
                  "ort_optim::adam_step_: max_exp_avg_sq_scales[", i, "] must have the dtype of exp_avg_sq_scales[",
                  i, "] (max_exp_avg_sqs share exp_avg_sqs' format)");
    }
  }
  TORCH_CHECK(!(any_double && any_single), "ort_optim::adam_step_: float64 params cannot share a call with ",
              "other dtypes; group them separately");
  return any_double;
}

void check_rounding_keys(const c10::optional<at::Tensor>& keys, const std::vector<const at::Tensor*>& params,
                         const std::vector<TensorWork>& work) {
  if (!keys.has_value()) return;
  const at::Tensor& k = *keys;
  TORCH_CHECK(k.scalar_type() == at::kLong && k.dim() == 1 && size_t(k.numel()) == params.size() &&
                  k.is_contiguous() && k.device().is_cpu(),
              "ort_optim::adam_step_: rounding_keys must be a contiguous int64 CPU tensor of shape [",
              params.size(), "]");
  for (size_t i = 0; i < params.size(); ++i) {
    TORCH_CHECK(params[i]->scalar_type() == at::kBFloat16 && work[i].master == nullptr,
                "ort_optim::adam_step_: rounding_keys (stochastic rounding) given but params[", i, "] is ",
                params[i]->scalar_type(), work[i].master ? " with a master weight" : "",
                "; stochastic rounding is for bfloat16 params without master weights");
  }
}

}  // namespace ort_optim
