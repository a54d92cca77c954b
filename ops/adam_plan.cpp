// AdamPlan (declared, with its contract, in adam_plan.h).
#include "adam_plan.h"

#include <torch/csrc/autograd/python_variable.h>  // THPVariable_Unpack: a Python tensor's at::Tensor

#include <unordered_set>

#include "grad_stats.h"
#include "step.h"
#include "validation.h"

namespace ort_optim {

AdamPlan::AdamPlan(std::vector<at::Tensor> params, std::vector<at::Tensor> exp_avgs,
                   std::vector<at::Tensor> exp_avg_sqs, std::vector<at::Tensor> max_exp_avg_sqs,
                   std::vector<at::Tensor> master_params, std::vector<at::Tensor> exp_avg_scales,
                   std::vector<at::Tensor> exp_avg_sq_scales, std::vector<at::Tensor> max_exp_avg_sq_scales,
                   at::Tensor steps, std::vector<at::Tensor> step_tensors, std::vector<int64_t> param_objects,
                   std::vector<int64_t> idle_objects)
    : exp_avgs_(std::move(exp_avgs)),
      exp_avg_sqs_(std::move(exp_avg_sqs)),
      max_exp_avg_sqs_(std::move(max_exp_avg_sqs)),
      master_params_(std::move(master_params)),
      exp_avg_scales_(std::move(exp_avg_scales)),
      exp_avg_sq_scales_(std::move(exp_avg_sq_scales)),
      max_exp_avg_sq_scales_(std::move(max_exp_avg_sq_scales)),
      steps_(std::move(steps)) {
  const StateLists states{exp_avgs_,       exp_avg_sqs_,       max_exp_avg_sqs_,      master_params_,
                          exp_avg_scales_, exp_avg_sq_scales_, max_exp_avg_sq_scales_};
  is_double_ = check_params_and_states(params, states, steps_);
  work_ = state_work(params, states);
  items_ = work_items(work_);
  // Per param, its tensors in a fixed order: the param, its states (in state_lists_ order) and its step tensor (the
  // view of steps_ that optimizer.state[p]['step'] holds: `step.data = t` gives it another storage, which the step
  // must then honour, as torch.optim does); then the steps.
  const std::vector<at::Tensor>* lists[] = {&exp_avgs_,       &exp_avg_sqs_,       &max_exp_avg_sqs_, &master_params_,
                                            &exp_avg_scales_, &exp_avg_sq_scales_, &max_exp_avg_sq_scales_};
  for (const auto* list : lists) {
    if (!list->empty()) state_lists_.push_back(list);
  }
  per_param_ = 2 + state_lists_.size();
  TORCH_CHECK(param_objects.size() == params.size(), "ort_optim.AdamPlan: one Python object per param");
  TORCH_CHECK(step_tensors.size() == params.size(), "ort_optim.AdamPlan: one step tensor per param");
  for (size_t i = 0; i < params.size(); ++i) {
    params_.push_back(reinterpret_cast<PyObject*>(param_objects[i]));
    TORCH_CHECK(tensor_of(params_[i]).unsafeGetTensorImpl() == params[i].unsafeGetTensorImpl(),
                "ort_optim.AdamPlan: param_objects[", i, "] is not params[", i, "]");
    const at::Tensor& step = step_tensors[i];
    TORCH_CHECK(step.numel() == 1 && step.scalar_type() == at::kDouble && step.is_alias_of(steps_) &&
                    step.storage_offset() == steps_.storage_offset() + int64_t(i) * steps_.stride(0),
                "ort_optim.AdamPlan: step_tensors[", i, "] must be a one-element view of steps[", i, "]");
    watches_.push_back(watch(params[i]));
    for (const auto* list : state_lists_) watches_.push_back(watch((*list)[i]));
    watches_.push_back(watch(step));
  }
  // One tensor per version counter among the states, step tensors and steps, for mark_written(): views of one
  // flat buffer (FusedAdam's moments and masters of a bucket) share their base's counter. (A tensor's counter is
  // its own for life: `t.data = x` keeps it.)
  std::unordered_set<const void*> seen;
  auto add_counter = [&](const at::Tensor& t) {
    c10::TensorImpl* impl = t.unsafeGetTensorImpl();
    const void* counter = counter_of(impl);
    if (counter != nullptr && seen.insert(counter).second) state_counters_.push_back(impl);  // (none: inference)
  };
  for (const auto* list : state_lists_) {
    for (const at::Tensor& t : *list) add_counter(t);
  }
  for (const at::Tensor& t : step_tensors) add_counter(t);
  add_counter(steps_);
  step_tensors_ = std::move(step_tensors);
  watches_.push_back(watch(steps_));
  for (int64_t q : idle_objects) {
    idle_params_.push_back(reinterpret_cast<PyObject*>(q));
    idle_impls_.push_back(tensor_of(idle_params_.back()).unsafeGetTensorImpl());
  }
}

int64_t AdamPlan::check() {
  release();
  const size_t n = params_.size();
  for (size_t j = 0; j < idle_params_.size(); ++j) {
    const at::Tensor& q = tensor_of(idle_params_[j]);
    if (q.unsafeGetTensorImpl() != idle_impls_[j] || grad_of(q).defined()) return int64_t(n + j);
  }
  grads_.resize(n);
  for (size_t i = 0; i < n; ++i) {
    prefetch_metadata(i);
    const at::Tensor& p = tensor_of(params_[i]);
    Watch* w = &watches_[i * per_param_];
    if (p.unsafeGetTensorImpl() != w[0].impl || !still(w[0])) return release(int64_t(i));
    for (size_t k = 1; k < per_param_; ++k) {
      if (!still(w[k])) return release(int64_t(i));
      // (the last watch is the param's step tensor, a view of steps_, whose data step() reads afresh)
      if (w[k].moved && k + 1 < per_param_) resolve_state(i, k - 1, w[k]);
    }
    const at::Tensor& g = grad_of(p);
    if (!usable_grad(g, w[0])) return release(int64_t(i));
    grads_[i] = &g;
    param_pointers_.push_back(&p);
  }
  if (!still(watches_.back())) return release(int64_t(n));
  checked_ = true;
  return -1;
}

at::Tensor AdamPlan::step(double lr, double beta1, double beta2, double eps, double weight_decay, int64_t mode,
                          bool bias_correction, bool maximize, c10::optional<at::Tensor> lr_tensor,
                          c10::optional<at::Tensor> inv_grad_scale, c10::optional<at::Tensor> found_inf,
                          c10::optional<at::Tensor> grad_scale, c10::optional<at::Tensor> rounding_keys,
                          bool grad_norm) {
  TORCH_CHECK(checked_, "ort_optim.AdamPlan: step() needs a successful check() first");
  StepOptions options{lr,       beta1,     beta2,          eps,       weight_decay, mode, bias_correction,
                      maximize, lr_tensor, inv_grad_scale, found_inf, grad_scale, rounding_keys};
  double square_sum = 0.0;
  if (grad_norm) options.grad_square_sum = &square_sum;
  update(work_, items_, param_pointers_, grads_, steps_.data_ptr<double>(), is_double_, !max_exp_avg_sqs_.empty(),
         options, [this](bool unscaled_grads) { mark_written(unscaled_grads); });
  release();
  return grad_norm ? stats_tensor(square_sum) : at::Tensor();
}

at::Tensor AdamPlan::grad_stats() {
  TORCH_CHECK(checked_, "ort_optim.AdamPlan: grad_stats() needs a successful check() first");
  return grad_stats_of(grads_);
}

void AdamPlan::mark_written(bool unscaled_grads) {
  VersionBumps bumps;
  const size_t n = param_pointers_.size(), m = state_counters_.size();
  for (size_t i = 0; i < n; ++i) {
    if (i + kCounterLookahead < n) prefetch_counter(param_pointers_[i + kCounterLookahead]->unsafeGetTensorImpl());
    bumps.add(*param_pointers_[i]);
  }
  if (unscaled_grads) {
    for (const at::Tensor* g : grads_) bumps.add(*g);
  }
  for (size_t i = 0; i < m; ++i) {
    if (i + kCounterLookahead < m) prefetch_counter(state_counters_[i + kCounterLookahead]);
    bumps.add(state_counters_[i]);
  }
}

int64_t AdamPlan::release(int64_t result) {
  checked_ = false;
  param_pointers_.clear();
  return result;
}

const at::Tensor& AdamPlan::tensor_of(PyObject* object) { return THPVariable_Unpack(object); }

AdamPlan::Watch AdamPlan::watch(const at::Tensor& t) {
  const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  Watch w{impl,      t.storage(), t.storage().data(), t.storage_offset(), bytes_needed(t), t.dtype(),
          uint32_t(geometry_.size()), uint16_t(t.dim())};
  geometry_.insert(geometry_.end(), t.sizes().begin(), t.sizes().end());
  geometry_.insert(geometry_.end(), t.strides().begin(), t.strides().end());
  return w;
}

bool AdamPlan::still(Watch& w) const {
  const c10::TensorImpl* impl = w.impl;
  const c10::StorageImpl* storage = impl->unsafe_storage().unsafeGetStorageImpl();
  if (storage != w.storage.unsafeGetStorageImpl() || impl->storage_offset() != w.offset ||
      impl->dtype() != w.dtype || storage->nbytes() < w.bytes) {
    return false;
  }
  const c10::IntArrayRef sizes = impl->sizes(), strides = impl->strides();
  const int64_t* geometry = geometry_.data() + w.geometry;
  if (sizes.size() != w.dim || !same(sizes, geometry) || !same(strides, geometry + w.dim)) return false;
  w.moved = storage->data() != w.data;
  if (w.moved) w.data = storage->data();
  return true;
}

bool AdamPlan::same(c10::IntArrayRef a, const int64_t* b) {
  for (size_t d = 0; d < a.size(); ++d) {
    if (a[d] != b[d]) return false;
  }
  return true;
}

void AdamPlan::resolve_state(size_t i, size_t slot, const Watch& w) {
  const auto* list = state_lists_[slot];
  void* data = (*list)[i].data_ptr();  // (materialises a copy-on-write storage)
  TensorWork& tw = work_[i];
  if (list == &exp_avgs_) tw.exp_avg = data;
  if (list == &exp_avg_sqs_) tw.exp_avg_sq = data;
  if (list == &max_exp_avg_sqs_) tw.max_exp_avg_sq = data;
  if (list == &master_params_) tw.master = static_cast<float*>(data);
  if (list == &exp_avg_scales_) tw.exp_avg_scale = static_cast<float*>(data);
  if (list == &exp_avg_sq_scales_) tw.exp_avg_sq_scale = static_cast<float*>(data);
  if (list == &max_exp_avg_sq_scales_) tw.max_exp_avg_sq_scale = static_cast<float*>(data);
}

bool AdamPlan::usable_grad(const at::Tensor& g, const Watch& param) const {
  if (!g.defined() || g.layout() != at::kStrided || !g.device().is_cpu()) return false;
  const at::ScalarType gt = g.scalar_type();
  if (!(is_double_ ? gt == at::kDouble : is_float_storage(gt))) return false;
  const c10::IntArrayRef sizes = g.sizes();
  if (sizes.size() != param.dim || !same(sizes, geometry_.data() + param.geometry)) return false;
  return g.has_storage() && g.storage().nbytes() >= bytes_needed(g);
}

const at::Tensor& AdamPlan::grad_of(const at::Tensor& p) { return p.unsafeGetTensorImpl()->grad(); }

void AdamPlan::prefetch_metadata(size_t i) const {
  const size_t n = params_.size();
  if (i + 16 < n) prefetch_object(params_[i + 16], 64);
  if (i + 12 < n) {
    prefetch_object(tensor_of(params_[i + 12]).unsafeGetTensorImpl(), sizeof(c10::TensorImpl));
    const Watch* w = &watches_[(i + 12) * per_param_];
    for (size_t k = 1; k < per_param_; ++k) prefetch_object(w[k].impl, sizeof(c10::TensorImpl));
  }
  if (i + 8 < n) {
    const c10::TensorImpl* impl = tensor_of(params_[i + 8]).unsafeGetTensorImpl();
    prefetch_object(impl->unsafe_storage().unsafeGetStorageImpl(), 64);
    if (const auto* meta = impl->autograd_meta()) prefetch_object(meta, 128);
  }
  if (i + 4 < n) {
    const auto* meta = tensor_of(params_[i + 4]).unsafeGetTensorImpl()->autograd_meta();
    const at::Tensor* grad = meta ? &meta->grad() : nullptr;
    if (grad && grad->defined()) prefetch_object(grad->unsafeGetTensorImpl(), sizeof(c10::TensorImpl));
  }
  if (i + 2 < n) {
    const auto* meta = tensor_of(params_[i + 2]).unsafeGetTensorImpl()->autograd_meta();
    const at::Tensor* grad = meta ? &meta->grad() : nullptr;
    if (grad && grad->defined()) {
      prefetch_object(grad->unsafeGetTensorImpl()->unsafe_storage().unsafeGetStorageImpl(), 64);
    }
  }
}

void AdamPlan::prefetch_object(const void* object, size_t bytes) {
  for (size_t b = 0; b < bytes; b += 64) __builtin_prefetch(static_cast<const char*>(object) + b);
}

}  // namespace ort_optim
