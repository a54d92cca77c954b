// The Adam kernel's interface: what it updates (TensorWork, one per tensor, resolved before the parallel region),
// with which hyperparameters (Hyper), in which pieces (WorkItem: a chunk of one tensor; every work item of a call
// goes into ONE at::parallel_for). adam_kernel.cpp has the update itself.
#pragma once

#include <c10/core/ScalarType.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "fp8.h"
#include "low_bit.h"

namespace ort_optim {

// Elements per quantisation block of fp16 states (one scale each) and per scratch block. Must equal
// QUANT_BLOCK in ort_optim/_spec.py and BLOCK in ort_optim/backends/triton.py (checked by the tests).
constexpr int64_t kBlock = 1024;
// Elements per parallel work item: big enough to amortise scheduling, small enough to balance 2000 small tensors.
constexpr int64_t kChunk = 64 * kBlock;

enum Mode : int64_t { kAdamL2 = 0, kAdamWTransformers = 1, kAdamWTorch = 2 };

// Per-tensor view of everything the kernel touches, resolved once before the parallel region.
struct TensorWork {
  void* param;
  void* grad;  // written only when the gradients are unscaled in place (grad_scale given)
  void* exp_avg;
  void* exp_avg_sq;
  void* max_exp_avg_sq;  // nullptr unless amsgrad
  float* master;         // nullptr unless master weights
  float* exp_avg_scale;  // nullptr unless exp_avg is an fp16 or low-bit state; likewise below (bfloat16 storage for
  float* exp_avg_sq_scale;  // 4-bit states: read and written through LowBit)
  float* max_exp_avg_sq_scale;
  const LowBit* exp_avg_low_bit = nullptr;  // the format of a uint8 (low-bit) exp_avg; likewise exp_avg_sq and its max
  const LowBit* exp_avg_sq_low_bit = nullptr;
  const Fp8* exp_avg_fp8 = nullptr;  // the format of an fp8 exp_avg; likewise exp_avg_sq and its max
  const Fp8* exp_avg_sq_fp8 = nullptr;
  bool stochastic = false;  // round the bfloat16 param stochastically, with this step's key
  uint64_t round_key = 0;
  uint32_t step = 0;  // this step's count (from 1), for the stochastic rounding of a low-bit exp_avg
  at::ScalarType param_type, grad_type, exp_avg_type, exp_avg_sq_type;
  int64_t numel;
  // Per-step scalars, computed in double from this tensor's own step count (README.md, "Per-step scalars").
  double step_size;  // mode 2: lr / bc1;  modes 0 and 1: lr * sqrt(bc2) / bc1
  double bc2_sqrt;   // mode 2 only
};

struct Hyper {
  double lr, beta1, beta2, eps, weight_decay, grad_mul;
  int64_t mode;
  double grad_scale;  // 0: leave the gradients as they are; else write them back as grad / grad_scale
};

struct WorkItem {
  int64_t tensor, begin, end;
};

std::vector<WorkItem> make_work_items(const std::vector<int64_t>& numels);

// The update of every work item, in one parallel region; T is float, or double for float64 params.
// grad_squares: nullptr, or one slot per work item for the sum of squares of its gradients (as loaded, before any
// multiplier): the blocks' sums from the update loop, added in block order (the plain step's gradient norm).
template <typename T>
void dispatch_adam(const std::vector<TensorWork>& work, const std::vector<WorkItem>& items, const Hyper& h,
                   bool amsgrad, double* grad_squares);

}  // namespace ort_optim
