// Validation of adam_step_'s inputs (and of an AdamPlan's, which are the same lists): all of it happens before
// anything is written, and every error names the list and the index it is about and says what is expected.
#pragma once

#include <ATen/ATen.h>

#include <vector>

#include "adam_kernel.h"
#include "low_bit.h"

namespace ort_optim {

inline bool is_low_precision(at::ScalarType t) { return t == at::kHalf || t == at::kBFloat16; }
inline bool is_float_storage(at::ScalarType t) { return t == at::kFloat || is_low_precision(t); }

// The per-parameter state lists of a call, in the schema's order (all but exp_avgs/exp_avg_sqs may be empty).
struct StateLists {
  at::TensorList exp_avgs, exp_avg_sqs, max_exp_avg_sqs, master_params, exp_avg_scales, exp_avg_sq_scales,
      max_exp_avg_sq_scales;
};

void check_list_length(const at::TensorList& list, size_t n, const char* name, bool optional);

// Bytes of its storage a view reaches (0 for an empty tensor): from the storage's start to the end of its last element.
// (inline: TensorWatch::check() calls it for every gradient)
inline size_t bytes_needed(int64_t offset, c10::IntArrayRef sizes, c10::IntArrayRef strides, size_t element_size) {
  int64_t last = offset;
  for (size_t d = 0; d < sizes.size(); ++d) {
    if (sizes[d] == 0) return 0;
    last += (sizes[d] - 1) * strides[d];
  }
  return size_t(last + 1) * element_size;
}

inline size_t bytes_needed(const at::Tensor& t) {
  return bytes_needed(t.storage_offset(), t.sizes(), t.strides(), t.element_size());
}

// Whether gradient g shares memory with its param p: the bytes their elements reach, from the first element's address
// to the end of the last, meet (p.grad = p.detach(), or a view of it; addresses, not storages, so memory shared
// outside torch counts too). A step that writes the unscaled gradient back (grad_scale) cannot take it: the param
// cannot hold both its update and the unscaled gradient. Exact for contiguous tensors; for a strided one the spans
// decide (interleaved views of one buffer count as sharing). ort_optim/_spec.py's grad_in_param_memory is the same rule.
inline bool grad_in_param_memory(const at::Tensor& g, const at::Tensor& p) {
  if (g.numel() == 0 || p.numel() == 0 || g.device() != p.device() || g.is_meta() || !g.has_storage() ||
      !p.has_storage()) {
    return false;
  }
  const uintptr_t g_address = uintptr_t(g.data_ptr()), p_address = uintptr_t(p.data_ptr());
  const size_t g_span = bytes_needed(0, g.sizes(), g.strides(), g.element_size());
  const size_t p_span = bytes_needed(0, p.sizes(), p.strides(), p.element_size());
  return g_address < p_address + p_span && p_address < g_address + g_span;
}

// The low-bit format of a uint8 state, told by its scales' dtype: float32 -> 8-bit, bfloat16 -> 4-bit.
const LowBit* low_bit_of(const at::Tensor& state, const at::Tensor& scales);

double scalar_value(const c10::optional<at::Tensor>& t, const char* name);

void check_grad(const at::Tensor& g, const at::Tensor& p, size_t i, bool is_double);

// Everything but the gradients. Returns whether the params are float64 (they cannot share a call with others).
bool check_params_and_states(at::TensorList params, const StateLists& s, const at::Tensor& steps);

// rounding_keys: int64 [n], one key per param; only for bfloat16 params without master weights.
void check_rounding_keys(const c10::optional<at::Tensor>& keys, const std::vector<const at::Tensor*>& params,
                         const std::vector<TensorWork>& work);

// The tensors of a list, as the pointers that update() and grad_stats_of() take.
inline std::vector<const at::Tensor*> pointers(at::TensorList tensors) {
  std::vector<const at::Tensor*> out;
  out.reserve(tensors.size());
  for (const at::Tensor& t : tensors) out.push_back(&t);
  return out;
}

}  // namespace ort_optim
