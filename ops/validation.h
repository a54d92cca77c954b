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

// Whether gradient g shares memory with its param p: the bytes they reach meet in one storage (p.grad = p.detach(),
// or a view of it). A step that writes the unscaled gradient back (grad_scale) cannot: the param cannot hold both its
// update and the unscaled gradient. Exact for contiguous tensors; for a strided one, the spans meeting is enough.
inline bool grad_in_param_memory(const at::Tensor& g, const at::Tensor& p) {
  if (!g.has_storage() || !p.has_storage() ||
      g.storage().unsafeGetStorageImpl() != p.storage().unsafeGetStorageImpl()) {
    return false;
  }
  const size_t g_end = bytes_needed(g), p_end = bytes_needed(p);
  return g_end > 0 && p_end > 0 && size_t(g.storage_offset()) * g.element_size() < p_end &&
         size_t(p.storage_offset()) * p.element_size() < g_end;
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
