// The Adam kernel: the update (adam_loop, the math on one screen), the staging of each block between its storage
// format and float (or double) scratch arrays, and the one parallel loop over the work items.
//
// Shape of the kernel: every tensor is cut into chunks of kChunk elements, all (tensor, chunk) work items of the
// call go into ONE at::parallel_for (each thread takes a run of consecutive items holding an equal share of the
// elements: parallel_items.h), and each chunk is processed in blocks of kBlock elements that are first converted into
// small float (or double) scratch arrays. The Adam math then runs over plain arrays, which the compiler
// vectorises; the fp16/bf16 conversions around it are explicit (F16C, bit tricks), because c10::Half in a loop
// stays scalar and runs at a tenth of memory speed. Tensors whose moments are both fp8 take their own path
// (update_fp8), in blocks of 256: the update's divisions and square roots, which the fp32 step is bound by, run in
// one loop with the coding of the block before, which needs the other vector ports. Tensors with 4-bit moments do the
// same in blocks of 128 (update_q4).

#include "adam_kernel.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "conversions.h"
#include "low_bit.h"
#include "parallel_items.h"
#include "rounding.h"

namespace ort_optim {
namespace {

// |x| as bits: orders like |x| for non-NaN floats, and an integer max vectorises (a float max does not without
// fast-math). A NaN's bits exceed infinity's, so a block with a NaN still reads as non-finite.
inline uint32_t abs_bits(float x) { return float_to_bits(x) & 0x7FFFFFFFu; }

// Block maxima of |m|, |v| and |vmax| as abs_bits, for the fp16 quantiser.
struct BlockMax {
  uint32_t m = 0, v = 0, vmax = 0;
  double grad_squares = 0.0;  // the block's sum of g * g (the gradients as loaded), in T, summed in vector lanes
};

// torch's lerp of m towards g by the weight w = 1 - beta1, the form exp_avg.lerp_(grad, 1 - beta1) takes in
// torch.optim.AdamW: m + w * (g - m) for w < 0.5 (beta1 > 0.5), else g + (w - 1) * (g - m), as torch's vectorised
// lerp forms it (its scalar form, g - (1 - w) * (g - m), differs in the sign of a zero: -0.0 where g = -0.0 and
// beta1 = 0). The second form keeps g exact where m cancels it: with beta1 = 0, m is g.
// w and w - 1 are formed in T, as torch forms them in its compute type.
template <typename T>
struct Lerp {
  bool from_grad;  // base g (w >= 0.5) instead of m
  T coeff;         // w, or w - 1
  explicit Lerp(double beta1) {
    const T w = T(1.0 - beta1);
    from_grad = !(std::abs(w) < T(0.5));
    coeff = from_grad ? w - T(1) : w;
  }
};

// The Adam update of one block, element by element (ops/README.md, "adam_step_", is the specification):
//
//   g = grad * grad_mul                      grad_mul: 1 / loss scale, times the clip coefficient, negated to maximize
//   g = g + wd * p                           mode 0 (Adam, L2): the decay enters the moments
//   p = p * (1 - lr * wd)                    mode 2 (torch AdamW): decoupled decay, before the update
//   m = base + c * (g - m)                   = beta1 * m + (1 - beta1) * g in torch's lerp form (Lerp): with the
//                                            weight w = 1 - beta1, base = m and c = w where w < 0.5, else base = g
//                                            and c = w - 1 (so beta1 = 0 gives m = g exactly)
//   v = v * beta2 + (1 - beta2) * g * g
//   vmax = max(vmax, v); v = vmax            amsgrad: the max of the raw v (NaN-propagating), bias correction after
//   p = p - lr / bc1 * (m / (sqrt(v) / sqrt(bc2) + eps))          mode 2 (step_size = lr / bc1)
//   p = p - lr * sqrt(bc2) / bc1 * (m / (sqrt(v) + eps))          modes 0, 1 (ORT/HF: eps outside the correction)
//   p = p - lr * wd * p                      mode 1 (HF AdamW): decoupled decay, after the update
//
// with bc1 = 1 - beta1^t, bc2 = 1 - beta2^t (t: the param's step, from 1; beta^t by step.cpp's beta_power), formed
// in double per tensor (TensorWork).
// Every operation is rounded separately (-ffp-contract=off), so the Triton kernels give the same bits.
//
// kAmax: also find the block maxima (when a state is stored as scaled fp16), in the same pass rather than in one more
// pass per state. kRoot: also write sqrt(v) (sqrt(vmax) with amsgrad), which a low-bit second moment stores, to root.
// kFromGrad: the lerp's second form (Lerp), chosen outside the loop so that each loop keeps its vector shape (the
// gradient norm's additions run in the lanes SquareSum uses).
template <typename T, int64_t kMode, bool kAmsgrad, bool kAmax, bool kRoot, bool kFromGrad>
BlockMax adam_loop_of(T* __restrict__ p, const T* __restrict__ g, T* __restrict__ m, T* __restrict__ v,
                      T* __restrict__ vmax, int64_t n, const TensorWork& w, const Hyper& h, T* __restrict__ root) {
  const T grad_mul = T(h.grad_mul), b2 = T(h.beta2), one_minus_b2 = T(1.0 - h.beta2);
  const T lerp_coeff = Lerp<T>(h.beta1).coeff;
  const T eps = T(h.eps), wd = T(h.weight_decay), step_size = T(w.step_size), bc2_sqrt = T(w.bc2_sqrt);
  const T torch_decay = T(1.0 - h.lr * h.weight_decay);  // mode 2: p *= 1 - lr*wd, in double like torch
  const T hf_decay = T(h.lr * h.weight_decay);           // mode 1: p -= lr*wd*p after the update
  uint32_t max_m = 0, max_v = 0, max_vmax = 0;
  // The gradients' sum of squares rides along (the plain step's norm: one multiply-add per element of a loop that
  // loads g anyway); the simd reduction lets its additions run in vector lanes, as a sum needs reassociating.
  T squares = T(0);
#pragma omp simd reduction(+ : squares) reduction(max : max_m, max_v, max_vmax)
  for (int64_t i = 0; i < n; ++i) {
    squares += g[i] * g[i];
    T gi = g[i] * grad_mul;  // unscale (and negate for maximize)
    if (kMode == kAdamL2) gi = gi + wd * p[i];  // L2: the decay enters the moments (not written back to .grad)
    if (kMode == kAdamWTorch) p[i] = p[i] * torch_decay;
    m[i] = (kFromGrad ? gi : m[i]) + lerp_coeff * (gi - m[i]);  // = b1*m + (1-b1)*g, in torch's lerp form
    v[i] = v[i] * b2 + one_minus_b2 * gi * gi;
    T vi = v[i];
    if (kAmsgrad) {
      // the max of the raw v, bias correction after; NaN in either stays NaN, as torch.maximum
      vmax[i] = vmax[i] < vi || vi != vi ? vi : vmax[i];
      vi = vmax[i];
    }
    const T sqrt_vi = std::sqrt(vi);
    if constexpr (kRoot) root[i] = sqrt_vi;
    if (kMode == kAdamWTorch) {
      p[i] = p[i] - step_size * (m[i] / (sqrt_vi / bc2_sqrt + eps));
    } else {  // ORT/HF placement: eps outside the corrected sqrt, correction folded into the step size
      p[i] = p[i] - step_size * (m[i] / (sqrt_vi + eps));
      if (kMode == kAdamWTransformers) p[i] = p[i] - hf_decay * p[i];
    }
    if constexpr (kAmax) {
      max_m = std::max(max_m, abs_bits(m[i]));
      max_v = std::max(max_v, abs_bits(v[i]));
      if (kAmsgrad) max_vmax = std::max(max_vmax, abs_bits(vmax[i]));
    }
  }
  return {max_m, max_v, max_vmax, double(squares)};
}

template <typename T, int64_t kMode, bool kAmsgrad, bool kAmax, bool kRoot = false>
BlockMax adam_loop(T* __restrict__ p, const T* __restrict__ g, T* __restrict__ m, T* __restrict__ v,
                   T* __restrict__ vmax, int64_t n, const TensorWork& w, const Hyper& h,
                   T* __restrict__ root = nullptr) {
  return Lerp<T>(h.beta1).from_grad
             ? adam_loop_of<T, kMode, kAmsgrad, kAmax, kRoot, true>(p, g, m, v, vmax, n, w, h, root)
             : adam_loop_of<T, kMode, kAmsgrad, kAmax, kRoot, false>(p, g, m, v, vmax, n, w, h, root);
}

template <typename T>
struct Scratch {
  T p[kBlock], g[kBlock], m[kBlock], v[kBlock], vmax[kBlock], root[kBlock];
  T u[kBlock];  // the decoded sqrt(v) of the stored codes that a relative 4-bit exp_avg is coded against
  uint32_t rnd[kBlock];  // the random bits of low-bit and fp8 states (moment_random_bits)
  // Tensors with both moments fp8 (update_fp8) hold two blocks of 256 of m, v and sqrt(v) in the first 512 elements
  // of m, v and root, used in turn (slots 0 and 1), and the block updated last, whose codes are not written yet
  // (pending.w: its tensor, or nullptr).
  float* fp8_m(int slot) { return reinterpret_cast<float*>(m) + 256 * slot; }
  float* fp8_v(int slot) { return reinterpret_cast<float*>(v) + 256 * slot; }
  float* fp8_root(int slot) { return reinterpret_cast<float*>(root) + 256 * slot; }
  struct Pending {
    const TensorWork* w = nullptr;
    int64_t off = 0, len = 0;
    uint32_t max_m = 0, max_root = 0;  // the bits of the block's largest |m| and sqrt(v)
    int slot = 0;
  } pending;
};

// second_moment: the state is exp_avg_sq or max_exp_avg_sq, whose scaled fp16 and low-bit codes hold sqrt(v).
template <typename T>
void load_state(const void* base, at::ScalarType type, const float* scales, int64_t off, int64_t n, T* dst,
                const LowBit* low_bit = nullptr, bool second_moment = false, const Fp8* fp8 = nullptr) {
  if constexpr (std::is_same_v<T, float>) {
    if (fp8) {
      fp8_load(*fp8, second_moment, base, scales, off, n, dst);
      return;
    }
    if (low_bit) {
      low_bit_load(*low_bit, second_moment, static_cast<const uint8_t*>(base), scales, off, n, dst);
      return;
    }
  }
  T mul = scales ? T(1) / T(scales[off / kBlock]) : T(1);
  const char* src = static_cast<const char*>(base) + off * c10::elementSize(type);
  if constexpr (std::is_same_v<T, float>) {
    if (scales && second_moment && spec::kFp16SqrtSecondMoment) {  // (scales: an fp16 state) v = u * u
      half_to_float<true>(reinterpret_cast<const uint16_t*>(src), n, dst, mul);
      return;
    }
  }
  load<T>(src, type, n, dst, mul);
}

template <typename T>
void store_state(const T* src, void* base, at::ScalarType type, float* scales, int64_t off, int64_t n,
                 uint32_t amax_bits, const LowBit* low_bit = nullptr, bool second_moment = false,
                 const float* root = nullptr, const Fp8* fp8 = nullptr, const uint32_t* rnd = nullptr) {
  char* dst = static_cast<char*>(base) + off * c10::elementSize(type);
  if constexpr (std::is_same_v<T, float>) {
    if (fp8) {
      fp8_store(*fp8, second_moment, src, root, off, n, base, scales, rnd);
      return;
    }
    if (low_bit) {
      low_bit_store(*low_bit, second_moment, src, root, off, n, static_cast<uint8_t*>(base), scales, rnd);
      return;
    }
    if (scales && second_moment && spec::kFp16SqrtSecondMoment) {
      // sqrt(v) as the update took it (root), else taken here: the same correctly rounded float32 sqrt either way.
      // max sqrt(v) = sqrt(max v): sqrt is monotonic and correctly rounded.
      float u[kBlock];
      if (root == nullptr) {
        for (int64_t i = 0; i < n; ++i) u[i] = std::sqrt(src[i]);
        root = u;
      }
      store_fp16_scaled(root, n, reinterpret_cast<uint16_t*>(dst), scales + off / kBlock,
                        float_to_bits(std::sqrt(bits_to_float(amax_bits))) & 0x7FFFFFFFu, /*no_zero=*/true);
      return;
    }
    if (scales) {
      store_fp16_scaled(src, n, reinterpret_cast<uint16_t*>(dst), scales + off / kBlock, amax_bits);
      return;
    }
  }
  store<T>(src, n, dst, type);
}

// The block [off, off + n) of a tensor as T values: the storage itself when it already holds plain T values
// (fp32 and fp64 tensors are updated in place), else the scratch array filled by conversion.
template <typename T>
T* stage(const void* base, at::ScalarType type, const float* scales, int64_t off, int64_t n, T* scratch,
         const LowBit* low_bit = nullptr, bool second_moment = false, const Fp8* fp8 = nullptr) {
  if (type == c10::CppTypeToScalarType<T>::value && scales == nullptr) {
    return const_cast<T*>(static_cast<const T*>(base)) + off;
  }
  load_state<T>(base, type, scales, off, n, scratch, low_bit, second_moment, fp8);
  return scratch;
}

// The update of the block [off, off + n) through scratch arrays: every moment that is not plain T is converted into
// one, updated, and stored back. p, g: the block's params and gradients as staged.
template <typename T, int64_t kMode, bool kAmsgrad>
void update_staged(const TensorWork& w, const Hyper& h, int64_t off, int64_t n, Scratch<T>& s, T* p, T* g,
                   double& grad_squares) {
  // A 4-bit exp_avg holds m / sqrt(v) (ort_optim/_spec.py, EXP_AVG_RELATIVE): it is decoded through exp_avg_sq's
  // codes as stored with it (decoded with v, in one pass), and coded after exp_avg_sq's new codes are written,
  // against the sqrt(v) they read back as (which their encoder gives).
  bool relative = false;
  T* m;
  if constexpr (std::is_same_v<T, float>) relative = w.exp_avg_low_bit && w.exp_avg_low_bit->relative;
  if constexpr (std::is_same_v<T, float>) {
    if (relative) {
      low_bit_relative_load(*w.exp_avg_low_bit, static_cast<const uint8_t*>(w.exp_avg), w.exp_avg_scale,
                            static_cast<const uint8_t*>(w.exp_avg_sq), w.exp_avg_sq_scale, off, n, s.m, s.v, s.u);
    }
  }
  m = relative ? s.m
               : stage<T>(w.exp_avg, w.exp_avg_type, w.exp_avg_scale, off, n, s.m, w.exp_avg_low_bit, false,
                          w.exp_avg_fp8);
  T* v = relative ? s.v
                  : stage<T>(w.exp_avg_sq, w.exp_avg_sq_type, w.exp_avg_sq_scale, off, n, s.v, w.exp_avg_sq_low_bit,
                             true, w.exp_avg_sq_fp8);
  T* vmax = kAmsgrad ? stage<T>(w.max_exp_avg_sq, w.exp_avg_sq_type, w.max_exp_avg_sq_scale, off, n, s.vmax,
                                w.exp_avg_sq_low_bit, true, w.exp_avg_sq_fp8)
                     : s.vmax;
  BlockMax max;
  // A low-bit or scaled fp16 second moment stores the square root that the update takes: kept (in s.root), it is
  // taken once.
  const float* root = nullptr;
  if constexpr (std::is_same_v<T, float>) {
    // (the block maxima are the fp16 quantiser's; low-bit and fp8 states find their own per block)
    const bool amax = (w.exp_avg_scale && !w.exp_avg_low_bit && !w.exp_avg_fp8) ||
                      (w.exp_avg_sq_scale && !w.exp_avg_sq_low_bit && !w.exp_avg_sq_fp8);
    if (w.exp_avg_sq_low_bit || (w.exp_avg_sq_scale && spec::kFp16SqrtSecondMoment)) {
      root = s.root;
      max = amax ? adam_loop<T, kMode, kAmsgrad, true, true>(p, g, m, v, vmax, n, w, h, s.root)
                 : adam_loop<T, kMode, kAmsgrad, false, true>(p, g, m, v, vmax, n, w, h, s.root);
    } else if (amax) {
      max = adam_loop<T, kMode, kAmsgrad, true>(p, g, m, v, vmax, n, w, h);
    } else {
      max = adam_loop<T, kMode, kAmsgrad, false>(p, g, m, v, vmax, n, w, h);
    }
  } else {
    max = adam_loop<T, kMode, kAmsgrad, false>(p, g, m, v, vmax, n, w, h);
  }
  grad_squares = max.grad_squares;
  if constexpr (std::is_same_v<T, float>) {  // one hash per element for both moments (_spec.MOMENT_RANDOM_BITS)
    if (w.exp_avg_fp8 || w.exp_avg_sq_fp8 || w.exp_avg_low_bit || w.exp_avg_sq_low_bit) {
      moment_random_bits(m, off, n, w.step, s.rnd);
    }
  }

  // Write back what was staged.
  if (m == s.m && !relative) {
    store_state<T>(s.m, w.exp_avg, w.exp_avg_type, w.exp_avg_scale, off, n, max.m, w.exp_avg_low_bit, false, nullptr,
                   w.exp_avg_fp8, s.rnd);
  }
  if constexpr (std::is_same_v<T, float>) {
    if (relative) {  // exp_avg_sq, and the sqrt(v) its codes read back as into s.u
      low_bit_store(*w.exp_avg_sq_low_bit, true, s.v, kAmsgrad ? nullptr : root, off, n,
                    static_cast<uint8_t*>(w.exp_avg_sq), w.exp_avg_sq_scale, s.rnd, s.u);
    }
  }
  if (v == s.v && !relative) {
    store_state<T>(s.v, w.exp_avg_sq, w.exp_avg_sq_type, w.exp_avg_sq_scale, off, n, max.v, w.exp_avg_sq_low_bit, true,
                   kAmsgrad ? nullptr : root, w.exp_avg_sq_fp8, s.rnd);
  }
  if (kAmsgrad && vmax == s.vmax) {
    store_state<T>(s.vmax, w.max_exp_avg_sq, w.exp_avg_sq_type, w.max_exp_avg_sq_scale, off, n, max.vmax,
                   w.exp_avg_sq_low_bit, true, root, w.exp_avg_sq_fp8, s.rnd);
  }
  if constexpr (std::is_same_v<T, float>) {
    if (relative) {
      low_bit_relative_store(*w.exp_avg_low_bit, s.m, s.u, off, n, static_cast<uint8_t*>(w.exp_avg), w.exp_avg_scale,
                             s.rnd);
    }
  }
}

// The param (from the master, or the staged copy) and the unscaled gradient back into their tensors.
template <typename T>
void write_back(const TensorWork& w, const Hyper& h, int64_t off, int64_t n, Scratch<T>& s, T* p, T* g) {
  // With a master, p is the master itself (updated in place) and the param receives it rounded.
  if (w.master || p == s.p) {
    char* dst = static_cast<char*>(w.param) + off * c10::elementSize(w.param_type);
    bool stored = false;
    if constexpr (std::is_same_v<T, float>) {
      if (w.stochastic) {  // (and then on to the gradient's write-back below, as for every other param)
        float_to_bf16_stochastic(p, n, reinterpret_cast<uint16_t*>(dst), w.round_key, off);
        stored = true;
      }
    }
    if (!stored) store<T>(p, n, dst, w.param_type);
  }
  // The unscaled gradient back into .grad, as torch's fused AdamW: g / grad_scale (a division, not the multiplication
  // by inv_grad_scale, which may hold the clip coefficient too), rounded to the gradient's dtype. g still holds the
  // gradient as loaded (adam_loop only reads it), in L1: the cost is the write.
  if (h.grad_scale != 0.0) {
    const T scale = T(h.grad_scale);
    char* dst = static_cast<char*>(w.grad) + off * c10::elementSize(w.grad_type);
    if constexpr (std::is_same_v<T, float>) {
      // A power-of-two scale (GradScaler's are) has an exact reciprocal (unless the scale is below 2^-127: then it
      // overflows), and g * (1 / scale) rounds the same real number as g / scale, so it gives the same bits: a
      // multiply, fused into the fp16/bf16 conversion.
      int exponent;
      const float inv = 1.0f / scale;
      if (std::frexp(scale, &exponent) == 0.5f && std::isfinite(inv)) {
        if (g != s.g) {
          for (int64_t i = 0; i < n; ++i) g[i] = g[i] * inv;
        } else if (w.grad_type == at::kHalf) {
          float_to_half(s.g, n, reinterpret_cast<uint16_t*>(dst), inv);
        } else {
          float_to_bf16(s.g, n, reinterpret_cast<uint16_t*>(dst), inv);
        }
        return;
      }
    }
    for (int64_t i = 0; i < n; ++i) g[i] = g[i] / scale;
    if (g == s.g) store<T>(s.g, n, dst, w.grad_type);
  }
}

// fp8 moments (both), without amsgrad: each block of 256 (one scale of each moment) is updated with its block
// maxima found by the update's loop, and coded by one loop that hashes each element once and codes both moments
// (Fp8PairCoder). The update is bound by its divisions and square root, the coding by the other vector ports: with
// AVX-512 one loop updates a block while it codes the block before, so the two overlap. The same bits as staging.
static_assert(spec::kFp8Block == 256, "fp8 blocks of 256");

// The sum of squares of g[0, n), as adam_loop adds it up (the same simd reduction over the same block).
inline double square_sum(const float* __restrict__ g, int64_t n) {
  float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
  for (int64_t i = 0; i < n; ++i) squares += g[i] * g[i];
  return double(squares);
}

// A block's sum of squares of the gradients as loaded (the plain step's norm), added up by the coded loops, which
// load the gradients anyway (a pass of its own took 3-8% of the coded step), in square_sum's order: element i in
// lane i % 16 in element order, then the lanes one after the other from +0, as GCC vectorises the simd reduction
// (the same bits; a compiler that reduces in another order would differ by rounding, which
// tests/fused_adam/test_state_cache.py would show). whole: every element was added, in order; else square_sum reads
// the block again.
struct SquareSum {
#ifdef ORT_OPTIM_FP8_AVX512
  __m512 lanes = _mm512_setzero_ps();  // (Adam16::moments adds to it)
#endif
  bool whole = false;

  double total(const float* g, int64_t n) const {
#ifdef ORT_OPTIM_FP8_AVX512
    if (whole) {
      alignas(64) float lane[16];
      _mm512_store_ps(lane, lanes);
      float sum = 0.0f;
      for (const float x : lane) sum += x;
      return double(sum);
    }
#endif
    return square_sum(g, n);
  }
};

#ifdef ORT_OPTIM_FP8_AVX512
// adam_loop<float, kMode, false, true, true> on 16 elements: the same operations in the same order, each rounded
// separately (so the same bits); p updated in place, the moments from mi and vi into m and v, root = sqrt(v), the
// maxima of |m| and |v| (abs_bits) into max_m and max_v.
template <int64_t kMode>
struct Adam16 {
  __m512 grad_mul, b2, lerp_coeff, one_minus_b2, eps, wd, step_size, bc2_sqrt, torch_decay, hf_decay;
  __mmask16 lerp_from_grad;  // all lanes take the lerp's base from g (Lerp: its second form), or none

  Adam16(const TensorWork& w, const Hyper& h)
      : grad_mul(_mm512_set1_ps(float(h.grad_mul))),
        b2(_mm512_set1_ps(float(h.beta2))),
        lerp_coeff(_mm512_set1_ps(Lerp<float>(h.beta1).coeff)),
        one_minus_b2(_mm512_set1_ps(float(1.0 - h.beta2))),
        eps(_mm512_set1_ps(float(h.eps))),
        wd(_mm512_set1_ps(float(h.weight_decay))),
        step_size(_mm512_set1_ps(float(w.step_size))),
        bc2_sqrt(_mm512_set1_ps(float(w.bc2_sqrt))),
        torch_decay(_mm512_set1_ps(float(1.0 - h.lr * h.weight_decay))),
        hf_decay(_mm512_set1_ps(float(h.lr * h.weight_decay))),
        lerp_from_grad(Lerp<float>(h.beta1).from_grad ? 0xFFFF : 0) {}

  // The moments of 16 elements: from mi and vi (as decoded) into m and v; the maxima of |m| into max_m, the
  // gradients' squares into squares (SquareSum's lanes, kept in a register by the caller's loop).
  inline void moments(const float* p, const float* g, __m512 mi, __m512 vi, float* m, float* v, __m512i& max_m,
                      __m512& squares) const {
    const __m512 g_loaded = _mm512_loadu_ps(g);
    squares = _mm512_add_ps(squares, _mm512_mul_ps(g_loaded, g_loaded));
    __m512 gi = _mm512_mul_ps(g_loaded, grad_mul);
    if (kMode == kAdamL2) gi = _mm512_add_ps(gi, _mm512_mul_ps(wd, _mm512_loadu_ps(p)));
    mi = _mm512_add_ps(_mm512_mask_blend_ps(lerp_from_grad, mi, gi), _mm512_mul_ps(lerp_coeff, _mm512_sub_ps(gi, mi)));
    vi = _mm512_add_ps(_mm512_mul_ps(vi, b2), _mm512_mul_ps(_mm512_mul_ps(one_minus_b2, gi), gi));
    _mm512_storeu_ps(m, mi);
    _mm512_storeu_ps(v, vi);
    max_m = _mm512_max_epu32(max_m, _mm512_and_si512(_mm512_castps_si512(mi), _mm512_set1_epi32(0x7FFFFFFF)));
  }

  // Then the params of the same 16 elements: p updated in place, root = sqrt(v), the maxima of |sqrt(v)| into
  // max_root. kRawMax: the maxima of sqrt(v)'s bits as they are, without the sign bit cleared: the same where no
  // sqrt(v) is NaN (v >= +0 in a step: sqrt(v) is +0 or above), and a NaN of either sign reads as non-finite either
  // way (for a caller that only tells finite maxima from the others).
  template <bool kRawMax = false>
  inline void params(float* p, const float* m, const float* v, float* root, __m512i& max_root) const {
    __m512 pi = _mm512_loadu_ps(p);
    if (kMode == kAdamWTorch) pi = _mm512_mul_ps(pi, torch_decay);
    const __m512 mi = _mm512_loadu_ps(m), sqrt_vi = _mm512_sqrt_ps(_mm512_loadu_ps(v));
    if (kMode == kAdamWTorch) {
      pi = _mm512_sub_ps(pi, _mm512_mul_ps(step_size, _mm512_div_ps(mi, _mm512_add_ps(_mm512_div_ps(sqrt_vi, bc2_sqrt),
                                                                                        eps))));
    } else {
      pi = _mm512_sub_ps(pi, _mm512_mul_ps(step_size, _mm512_div_ps(mi, _mm512_add_ps(sqrt_vi, eps))));
      if (kMode == kAdamWTransformers) pi = _mm512_sub_ps(pi, _mm512_mul_ps(hf_decay, pi));
    }
    _mm512_storeu_ps(p, pi);
    _mm512_storeu_ps(root, sqrt_vi);
    max_root = _mm512_max_epu32(max_root, kRawMax ? _mm512_castps_si512(sqrt_vi)
                                                  : _mm512_and_si512(_mm512_castps_si512(sqrt_vi),
                                                                     _mm512_set1_epi32(0x7FFFFFFF)));
  }
};
#endif

// Writes the codes of the pending fp8 block (Scratch::pending), if any.
inline void store_pending_fp8(Scratch<float>& s) {
  auto& b = s.pending;
  if (b.w == nullptr) return;
  const TensorWork& w = *b.w;
  fp8_store_pair(*w.exp_avg_fp8, *w.exp_avg_sq_fp8, s.fp8_m(b.slot), s.fp8_v(b.slot), s.fp8_root(b.slot), b.max_m,
                 b.max_root, b.off, b.len, w.step, w.exp_avg, w.exp_avg_scale, w.exp_avg_sq, w.exp_avg_sq_scale,
                 s.rnd);
  b.w = nullptr;
}

#ifdef ORT_OPTIM_FP8_AVX512
// The 16 values of an fp8 vector that fp8_values16 leaves (e5m2 with an inf or NaN code), element by element. Out of
// line: inlined, the rare fallback's code sat in the decode loop and slowed every vector.
template <class Values>
__attribute__((noinline, cold)) __m512 fp8_scalar16(const Values& values, int64_t i) {
  alignas(64) float x[16];
  for (int j = 0; j < 16; ++j) x[j] = values(i + j);
  return _mm512_load_ps(x);
}
#endif

// The update of the block [off, off + n) (in blocks of 256) of a tensor whose moments are both fp8 (FM and FV). Each
// block of 256 is updated and left pending: its codes are written while the next one is updated (by the same thread:
// its next block, or the first block of its next work item with the same formats), in one loop that also decodes the
// block it updates, where both are whole blocks of 16-lane vectors and the pending one is regular (Fp8PairCoder);
// else before the update (store_pending_fp8). The blocks' m, v and sqrt(v) go to two slots used in turn. p, g: the
// block's params and gradients as staged. The caller writes the last pending block when its work items are done.
template <int64_t kMode, class FM, class FV>
void update_fp8(const TensorWork& w, const Hyper& h, int64_t off, int64_t n, Scratch<float>& s, float* p,
                const float* g, SquareSum& squares) {
  constexpr int64_t kB = spec::kFp8Block;
#ifdef ORT_OPTIM_FP8_AVX512
  const Adam16<kMode> adam16(w, h);
  squares.whole = n % kB == 0;  // (every block a whole one: each is updated by Adam16)
  __m512 squares16 = _mm512_setzero_ps();
#endif
  for (int64_t o = 0; o < n; o += kB) {
    const int64_t len = std::min(kB, n - o);
    auto& pending = s.pending;
    const int slot = pending.w != nullptr && pending.slot == 0 ? 1 : 0;
    float *m = s.fp8_m(slot), *v = s.fp8_v(slot), *root = s.fp8_root(slot);
    uint32_t max_m = 0, max_root = 0;
    bool done = false;
#ifdef ORT_OPTIM_FP8_AVX512
    if (len == kB) {
      // The moments, decoded in their loop, but for a flagged exp_avg_sq (an overflowed v): decoded before.
      __m512i max_m16 = _mm512_setzero_si512();
      if (overflow_flagged(w.exp_avg_sq_scale[(off + o) / kB])) {
        fp8_load(*w.exp_avg_fp8, false, w.exp_avg, w.exp_avg_scale, off + o, len, m);
        fp8_load(*w.exp_avg_sq_fp8, true, w.exp_avg_sq, w.exp_avg_sq_scale, off + o, len, v);
        for (int64_t i = 0; i < kB; i += 16) {
          adam16.moments(p + o + i, g + o + i, _mm512_loadu_ps(m + i), _mm512_loadu_ps(v + i), m + i, v + i, max_m16,
                         squares16);
        }
      } else {
        const float scale_m = w.exp_avg_scale[(off + o) / kB], scale_v = w.exp_avg_sq_scale[(off + o) / kB];
        const uint8_t* codes_m = static_cast<const uint8_t*>(w.exp_avg) + off + o;
        const uint8_t* codes_v = static_cast<const uint8_t*>(w.exp_avg_sq) + off + o;
        const __m512 mul_m = _mm512_set1_ps(fp8_multiplier<FM::kMb>(scale_m)),
                     mul_v = _mm512_set1_ps(fp8_multiplier<FV::kMb>(scale_v));
        const Fp8Values<FM::kMb, FM::kBias, false> values_m{codes_m, scale_m, false};
        const Fp8Values<FV::kMb, FV::kBias, true> values_v{codes_v, scale_v, false};
        for (int64_t i = 0; i < kB; i += 16) {
          __m512 mi, vi;
          if (!fp8_values16<FM::kMb, false>(codes_m + i, mul_m, mi)) mi = fp8_scalar16(values_m, i);
          if (!fp8_values16<FV::kMb, true>(codes_v + i, mul_v, vi)) vi = fp8_scalar16(values_v, i);
          adam16.moments(p + o + i, g + o + i, mi, vi, m + i, v + i, max_m16, squares16);
        }
      }
      max_m = _mm512_reduce_max_epu32(max_m16);
      // The params: the divisions and square roots, with the other ports' work of the pending block's codes
      // (coder; nullptr: none).
      const auto update = [&](Fp8PairCoder<FM, FV>* coder) {
        const float *pm = s.fp8_m(pending.slot), *proot = s.fp8_root(pending.slot);
        __m512i max_root16 = _mm512_setzero_si512();
        for (int64_t i = 0; i < kB; i += 16) {
          adam16.params(p + o + i, m + i, v + i, root + i, max_root16);
          if (coder) coder->code16(pm + i, proot + i, i);
        }
        max_root = _mm512_reduce_max_epu32(max_root16);
      };
      if (pending.w != nullptr && pending.len == kB && pending.w->exp_avg_fp8 == w.exp_avg_fp8 &&
          pending.w->exp_avg_sq_fp8 == w.exp_avg_sq_fp8) {
        const TensorWork& pw = *pending.w;
        Fp8PairCoder<FM, FV> coder(pending.max_m, pending.max_root, s.fp8_m(pending.slot), pending.off, pw.step,
                                   static_cast<uint8_t*>(pw.exp_avg), static_cast<uint8_t*>(pw.exp_avg_sq));
        if (coder.regular()) {
          update(&coder);
          coder.write_scales(pw.exp_avg_scale, pw.exp_avg_sq_scale, pending.off / kB);
          pending.w = nullptr;
          done = true;
        }
      }
      if (!done) {
        store_pending_fp8(s);
        update(nullptr);
        done = true;
      }
    }
#endif
    if (!done) {
      store_pending_fp8(s);
      fp8_load(*w.exp_avg_fp8, false, w.exp_avg, w.exp_avg_scale, off + o, len, m);
      fp8_load(*w.exp_avg_sq_fp8, true, w.exp_avg_sq, w.exp_avg_sq_scale, off + o, len, v);
      const BlockMax max = adam_loop<float, kMode, false, true, true>(p + o, g + o, m, v, nullptr, len, w, h, root);
      max_m = max.m;
      // (sqrt is monotonic and correctly rounded: the largest sqrt(v) is the square root of the largest v)
      max_root = abs_bits(std::sqrt(bits_to_float(max.v)));
    }
    pending = {&w, off + o, len, max_m, max_root, slot};
  }
#ifdef ORT_OPTIM_FP8_AVX512
  squares.lanes = squares16;
#endif
}

// 4-bit moments (exp_avg relative to exp_avg_sq, sqrt(v) rounded stochastically), without amsgrad, in a block of
// whole 128-element blocks: the same bits as staging (update_staged), in fewer passes that overlap. Per 128-element
// block b: one loop decodes b's moments (one multishift and one permute of a per-block table of the decoded values
// per moment), updates b (Adam16: the divisions and square roots, bound by the divider) and writes the exp_avg codes
// of block b - 1 (bucketed searches and permutes: the other vector ports); a second loop writes b's exp_avg_sq codes
// (Coder4) and the ratios r = m / u to the sqrt(v) u they read back as, with r's block maximum. A block whose
// exp_avg_sq scale flags an overflowed v (or is NaN) is decoded before its loop (low_bit_relative_load); a block
// holding an overflowed v or a NaN, and an exp_avg block of non-finite ratios, take the plain stores. false (nothing
// done) where the tensor or block does not fit, or a map has no bucketed search (staged then).
#if defined(ORT_OPTIM_FP8_AVX512) && defined(ORT_OPTIM_LOW_BIT_AVX512)
template <int64_t kMode>
bool update_q4(const TensorWork& w, const Hyper& h, int64_t off, int64_t n, Scratch<float>& s, float* p,
               const float* g, SquareSum& squares) {
  constexpr int64_t kB = 128;
  if (!w.exp_avg_low_bit || w.exp_avg_sq_low_bit != w.exp_avg_low_bit) return false;
  const LowBit& f = *w.exp_avg_low_bit;
  if (f.bits != 4 || f.block != kB || !f.relative || !f.sq_stochastic || w.step == 0 || n % kB != 0 ||
      !f.exp_avg.buckets_ready(false) || !f.exp_avg_sq_sr.buckets_ready(true)) {
    return false;
  }
  auto* codes_m = static_cast<uint8_t*>(w.exp_avg);
  auto* codes_v = static_cast<uint8_t*>(w.exp_avg_sq);
  store_pending_fp8(s);  // (its block is in s.m, s.v and s.root)
  const Adam16<kMode> adam16(w, h);
  __m512 squares16 = _mm512_setzero_ps();  // (squares' lanes, in a register)
  float* r = s.vmax;  // the ratios r = m / u that exp_avg's codes hold (no amsgrad: vmax is free)
  const float* v_decode = f.exp_avg_sq_sr.decode();
  const __m512 v_levels = _mm512_load_ps(v_decode);
  // the decoders' tables (low_bit_relative_load's: exp_avg_sq's levels, the same as its stochastic map's)
  const __m512 old_v_levels = _mm512_load_ps(f.exp_avg_sq.decode()), old_m_levels = _mm512_load_ps(f.exp_avg.decode());
  const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF);
  // The random bits of both moments' stochastic rounding (one hash per element: a chain of two multiplies) are taken
  // in a loop of their own before the loops that code: in those, the uops that wait on the multiplies would fill the
  // scheduler (measured with the former two hashes per moment: 4-5% slower in the update loop, or in the coding loops).
  using CoderV = Coder4<false, true, true>;
  using CoderM = Coder4<true, false, true>;
  CoderV coder_v(f.exp_avg_sq_sr, 0.0f);
  CoderM coder_m(f.exp_avg, 0.0f);
  bool pending = false;  // block b - kB's exp_avg codes are written in block b's update loop
  for (int64_t b = 0; b <= n; b += kB) {  // (b == n: the last block's exp_avg codes)
    __m512i max_m16 = _mm512_setzero_si512(), max_root16 = _mm512_setzero_si512();
    const auto code16 = [&](int64_t i) {  // exp_avg's codes of the pending block's elements [i, i + 16)
      const int64_t j = b - kB + i;
      CoderM::store4(coder_m.codes4(_mm512_loadu_ps(r + j), CoderM::random16(s.rnd + j)), codes_m + (off + j) / 2);
    };
    if (b == n) {
      for (int64_t i = 0; i < kB && pending; i += 16) code16(i);
      break;
    }
    // Block b's update, with the pending block's codes. Its moments are decoded in the loop that updates them (the
    // same operations as low_bit_relative_load's, where u = |level * s| is level * s itself: the block's exp_avg_sq
    // scale s is +0 or above, no NaN), but for a block whose scale flags an overflowed v (its sign bit) or is NaN:
    // decoded before, by low_bit_relative_load.
    const float old_scale_v = f.scale(w.exp_avg_sq_scale, (off + b) / kB);
    const auto update = [&](auto decoded) {
      // (the decoded values of the block's 16 codes, level * s, and v's, (level * s)^2: the products of every element,
      // taken once per level)
      const __m512 u_table = _mm512_mul_ps(old_v_levels, _mm512_set1_ps(old_scale_v)),
                   v_table = _mm512_mul_ps(u_table, u_table),
                   q_table = _mm512_mul_ps(old_m_levels, _mm512_set1_ps(f.scale(w.exp_avg_scale, (off + b) / kB)));
      for (int64_t i = 0; i < kB; i += 16) {
        const int64_t j = b + i;
        __m512 mi, vi;
        if constexpr (decltype(decoded)::value) {
          mi = _mm512_loadu_ps(s.m + j);
          vi = _mm512_loadu_ps(s.v + j);
        } else {
          const __m512i code_v = nibbles4(codes_v + (off + j) / 2);
          const __m512 u = _mm512_permutexvar_ps(code_v, u_table);
          vi = _mm512_permutexvar_ps(code_v, v_table);
          const __m512 q = _mm512_permutexvar_ps(nibbles4(codes_m + (off + j) / 2), q_table);
          // (not equal, unordered: a NaN q multiplies, as in decode_block)
          mi = _mm512_maskz_mul_ps(_mm512_cmp_ps_mask(q, _mm512_setzero_ps(), _CMP_NEQ_UQ), q, u);
        }
        adam16.moments(p + j, g + j, mi, vi, s.m + j, s.v + j, max_m16, squares16);
        adam16.template params<true>(p + j, s.m + j, s.v + j, s.root + j, max_root16);
        if (pending) code16(i);
      }
    };
    if (float_to_bits(old_scale_v) > 0x7F800000u) {  // (a sign bit, or NaN)
      low_bit_relative_load(f, codes_m, w.exp_avg_scale, codes_v, w.exp_avg_sq_scale, off + b, kB, s.m + b, s.v + b,
                            s.u + b);
      update(std::true_type{});
    } else {
      update(std::false_type{});
    }
    pending = false;
    moment_random_bits(s.m + b, off + b, kB, w.step, s.rnd + b);
    const uint32_t amax_root = _mm512_reduce_max_epu32(max_root16);
    if (amax_root >= 0x7F800000u) {  // an overflowed v, or a NaN
      low_bit_store(f, true, s.v + b, s.root + b, off + b, kB, codes_v, w.exp_avg_sq_scale, s.rnd + b, s.u + b);
      low_bit_relative_store(f, s.m + b, s.u + b, off + b, kB, codes_m, w.exp_avg_scale, s.rnd + b);
      continue;
    }
    const float scale_v = bits_to_float(f.scale_bits(amax_root, true, s.rnd + b));
    f.store_scale(w.exp_avg_sq_scale, (off + b) / kB, scale_v);
    coder_v.set_inverse(scale_v > 0.0f ? 1.0f / scale_v : 0.0f);
    const __m512 u_table = _mm512_mul_ps(v_levels, _mm512_set1_ps(scale_v));  // (level * s of each code, as above)
    __m512i max_r16 = _mm512_setzero_si512();
    // exp_avg_sq's codes of block b, u, the sqrt(v) they read back as, and r = m / u (block_ratio_amax: 0 where u is
    // 0). u = level * s is 0 nowhere but in a zero block (s = 0: the levels are 0.001 and above, s at least
    // MIN_SQRT_V, finite), whose ratios are all 0: the division without the test of u.
    const auto code_v = [&](auto zero_block) {
      for (int64_t i = 0; i < kB; i += 16) {
        const int64_t j = b + i;
        // (sqrt(v) of a step: +0 or above, finite here)
        const __m512i code = coder_v.template codes4<true>(_mm512_loadu_ps(s.root + j), CoderV::random16(s.rnd + j));
        CoderV::store4(code, codes_v + (off + j) / 2);
        if constexpr (decltype(zero_block)::value) {
          _mm512_storeu_ps(r + j, _mm512_setzero_ps());
        } else {
          const __m512 u = _mm512_permutexvar_ps(code, u_table);
          const __m512 x = _mm512_div_ps(_mm512_loadu_ps(s.m + j), u);
          _mm512_storeu_ps(r + j, x);
          max_r16 = _mm512_max_epu32(max_r16, _mm512_and_si512(_mm512_castps_si512(x), abs_mask));
        }
      }
    };
    scale_v > 0.0f ? code_v(std::false_type{}) : code_v(std::true_type{});
    const uint32_t scale_m_bits = f.scale_bits(_mm512_reduce_max_epu32(max_r16), false, s.rnd + b);
    // non-finite ratios: u again (as above, from the codes written), for the plain store
    if (scale_m_bits >= 0x7F800000u) {
      for (int64_t i = 0; i < kB; ++i) {
        s.u[b + i] = v_decode[(codes_v[(off + b + i) / 2] >> ((i & 1) * 4)) & 15] * scale_v;
      }
      low_bit_relative_store(f, s.m + b, s.u + b, off + b, kB, codes_m, w.exp_avg_scale, s.rnd + b);
      continue;
    }
    const float scale_m = bits_to_float(scale_m_bits);
    f.store_scale(w.exp_avg_scale, (off + b) / kB, scale_m);
    coder_m.set_inverse(scale_m > 0.0f ? 1.0f / scale_m : 0.0f);
    pending = true;
  }
  squares.lanes = squares16;
  return true;
}
#endif

#if defined(ORT_OPTIM_LOW_BIT_FUSED_Q8) && defined(ORT_OPTIM_FP8_AVX512)
// 8-bit moments, without amsgrad, in a block of whole 256-element blocks: the same bits as staging (update_staged),
// with the coding of each block overlapping the update of the next. After the decode of the whole block: per
// 256-element block b, one loop updates b (Adam16: the divisions and square roots, bound by the divider) and writes
// both moments' codes of block b - 1 (Coder8::code16: loads, compares and permutes, the other ports); then b's random
// bits and scales. A block whose m or sqrt(v) is not finite (an overflowed v, a NaN) takes the plain
// stores. false (nothing done) where the tensor or block does not fit (staged then).
template <int64_t kMode>
bool update_q8(const TensorWork& w, const Hyper& h, int64_t off, int64_t n, Scratch<float>& s, float* p,
               const float* g, SquareSum& squares) {
  constexpr int64_t kB = 256;
  if (!w.exp_avg_low_bit || w.exp_avg_sq_low_bit != w.exp_avg_low_bit) return false;
  const LowBit& f = *w.exp_avg_low_bit;
  if (f.bits != 8 || f.block != kB || f.relative || f.sq_stochastic || f.bf16_scales || w.step == 0 || n % kB != 0) {
    return false;
  }
  auto* codes_m = static_cast<uint8_t*>(w.exp_avg);
  auto* codes_v = static_cast<uint8_t*>(w.exp_avg_sq);
  store_pending_fp8(s);  // (its block is in s.m, s.v and s.root)
  low_bit_load(f, false, codes_m, w.exp_avg_scale, off, n, s.m);
  low_bit_load(f, true, codes_v, w.exp_avg_sq_scale, off, n, s.v);
  const Adam16<kMode> adam16(w, h);
  __m512 squares16 = _mm512_setzero_ps();  // (squares' lanes, in a register)
  Coder8<true> coder_m(f.exp_avg);
  Coder8<false> coder_v(f.exp_avg_sq);
  bool pending = false;  // block b - kB's codes are written in block b's update loop
  for (int64_t b = 0; b <= n; b += kB) {  // (b == n: the last block's codes)
    __m512i max_m16 = _mm512_setzero_si512(), max_root16 = _mm512_setzero_si512();
    const int64_t c = b - kB;  // the pending block
    for (int64_t i = 0; i < kB; i += 16) {
      if (b < n) {
        const int64_t j = b + i;
        adam16.moments(p + j, g + j, _mm512_loadu_ps(s.m + j), _mm512_loadu_ps(s.v + j), s.m + j, s.v + j, max_m16,
                       squares16);
        // (the maxima of sqrt(v) without the sign bit cleared: amax_root below tells finite maxima from the others)
        adam16.template params<true>(p + j, s.m + j, s.v + j, s.root + j, max_root16);
      }
      if (pending) {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(codes_m + off + c + i),
                         low_bytes16(coder_m.code16(s.m + c, i, s.rnd + c)));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(codes_v + off + c + i),
                         low_bytes16(coder_v.code16(s.root + c, i, nullptr)));
      }
    }
    pending = false;
    if (b == n) break;
    moment_random_bits(s.m + b, off + b, kB, w.step, s.rnd + b);
    const uint32_t amax_m = _mm512_reduce_max_epu32(max_m16), amax_root = _mm512_reduce_max_epu32(max_root16);
    if (amax_m >= 0x7F800000u || amax_root >= 0x7F800000u) {  // inf or NaN in m, an overflowed v, or a NaN
      low_bit_store(f, false, s.m + b, nullptr, off + b, kB, codes_m, w.exp_avg_scale, s.rnd + b);
      low_bit_store(f, true, s.v + b, s.root + b, off + b, kB, codes_v, w.exp_avg_sq_scale, s.rnd + b);
      continue;
    }
    const float scale_m = bits_to_float(f.scale_bits(amax_m, false)),
                scale_v = bits_to_float(f.scale_bits(amax_root, true));
    f.store_scale(w.exp_avg_scale, (off + b) / kB, scale_m);
    f.store_scale(w.exp_avg_sq_scale, (off + b) / kB, scale_v);
    coder_m.set_inverse(scale_m > 0.0f ? 1.0f / scale_m : 0.0f);
    coder_v.set_inverse(scale_v > 0.0f ? 1.0f / scale_v : 0.0f);
    pending = true;
  }
  squares.lanes = squares16;
  return true;
}
#endif

// update_q8 of a tensor with 8-bit moments (on AMD Zen 4), update_q4 of one with 4-bit moments, update_fp8 of one
// whose moments are both fp8; false (nothing done) otherwise. (Not inlined: inlined, its loops cost the staged path
// of the other formats 2% in the same function.) squares: the block's sum of squares of the gradients, where the
// coded loops add it up.
template <int64_t kMode>
__attribute__((noinline)) bool update_coded(const TensorWork& w, const Hyper& h, int64_t off, int64_t n,
                                             Scratch<float>& s, float* p, const float* g, SquareSum& squares) {
#if defined(ORT_OPTIM_FP8_AVX512) && defined(ORT_OPTIM_LOW_BIT_AVX512)
#ifdef ORT_OPTIM_LOW_BIT_FUSED_Q8
  if (w.exp_avg_low_bit && w.exp_avg_low_bit->bits == 8) {
    return squares.whole = update_q8<kMode>(w, h, off, n, s, p, g, squares);
  }
#endif
  if (w.exp_avg_low_bit) return squares.whole = update_q4<kMode>(w, h, off, n, s, p, g, squares);
#endif
  if (!w.exp_avg_fp8 || !w.exp_avg_sq_fp8) return false;
  const auto update = [&](auto fm_type, auto fv_type) {
    update_fp8<kMode, decltype(fm_type), decltype(fv_type)>(w, h, off, n, s, p, g, squares);
  };
  if (w.exp_avg_fp8->mantissa_bits == 3) {
    w.exp_avg_sq_fp8->mantissa_bits == 3 ? update(Fp8E4M3{}, Fp8E4M3{}) : update(Fp8E4M3{}, Fp8E5M2{});
  } else {
    w.exp_avg_sq_fp8->mantissa_bits == 3 ? update(Fp8E5M2{}, Fp8E4M3{}) : update(Fp8E5M2{}, Fp8E5M2{});
  }
  return true;
}

// One block of one tensor: [off, off + n) with off a multiple of kBlock.
// grad_squares receives the block's sum of squares of the gradients as loaded (adam_loop's, or SquareSum's in the
// coded loops: the same bits); squares: whether the caller reads it.
template <typename T, int64_t kMode, bool kAmsgrad>
void adam_block(const TensorWork& w, const Hyper& h, int64_t off, int64_t n, Scratch<T>& s, double& grad_squares,
                bool squares) {
  T* g = stage<T>(w.grad, w.grad_type, nullptr, off, n, s.g);
  T* p = w.master ? stage<T>(w.master, at::kFloat, nullptr, off, n, s.p)
                  : stage<T>(w.param, w.param_type, nullptr, off, n, s.p);
  bool coded = false;
  if constexpr (std::is_same_v<T, float> && !kAmsgrad) {
    SquareSum sum;
    coded = update_coded<kMode>(w, h, off, n, s, p, g, sum);
    if (coded) grad_squares = squares ? sum.total(g, n) : 0.0;
  }
  if (!coded) {
    if constexpr (std::is_same_v<T, float>) store_pending_fp8(s);  // (its block is in s.m, s.v and s.root)
    update_staged<T, kMode, kAmsgrad>(w, h, off, n, s, p, g, grad_squares);
  }
  write_back<T>(w, h, off, n, s, p, g);
}

template <typename T, int64_t kMode, bool kAmsgrad>
void run_adam(const std::vector<TensorWork>& work, const std::vector<WorkItem>& items, const Hyper& h,
              double* grad_squares) {
  parallel_over_items(items, [&](int64_t begin, int64_t end) {
    Scratch<T> scratch;
    for (int64_t i = begin; i < end; ++i) {
      const WorkItem& item = items[i];
      double item_squares = 0.0;
      for (int64_t off = item.begin; off < item.end; off += kBlock) {
        double block_squares;
        adam_block<T, kMode, kAmsgrad>(work[item.tensor], h, off, std::min(kBlock, item.end - off), scratch,
                                       block_squares, grad_squares != nullptr);
        item_squares += block_squares;
      }
      if (grad_squares != nullptr) grad_squares[i] = item_squares;
    }
    if constexpr (std::is_same_v<T, float>) store_pending_fp8(scratch);
  });
}

}  // namespace

std::vector<WorkItem> make_work_items(const std::vector<int64_t>& numels) {
  std::vector<WorkItem> items;
  for (int64_t t = 0; t < int64_t(numels.size()); ++t) {
    for (int64_t b = 0; b < numels[t]; b += kChunk) items.push_back({t, b, std::min(numels[t], b + kChunk)});
  }
  return items;
}

template <typename T>
void dispatch_adam(const std::vector<TensorWork>& work, const std::vector<WorkItem>& items, const Hyper& h,
                   bool amsgrad, double* grad_squares) {
  switch (h.mode) {
    case kAdamL2:
      return amsgrad ? run_adam<T, kAdamL2, true>(work, items, h, grad_squares)
                     : run_adam<T, kAdamL2, false>(work, items, h, grad_squares);
    case kAdamWTransformers:
      return amsgrad ? run_adam<T, kAdamWTransformers, true>(work, items, h, grad_squares)
                     : run_adam<T, kAdamWTransformers, false>(work, items, h, grad_squares);
    default:
      return amsgrad ? run_adam<T, kAdamWTorch, true>(work, items, h, grad_squares)
                     : run_adam<T, kAdamWTorch, false>(work, items, h, grad_squares);
  }
}

template void dispatch_adam<float>(const std::vector<TensorWork>&, const std::vector<WorkItem>&, const Hyper&, bool,
                                   double*);
template void dispatch_adam<double>(const std::vector<TensorWork>&, const std::vector<WorkItem>&, const Hyper&, bool,
                                    double*);

}  // namespace ort_optim
