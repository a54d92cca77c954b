// TensorWatch and AdamPlan (declared, with their contracts, in adam_plan.h).
#include "adam_plan.h"

#include <ATen/MemoryOverlap.h>

#include <algorithm>
#include <unordered_set>

#include "grad_stats.h"
#include "metadata_lines.h"
#include "step.h"
#include "validation.h"

namespace ort_optim {

// ---- TensorWatch ----------------------------------------------------------------------------------------------------

TensorWatch::TensorWatch(const std::vector<at::Tensor>& params, std::vector<std::vector<at::Tensor>> states,
                         std::vector<at::Tensor> step_tensors, at::Tensor steps,
                         const std::vector<at::Tensor>& idle_params, bool data_read_afresh)
    : states_(std::move(states)), step_tensors_(std::move(step_tensors)), steps_(std::move(steps)) {
  const size_t n = params.size();
  for (const auto& list : states_) {
    TORCH_CHECK(list.size() == n, "ort_optim.TensorWatch: every state list needs one tensor per param");
  }
  TORCH_CHECK(step_tensors_.size() == n, "ort_optim.TensorWatch: one step tensor per param");
  for (const at::Tensor& p : params) {
    TORCH_CHECK(p.defined() && p.layout() == at::kStrided, "ort_optim.TensorWatch: params must be dense tensors");
  }
  is_double_ = n > 0 && params[0].scalar_type() == at::kDouble;
  // Per param, its tensors in a fixed order: the param, its states (in states_' order) and its step tensor
  // (`step.data = t` gives it another storage, which the step must then honour, as torch.optim does); then steps.
  per_param_ = 2 + states_.size();
  const bool compare_all = !data_read_afresh;
  for (size_t i = 0; i < n; ++i) {
    param_impls_.push_back(params[i].unsafeGetTensorImpl());
    watches_.push_back(watch(params[i], compare_all));
    for (const auto& list : states_) watches_.push_back(watch(list[i], true));
    watches_.push_back(watch(step_tensors_[i], compare_all));
  }
  watches_.push_back(watch(steps_, compare_all));
  for (const at::Tensor& q : idle_params) idle_impls_.push_back(q.unsafeGetTensorImpl());

  // The cache lines check() reads of each param's planned objects (prefetch_ahead), each listed once: the first
  // param that reads a line (a storage its states share, the steps') lists it, later ones find it cached.
  storage_data_offset_ = metadata::storage_data_offset();
  auto add = [&](uintptr_t line) { lines_.push_back(line); };
  for (size_t i = 0; i < n; ++i) {
    line_begin_.push_back(uint32_t(lines_.size()));
    metadata::planned_lines(params[i], states_, i, step_tensors_[i], compare_all, storage_data_offset_, add);
  }
  line_begin_.push_back(uint32_t(lines_.size()));
  metadata::keep_first(lines_, line_begin_);
  lines_.shrink_to_fit();
}

namespace {

// a == b[0, a.size()): a loop, where std::equal would call memcmp for the one or two dims of a typical tensor.
inline bool same(c10::IntArrayRef a, const int64_t* b) {
  for (size_t d = 0; d < a.size(); ++d) {
    if (a[d] != b[d]) return false;
  }
  return true;
}

}  // namespace

// Each read below is of a field that can change under a watched tensor without changing its TensorImpl (set_(),
// resize_(), as_strided_(), `t.data = x`, untyped_storage().resize_()): the storage it views, its offset, dtype,
// sizes and strides, its storage's size and (where compared) data. Its device is its storage's.
inline bool TensorWatch::still(Watch& w, size_t param, size_t k) {
  const c10::TensorImpl* impl = w.impl;
  const c10::StorageImpl* storage = impl->unsafe_storage().unsafeGetStorageImpl();
  if (storage != w.storage.unsafeGetStorageImpl() || impl->storage_offset() != w.offset ||
      impl->dtype() != w.dtype || storage->nbytes() < w.bytes) {
    return false;
  }
  const c10::IntArrayRef sizes = impl->sizes(), strides = impl->strides();
  const int64_t* geometry = geometry_.data() + w.geometry;
  if (sizes.size() != w.dim || !same(sizes, geometry) || !same(strides, geometry + w.dim)) return false;
  if (!w.compare_data) return true;
  const void* data = storage->data();
  if (data == w.data) return true;
  if (!follow(param, k)) return false;  // (and w.data stays: the next check fails too)
  w.data = data;
  return true;
}

// A gradient is a new tensor whenever zero_grad() set it to None: everything it is gets read. One that Python
// dispatches (a __torch_dispatch__ subclass: a wrapper's values live in the tensors it wraps, its own storage has no
// memory) is not usable here: FusedAdam plans again, and refuses it naming the param.
inline bool TensorWatch::usable_grad(const at::Tensor* g, const Watch& param) const {
  if (g == nullptr || !g->defined() || g->layout() != at::kStrided || g->device() != param.device) return false;
  if (g->key_set().has(c10::DispatchKey::Python)) return false;
  const at::ScalarType gt = g->scalar_type();
  if (!(is_double_ ? gt == at::kDouble : is_float_storage(gt))) return false;
  const c10::IntArrayRef sizes = g->sizes();
  if (sizes.size() != param.dim || !same(sizes, geometry_.data() + param.geometry)) return false;
  return g->has_storage() && g->storage().nbytes() >= bytes_needed(*g);
}

inline void TensorWatch::prefetch_ahead(size_t i, const c10::TensorImpl* const* ids) const {
  // (only planned TensorImpls that the params are now are followed to what they point to: a prefetch of freed
  // memory is harmless, but reading a pointer out of it is not)
  const size_t n = param_impls_.size();
  auto prefetch = [](uintptr_t line) { __builtin_prefetch(reinterpret_cast<const void*>(line)); };
  auto grad = [&](size_t k) -> const c10::TensorImpl* {
    if (ids[k] != param_impls_[k]) return nullptr;
    const at::Tensor* g = metadata::grad_field(param_impls_[k]);
    return g != nullptr && g->defined() ? g->unsafeGetTensorImpl() : nullptr;
  };
  if (i + kPlannedAhead < n) prefetch_planned(i + kPlannedAhead);
  if (i + kGradAhead < n) {
    if (const c10::TensorImpl* g = grad(i + kGradAhead)) {
      metadata::impl_lines(g, metadata::Role::kGrad, watches_[(i + kGradAhead) * per_param_].dim, prefetch);
    }
  }
  if (i + kGradStorageAhead < n) {
    if (const c10::TensorImpl* g = grad(i + kGradStorageAhead)) {
      metadata::storage_lines(g->unsafe_storage().unsafeGetStorageImpl(), false, storage_data_offset_, prefetch);
    }
  }
}

int64_t TensorWatch::check(const c10::List<at::Tensor>& now) {
  release();
  const size_t n = param_impls_.size();
  TORCH_CHECK(now.size() == n + idle_impls_.size(), "ort_optim.TensorWatch: check() takes the ", n, " params and ",
              idle_impls_.size(), " idle params, got ", now.size(), " tensors");
  now_.resize(now.size());
  for (size_t i = 0; i < now.size(); ++i) now_[i] = now[i].unsafeGetTensorImpl();  // (no reference taken)
  const c10::TensorImpl* const* ids = now_.data();
  for (size_t j = 0; j < idle_impls_.size(); ++j) {
    const c10::TensorImpl* q = idle_impls_[j];
    if (ids[n + j] != q) return int64_t(n + j);
    const at::Tensor* g = metadata::grad_field(q);
    if (g != nullptr && g->defined()) return int64_t(n + j);
  }
  grads_.resize(n);
  checked_params_.resize(n);
  for (size_t i = 0; i < std::min(n, kPlannedAhead); ++i) prefetch_planned(i);
  for (size_t i = 0; i < n; ++i) {
    prefetch_ahead(i, ids);
    // (compared before anything is read through it: a swapped param's planned TensorImpl may be freed)
    if (ids[i] != param_impls_[i]) return release(int64_t(i));
    Watch* w = &watches_[i * per_param_];
    for (size_t k = 0; k < per_param_; ++k) {
      if (!still(w[k], i, k)) return release(int64_t(i));
    }
    const at::Tensor* g = metadata::grad_field(param_impls_[i]);
    if (!usable_grad(g, w[0])) return release(int64_t(i));
    grads_[i] = g;
    checked_params_[i] = const_cast<c10::TensorImpl*>(param_impls_[i]);
  }
  if (!still(watches_.back(), n, 0)) return release(int64_t(n));
  checked_ = true;
  return -1;
}

int64_t TensorWatch::release(int64_t result) {
  checked_ = false;
  return result;
}

TensorWatch::Watch TensorWatch::watch(const at::Tensor& t, bool compare_data) {
  const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  Watch w{impl,       t.storage(), t.storage().data(),         t.storage_offset(), bytes_needed(t),
          t.dtype(),  t.device(),  uint32_t(geometry_.size()), uint16_t(t.dim()),  compare_data};
  geometry_.insert(geometry_.end(), t.sizes().begin(), t.sizes().end());
  geometry_.insert(geometry_.end(), t.strides().begin(), t.strides().end());
  return w;
}

// ---- AdamPlan -------------------------------------------------------------------------------------------------------

namespace {

// The op's validation of the lists (its errors name the list and the index), then the non-empty state lists in the
// schema's order: what the watch compares.
std::vector<std::vector<at::Tensor>> validated_states(const std::vector<at::Tensor>& params, const StateLists& s,
                                                     const at::Tensor& steps) {
  check_params_and_states(params, s, steps);
  std::vector<std::vector<at::Tensor>> out;
  for (const at::TensorList& list : {s.exp_avgs, s.exp_avg_sqs, s.max_exp_avg_sqs, s.master_params,
                                     s.exp_avg_scales, s.exp_avg_sq_scales, s.max_exp_avg_sq_scales}) {
    if (!list.empty()) out.push_back(list.vec());
  }
  return out;
}

}  // namespace

AdamPlan::AdamPlan(std::vector<at::Tensor> params, std::vector<at::Tensor> exp_avgs,
                   std::vector<at::Tensor> exp_avg_sqs, std::vector<at::Tensor> max_exp_avg_sqs,
                   std::vector<at::Tensor> master_params, std::vector<at::Tensor> exp_avg_scales,
                   std::vector<at::Tensor> exp_avg_sq_scales, std::vector<at::Tensor> max_exp_avg_sq_scales,
                   at::Tensor steps, std::vector<at::Tensor> step_tensors, std::vector<at::Tensor> idle_params)
    : TensorWatch(params,
                  validated_states(params,
                                   {exp_avgs, exp_avg_sqs, max_exp_avg_sqs, master_params, exp_avg_scales,
                                    exp_avg_sq_scales, max_exp_avg_sq_scales},
                                   steps),
                  step_tensors, steps, idle_params, /*data_read_afresh=*/true),
      exp_avgs_(std::move(exp_avgs)),
      exp_avg_sqs_(std::move(exp_avg_sqs)),
      max_exp_avg_sqs_(std::move(max_exp_avg_sqs)),
      master_params_(std::move(master_params)),
      exp_avg_scales_(std::move(exp_avg_scales)),
      exp_avg_sq_scales_(std::move(exp_avg_sq_scales)),
      max_exp_avg_sq_scales_(std::move(max_exp_avg_sq_scales)) {
  const StateLists states{exp_avgs_,       exp_avg_sqs_,       max_exp_avg_sqs_,      master_params_,
                          exp_avg_scales_, exp_avg_sq_scales_, max_exp_avg_sq_scales_};
  work_ = state_work(params, states);
  items_ = work_items(work_);
  borrowed_.resize(params.size());
  for (const at::Tensor& t : borrowed_) param_pointers_.push_back(&t);
  const std::vector<at::Tensor>* lists[] = {&exp_avgs_,       &exp_avg_sqs_,       &max_exp_avg_sqs_, &master_params_,
                                            &exp_avg_scales_, &exp_avg_sq_scales_, &max_exp_avg_sq_scales_};
  for (const auto* list : lists) {
    if (!list->empty()) state_lists_.push_back(list);
  }
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& step = step_tensors_[i];
    TORCH_CHECK(step.numel() == 1 && step.scalar_type() == at::kDouble && step.is_alias_of(steps_) &&
                    step.storage_offset() == steps_.storage_offset() + int64_t(i) * steps_.stride(0),
                "ort_optim.AdamPlan: step_tensors[", i, "] must be a one-element view of steps[", i, "]");
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
  for (const at::Tensor& t : step_tensors_) add_counter(t);
  add_counter(steps_);
}

AdamPlan::~AdamPlan() { forget_params(); }

int64_t AdamPlan::check(const c10::List<at::Tensor>& now) {
  forget_params();
  const int64_t result = TensorWatch::check(now);
  if (result < 0) borrow_params();
  return result;
}

void AdamPlan::borrow_params() {
  // (reclaim_copy: a reference to each TensorImpl that check() resolved, while the caller's list still holds one.
  // borrowed_ and held_grads_ keep their n slots, undefined between steps, so param_pointers_ and grads_ point into
  // them for the plan's life.)
  const size_t n = checked_params_.size();
  held_grads_.resize(n);
  for (size_t i = 0; i < n; ++i) {
    borrowed_[i] =
        at::Tensor(c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>::reclaim_copy(checked_params_[i]));
    held_grads_[i] = *grads_[i];
    grads_[i] = &held_grads_[i];
  }
  borrowed_count_ = n;
}

void AdamPlan::forget_params() {
  for (size_t i = 0; i < borrowed_count_; ++i) {
    borrowed_[i].reset();
    held_grads_[i].reset();
  }
  borrowed_count_ = 0;
}

int64_t AdamPlan::unscalable_grad() const {
  TORCH_CHECK(checked_, "ort_optim.AdamPlan: unscalable_grad() needs a successful check() first");
  for (size_t i = 0; i < borrowed_count_; ++i) {
    const at::Tensor& g = *grads_[i];
    if ((!g.is_contiguous() && at::has_internal_overlap(g) == at::MemOverlap::Yes) ||
        grad_in_param_memory(g, *param_pointers_[i])) {
      return int64_t(i);
    }
  }
  return -1;
}

void AdamPlan::forget() {
  release();
  forget_params();
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
  {
    struct GiveBack {  // (on every way out of the update, an error included: the step needs a new check())
      AdamPlan* plan;
      ~GiveBack() { plan->forget(); }
    } give_back{this};
    update(work_, items_, param_pointers_, grads_, steps_.data_ptr<double>(), is_double_, !max_exp_avg_sqs_.empty(),
           options, [this](bool unscaled_grads) { mark_written(unscaled_grads); });
  }
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

bool AdamPlan::follow(size_t i, size_t k) {
  // (the params, step tensors and steps are read afresh at every step; a state's data pointer is in work_)
  if (i == size() || k == 0 || k == state_lists_.size() + 1) return true;
  const auto* list = state_lists_[k - 1];
  void* data = (*list)[i].data_ptr();  // (materialises a copy-on-write storage)
  TensorWork& tw = work_[i];
  if (list == &exp_avgs_) tw.exp_avg = data;
  if (list == &exp_avg_sqs_) tw.exp_avg_sq = data;
  if (list == &max_exp_avg_sqs_) tw.max_exp_avg_sq = data;
  if (list == &master_params_) tw.master = static_cast<float*>(data);
  if (list == &exp_avg_scales_) tw.exp_avg_scale = static_cast<float*>(data);
  if (list == &exp_avg_sq_scales_) tw.exp_avg_sq_scale = static_cast<float*>(data);
  if (list == &max_exp_avg_sq_scales_) tw.max_exp_avg_sq_scale = static_cast<float*>(data);
  return true;
}

}  // namespace ort_optim
