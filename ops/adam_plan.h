// TensorWatch and AdamPlan: one bucket's tensors validated once for many steps (ops/README.md, "AdamPlan"). Helper
// classes (torch.classes.ort_optim.TensorWatch and .AdamPlan, registered in registration.cpp), not ops; a plan's
// steps are the adam_step_ op's (step.h).
//
// Neither holds or reads a Python object: the op library uses no Python C API (it does not depend on the Python ABI)
// and their methods, which torch runs with the GIL released, read only tensors they hold or that the caller passes
// (see check()).
#pragma once

#include <ATen/ATen.h>
#include <torch/custom_class.h>

#include <vector>

#include "adam_kernel.h"

namespace ort_optim {

// With thousands of small tensors, converting and checking four tensor lists per call cost more than the update's
// bytes: every tensor's metadata is cold again by the next step. A watch records, once, what each tensor of a
// bucket is (its storage, data pointer, offset, dtype, device, sizes and strides); check(), before every step,
// compares each with what it is now, and checks every param's gradient. It is a cache that cannot be wrong: anything
// that changed (but a storage re-allocated in place, which AdamPlan follows) makes check() fail, and FusedAdam plans
// again (validating everything) before anything is written. It compares metadata only and never touches data, so it
// serves tensors of any device: FusedAdam's CPU buckets through AdamPlan, its CUDA (Triton) buckets directly.
//
// Params are not held between calls, not even weakly: torch.utils.swap_tensors (model.to() with swap-on-conversion)
// refuses a tensor that anything else references. The watch keeps each param's TensorImpl address as an identity
// only; check() takes the params as they are now (the caller's Python params, converted by torch's binding under
// the GIL into at::Tensors held for the call) and reads a param only through a TensorImpl equal to the one planned.
// A swapped param has another TensorImpl: check() fails before reading anything through the planned one. (The list
// costs a third of a snapshot of the params' addresses as Python ints, Tensor._cdata: each of those allocates an
// int.)
class TensorWatch : public torch::CustomClassHolder {
 public:
  // states: the bucket's non-empty per-param state lists (n tensors each); step_tensors: per param, the tensor
  // optimizer.state[p]['step'] holds (a view of steps for FusedAdam's buckets); idle_params: params that have no
  // gradient now, whose gradient check() watches (none for buckets whose caller reads the gradients itself).
  TensorWatch(const std::vector<at::Tensor>& params, std::vector<std::vector<at::Tensor>> states,
              std::vector<at::Tensor> step_tensors, at::Tensor steps, const std::vector<at::Tensor>& idle_params)
      : TensorWatch(params, std::move(states), std::move(step_tensors), std::move(steps), idle_params, false) {}

  // -1 when the bucket can step now: each param's TensorImpl is the planned one (now: the params, then the idle
  // params, as they are now), every tensor is as it was (data pointers of storages re-allocated in
  // place are followed where follow() says so), every param has a usable gradient (dense, on the param's device, a
  // dtype it can take, its shape, a storage that holds it) and no idle param has one. Else the position of the
  // first param that cannot (params.size() + j for idle_params[j]). Writes no tensor.
  int64_t check(const c10::List<at::Tensor>& now);

  size_t size() const { return param_impls_.size(); }

 protected:
  // data_read_afresh: the watch's user reads the data pointers of the params, step tensors and steps afresh at
  // every step (AdamPlan does), so check() need not compare them; a bare watch compares every tensor's.
  TensorWatch(const std::vector<at::Tensor>& params, std::vector<std::vector<at::Tensor>> states,
              std::vector<at::Tensor> step_tensors, at::Tensor steps, const std::vector<at::Tensor>& idle_params,
              bool data_read_afresh);

  // The storage of a watched tensor was re-allocated in place (the same storage object, other memory: resize_(0)
  // then resize_(n), as CPU offload does) since the last check: whether the watch's user follows it to its new
  // memory (AdamPlan re-resolves its kernel's pointers and says yes). A bare watch says no, so check() fails: its
  // caller keeps the tensors' addresses (the Triton backend's launch plan) and plans again. param: the param's
  // position (size() for steps); k: its watch (0 the param, 1 + j states_[j], then its step tensor).
  virtual bool follow(size_t param, size_t k) { return false; }

  // What check() resolved for the step: the params' TensorImpls and gradients (valid until the next check() or
  // release(); FusedAdam steps right after checking).
  std::vector<c10::TensorImpl*> checked_params_;
  std::vector<const at::Tensor*> grads_;
  bool checked_ = false;
  int64_t release(int64_t result = -1);

  std::vector<std::vector<at::Tensor>> states_;
  std::vector<at::Tensor> step_tensors_;
  at::Tensor steps_;
  bool is_double_ = false;

 private:
  // What a tensor was when it was planned. The watch holds the storage (so that a storage freed and another
  // allocated in its place cannot look the same); check() compares the rest at every step.
  struct Watch {
    const c10::TensorImpl* impl;  // a state's (held in states_), or a param's identity (see above)
    c10::Storage storage;         // the storage it viewed
    const void* data;             // the storage's data when last resolved
    int64_t offset;
    size_t bytes;  // storage bytes the view reaches
    caffe2::TypeMeta dtype;
    c10::Device device;
    uint32_t geometry;   // its sizes, then its strides: geometry_[geometry, geometry + 2 * dim)
    uint16_t dim;
    bool compare_data;  // whether check() compares its storage's data pointer (see data_read_afresh)
  };

  Watch watch(const at::Tensor& t, bool compare_data);

  // Whether the tensor still views the same storage the same way, that storage still holds the view, and its
  // memory is where it was (if compared) or the watch's user follows it there (follow(param, k)). (Defined inline
  // in adam_plan.cpp, as the other helpers of check()'s loop: no call per tensor.)
  bool still(Watch& w, size_t param, size_t k);

  // A usable gradient for the param: see check().
  bool usable_grad(const at::Tensor* g, const Watch& param) const;

  // What check() reads is a chain of dependent pointers per param: its TensorImpl, storage and AutogradMeta and its
  // states' TensorImpls and storages (all known when planned), then its gradient's TensorImpl (found through the
  // AutogradMeta), then that one's storage; all cold by the next step. Walked one param at a time, the core waits
  // on one miss after another. check() prefetches the cache lines of the fields it reads (metadata_lines.h), each
  // link of the chain a few params before the next link needs it: the planned lines kPlannedAhead params ahead
  // (listed once, when planned: lines_), a gradient's TensorImpl kGradAhead ahead, its storage kGradStorageAhead.
  static constexpr size_t kPlannedAhead = 6, kGradAhead = 3, kGradStorageAhead = 1;
  void prefetch_ahead(size_t i, const c10::TensorImpl* const* now) const;
  void prefetch_planned(size_t i) const {  // param i's planned lines
    for (uint32_t l = line_begin_[i]; l < line_begin_[i + 1]; ++l) {
      __builtin_prefetch(reinterpret_cast<void*>(lines_[l]));
    }
  }
  std::vector<uintptr_t> lines_;        // per param i: [line_begin_[i], line_begin_[i + 1]), each line listed once
  std::vector<uint32_t> line_begin_;
  size_t storage_data_offset_ = 0;      // (metadata::storage_data_offset)

  std::vector<const c10::TensorImpl*> param_impls_, idle_impls_;  // identities, see above
  std::vector<const c10::TensorImpl*> now_;                        // check()'s: the TensorImpls of `now`
  size_t per_param_ = 2;                                          // watches per param: the param, its states, its step
  std::vector<Watch> watches_;                                    // per param i: [i * per_param_, (i + 1) * per_param_)
  std::vector<int64_t> geometry_;
};

// A CPU bucket's watch and its kernel's work: adam_step_ over lists kept across steps. check() as TensorWatch's; it
// re-resolves the data pointers of state storages re-allocated in place. step() and grad_stats() need a successful
// check() first.
class AdamPlan : public TensorWatch {
 public:
  AdamPlan(std::vector<at::Tensor> params, std::vector<at::Tensor> exp_avgs, std::vector<at::Tensor> exp_avg_sqs,
           std::vector<at::Tensor> max_exp_avg_sqs, std::vector<at::Tensor> master_params,
           std::vector<at::Tensor> exp_avg_scales, std::vector<at::Tensor> exp_avg_sq_scales,
           std::vector<at::Tensor> max_exp_avg_sq_scales, at::Tensor steps, std::vector<at::Tensor> step_tensors,
           std::vector<at::Tensor> idle_params);
  ~AdamPlan() override;

  int64_t check(const c10::List<at::Tensor>& now);

  // One step with the params' current gradients, after a successful check(). grad_norm: also return grad_stats'
  // float32 [sum of squares, 1.0 if not finite] of the gradients as loaded, from the update's own pass (NaN sum when
  // the step was skipped); else an empty tensor.
  at::Tensor step(double lr, double beta1, double beta2, double eps, double weight_decay, int64_t mode,
                  bool bias_correction, bool maximize, c10::optional<at::Tensor> lr_tensor,
                  c10::optional<at::Tensor> inv_grad_scale, c10::optional<at::Tensor> found_inf,
                  c10::optional<at::Tensor> grad_scale, c10::optional<at::Tensor> rounding_keys, bool grad_norm);

  // grad_stats over the params' current gradients, after a successful check().
  at::Tensor grad_stats();

  // After a successful check(): the position of the first param whose gradient cannot take the unscaled gradient
  // that a step with grad_scale writes back (it overlaps itself, or shares memory with its param: the op's own
  // tests), else -1. For a caller that steps several buckets and must refuse before any of them writes.
  int64_t unscalable_grad() const;

  // Gives back what a successful check() holds for the step (a step gives it back itself): for a caller that does
  // not step after all.
  void forget();

 private:
  bool follow(size_t param, size_t k) override;

  // The params and gradients check() resolved, held from a successful check() to the end of the step (or forget()):
  // another thread that replaces a gradient meanwhile cannot free what the step reads and writes. Nothing is held
  // between steps, so swap_tensors and a gradient set to None work there as without the plan. Released by
  // forget_params().
  void borrow_params();
  void forget_params();

  // Bumps the version counters of what a step writes (see VersionBumps), called by update() before its kernel runs:
  // the params (as check() resolved them), the gradients when they are unscaled in place, then the states, step
  // tensors and steps, one tensor per counter (state_counters_). Each counter is an allocation of its own, cold by
  // now: they are prefetched a few tensors ahead.
  void mark_written(bool unscaled_grads);
  static constexpr size_t kCounterLookahead = 8;

  std::vector<at::Tensor> exp_avgs_, exp_avg_sqs_, max_exp_avg_sqs_, master_params_, exp_avg_scales_,
      exp_avg_sq_scales_, max_exp_avg_sq_scales_;
  std::vector<const std::vector<at::Tensor>*> state_lists_;  // the non-empty lists above, in states_' order
  std::vector<c10::TensorImpl*> state_counters_;             // what mark_written() bumps besides the params and grads
  std::vector<at::Tensor> borrowed_;                         // see borrow_params(): n slots
  std::vector<at::Tensor> held_grads_;                       // see borrow_params(): n slots, grads_ point into them
  size_t borrowed_count_ = 0;                                // how many hold a borrowed TensorImpl
  std::vector<const at::Tensor*> param_pointers_;            // &borrowed_[i]
  std::vector<TensorWork> work_;
  std::vector<WorkItem> items_;
};

}  // namespace ort_optim
