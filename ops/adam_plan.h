// AdamPlan: one bucket's params and states, validated and resolved once for many steps (ops/README.md, "AdamPlan").
// A CPU helper class (torch.classes.ort_optim.AdamPlan, registered in registration.cpp), not an op; its steps are
// the adam_step_ op's (step.h).
#pragma once

#include <ATen/ATen.h>
#include <c10/util/python_stub.h>  // PyObject
#include <torch/custom_class.h>

#include <vector>

#include "adam_kernel.h"

namespace ort_optim {

// With thousands of small tensors, converting and checking four tensor lists per call cost more than the update's
// bytes: every tensor's metadata is cold again by the next step. A plan validates its tensors once and keeps the
// states' data pointers, so a step reads only what may have changed. It is a cache that cannot be wrong: check(),
// before every step, compares each tensor it holds with what it was when the plan was made (Watch) and re-resolves
// the data pointers of storages that were re-allocated in place; anything else that changed makes check() fail, and
// FusedAdam plans again (validating everything) before anything is written.
class AdamPlan : public torch::CustomClassHolder {
 public:
  AdamPlan(std::vector<at::Tensor> params, std::vector<at::Tensor> exp_avgs, std::vector<at::Tensor> exp_avg_sqs,
           std::vector<at::Tensor> max_exp_avg_sqs, std::vector<at::Tensor> master_params,
           std::vector<at::Tensor> exp_avg_scales, std::vector<at::Tensor> exp_avg_sq_scales,
           std::vector<at::Tensor> max_exp_avg_sq_scales, at::Tensor steps, std::vector<at::Tensor> step_tensors,
           std::vector<int64_t> param_objects, std::vector<int64_t> idle_objects);

  // Whether this plan can step now: every tensor it holds is as it was (data pointers of storages re-allocated in
  // place are re-resolved), every param has a usable gradient and no idle param has one. -1 when it can; else the
  // position of the first param that cannot (params.size() + j for idle_params[j]). Writes no tensor. step() and
  // grad_stats() need a successful check() first.
  int64_t check();

  // One step with the params' current gradients, after a successful check(). grad_norm: also return grad_stats'
  // float32 [sum of squares, 1.0 if not finite] of the gradients as loaded, from the update's own pass (NaN sum when
  // the step was skipped); else an empty tensor.
  at::Tensor step(double lr, double beta1, double beta2, double eps, double weight_decay, int64_t mode,
                  bool bias_correction, bool maximize, c10::optional<at::Tensor> lr_tensor,
                  c10::optional<at::Tensor> inv_grad_scale, c10::optional<at::Tensor> found_inf,
                  c10::optional<at::Tensor> grad_scale, c10::optional<at::Tensor> rounding_keys, bool grad_norm);

  // grad_stats over the params' current gradients, after a successful check().
  at::Tensor grad_stats();

 private:
  // Bumps the version counters of what a step writes (see VersionBumps), called by update() before its kernel runs:
  // the params (as check() resolved them), the gradients when they are unscaled in place, then the states, step
  // tensors and steps, one tensor per counter (state_counters_). Each counter is an allocation of its own, cold by
  // now: they are prefetched a few tensors ahead.
  void mark_written(bool unscaled_grads);
  static constexpr size_t kCounterLookahead = 8;

  // Forgets what check() resolved for the step; passes a result through.
  int64_t release(int64_t result = -1);

  // The tensor of a Python tensor object. The plan may read it: FusedAdam checks a plan only while the group's
  // params list, which holds these objects, is the one the plan was made from.
  static const at::Tensor& tensor_of(PyObject* object);

  // What a tensor was when the plan was made. The plan holds the tensor (params weakly: see params_) and its storage
  // (so that a storage freed and another allocated in its place cannot look the same); check() compares the rest at
  // every step.
  struct Watch {
    const c10::TensorImpl* impl;  // (a param's: compared with its Python object's, which swap_tensors changes)
    c10::Storage storage;         // the storage it viewed
    const void* data;             // the storage's data when last resolved
    int64_t offset;
    size_t bytes;  // storage bytes the view reaches
    caffe2::TypeMeta dtype;
    uint32_t geometry;   // its sizes, then its strides: geometry_[geometry, geometry + 2 * dim)
    uint16_t dim;
    bool moved = false;  // the storage's data moved (re-allocated in place) at the last check()
  };

  Watch watch(const at::Tensor& t);

  // Whether the tensor still views the same storage the same way, and that storage still holds the view; records
  // whether the storage's data moved (the same storage re-allocated: resize_(0), then resize_(n)).
  bool still(Watch& w) const;

  // a == b[0, a.size()): a loop, where std::equal would call memcmp for the one or two dims of a typical tensor.
  static bool same(c10::IntArrayRef a, const int64_t* b);

  // A state's storage was re-allocated in place: point the kernel's view at the new memory (same offset).
  void resolve_state(size_t i, size_t slot, const Watch& w);

  // What the op's check_grad accepts, without raising: FusedAdam's own validation names the param when it is not.
  bool usable_grad(const at::Tensor& g, const Watch& param) const;

  // p.grad without Tensor::grad()'s is_leaf() check, which costs a call per param and warns for a non-leaf param
  // without a gradient (an idle param may be one).
  static const at::Tensor& grad_of(const at::Tensor& p);

  // What check() reads is a chain of dependent pointers per param (its Python object, TensorImpl, then its storage
  // and autograd meta, then the grad's TensorImpl and storage; the states' TensorImpls), all cold by the next step.
  // Walked one param at a time, the core waits on one miss after another; prefetching each link a few params ahead
  // keeps several in flight.
  void prefetch_metadata(size_t i) const;

  static void prefetch_object(const void* object, size_t bytes);

  // The params are known by their Python objects, not held: torch.utils.swap_tensors refuses a tensor that anything
  // else holds a reference to (strong or weak), and it is how model.to() converts params in place. Each step reads
  // the param's current tensor from its Python object and compares it with the one planned.
  std::vector<PyObject*> params_;
  std::vector<at::Tensor> exp_avgs_, exp_avg_sqs_, max_exp_avg_sqs_, master_params_, exp_avg_scales_,
      exp_avg_sq_scales_, max_exp_avg_sq_scales_;
  at::Tensor steps_;
  std::vector<at::Tensor> step_tensors_;  // per param, the view of steps_ that optimizer.state[p]['step'] holds
  std::vector<c10::TensorImpl*> state_counters_;  // what mark_written() bumps besides the params and grads
  // Params of the same param group that had no gradient when the plan was made (frozen ones, say): the plan is only
  // valid while they still have none.
  std::vector<PyObject*> idle_params_;
  std::vector<const c10::TensorImpl*> idle_impls_;
  bool is_double_ = false;
  bool checked_ = false;
  std::vector<TensorWork> work_;
  std::vector<WorkItem> items_;
  std::vector<const at::Tensor*> param_pointers_, grads_;
  std::vector<const std::vector<at::Tensor>*> state_lists_;  // the non-empty state lists, in the schema's order
  size_t per_param_ = 2;                                     // watches per param: the param, its states, its step
  std::vector<Watch> watches_;                               // per param i: [i * per_param_, (i + 1) * per_param_)
  std::vector<int64_t> geometry_;
};

}  // namespace ort_optim
