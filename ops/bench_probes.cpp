// Floor probes for the benchmark (ort_optim/bench/probes.py builds this file on its own; it is not part of the
// ort_optim_ops library and no optimizer calls it). Each probe is the least work a step of one kind can do over
// the same tensors as ours, so that `make bench` can say, in the same run, whether a target is out of this
// machine's reach or only out of our kernel's:
//
// * lowbit_floor_step: an Adam step (ADAMW_TORCH math, fp32 params) with 8-bit or 4-bit block-absmax moments in
//   the cheapest code there is: LINEAR levels, round to nearest, no stochastic rounding, no tables. It is not a
//   usable format (a linear second moment rounds small values to zero, the failure Li et al. 2023 describe), only
//   a lower bound on the compute of any block-quantised format: decode, the update, the block maximum, encode.
// * mixed_floor_step: the memory traffic of the mixed-precision step (fp16 params and gradients, fp32 masters and
//   moments: 28 bytes per element, the gradient read once) with one multiply-add per array and nothing else, in one
//   parallel region over (tensor, chunk) work items like ours: the floor set by the tensors' layout (many small
//   allocations) alone.
// * validation_floor_lines / touch_lines: the floor of a plan's check (TensorWatch::check in adam_plan.cpp) over the
//   same tensors: the cache lines of the metadata fields the check must read (metadata_lines.h, the same lists the
//   check prefetches), listed once (untimed), then touched with ideal prefetching and no logic: one load per line,
//   each line prefetched `ahead` lines before. What a check cannot go below however little it computes: its time is
//   the time to bring these lines in.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "metadata_lines.h"
#include "parallel_items.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// elements per parallel work item (the step's own chunking: kChunk in ops/adam_kernel.h)
constexpr int64_t kChunk = 64 * 1024;

struct Item {
  int64_t tensor, begin, end;
};

std::vector<Item> work_items(const std::vector<int64_t>& numels, int64_t align) {
  std::vector<Item> items;
  for (int64_t t = 0; t < int64_t(numels.size()); ++t)
    for (int64_t b = 0; b < numels[t]; b += kChunk) items.push_back({t, b, std::min(numels[t], b + kChunk)});
  (void)align;  // kChunk is a multiple of every block size used here
  return items;
}

struct AdamScalars {
  float omb1, b2, omb2, eps, decay, step_size, bc2_sqrt;
};

// One block of B elements (fewer at a tensor's end): decode, update, block maxima, encode.
template <int kBits>
void lowbit_block(float* __restrict p, const float* __restrict g, uint8_t* __restrict cm, uint8_t* __restrict cu,
                  float& sm, float& su, int64_t n, const AdamScalars& a) {
  constexpr int B = kBits == 8 ? 256 : 128;
  constexpr float kMaxM = kBits == 8 ? 127.0f : 7.0f, kMaxU = kBits == 8 ? 255.0f : 15.0f;
  alignas(64) uint8_t qm[B], qu[B];
  alignas(64) float tm[B], tu[B];
  if constexpr (kBits == 8) {
    std::copy(cm, cm + n, qm);
    std::copy(cu, cu + n, qu);
  } else {  // two codes per byte: element 2j in the low nibble
    for (int64_t j = 0; j < (n + 1) / 2; ++j) {
      qm[2 * j] = cm[j] & 15, qm[2 * j + 1] = cm[j] >> 4;
      qu[2 * j] = cu[j] & 15, qu[2 * j + 1] = cu[j] >> 4;
    }
  }
  const float dm = sm / kMaxM, du = su / kMaxU;
  float am = 0.0f, au = 0.0f;
#pragma omp simd reduction(max : am, au)
  for (int64_t i = 0; i < n; ++i) {
    const float gi = g[i];
    float mi = (kBits == 8 ? float(int8_t(qm[i])) : float(int(qm[i]) - 8)) * dm;
    const float ui0 = float(qu[i]) * du;
    float vi = ui0 * ui0;
    mi = mi + a.omb1 * (gi - mi);
    vi = vi * a.b2 + a.omb2 * gi * gi;
    const float ui = std::sqrt(vi);
    p[i] = p[i] * a.decay;
    p[i] = p[i] - a.step_size * (mi / (ui / a.bc2_sqrt + a.eps));
    tm[i] = mi, tu[i] = ui;
    am = std::max(am, std::fabs(mi));
    au = std::max(au, ui);
  }
  const float im = am > 0.0f ? kMaxM / am : 0.0f, iu = au > 0.0f ? kMaxU / au : 0.0f;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const int m = int(std::nearbyint(tm[i] * im)), u = int(std::nearbyint(tu[i] * iu));
    qm[i] = uint8_t(kBits == 8 ? m : m + 8), qu[i] = uint8_t(u);
  }
  if constexpr (kBits == 8) {
    std::copy(qm, qm + n, cm);
    std::copy(qu, qu + n, cu);
  } else {
    for (int64_t i = n; i < B; ++i) qm[i] = qu[i] = 0;
    for (int64_t j = 0; j < (n + 1) / 2; ++j) {
      cm[j] = uint8_t(qm[2 * j] | (qm[2 * j + 1] << 4));
      cu[j] = uint8_t(qu[2 * j] | (qu[2 * j + 1] << 4));
    }
  }
  sm = am, su = au;
}

void lowbit_floor_step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                       const std::vector<at::Tensor>& codes_m, const std::vector<at::Tensor>& codes_u,
                       const std::vector<at::Tensor>& scales_m, const std::vector<at::Tensor>& scales_u, int64_t bits,
                       double lr, double beta1, double beta2, double eps, double weight_decay, int64_t step) {
  TORCH_CHECK(bits == 8 || bits == 4, "bits must be 8 or 4");
  const int64_t block = bits == 8 ? 256 : 128;
  std::vector<int64_t> numels;
  for (const auto& p : params) {
    TORCH_CHECK(p.scalar_type() == at::kFloat && p.is_contiguous(), "params must be contiguous float32");
    numels.push_back(p.numel());
  }
  const double bc1 = 1.0 - std::pow(beta1, double(step)), bc2 = 1.0 - std::pow(beta2, double(step));
  const AdamScalars a{float(1.0 - beta1), float(beta2), float(1.0 - beta2), float(eps), float(1.0 - lr * weight_decay),
                      float(lr / bc1), float(std::sqrt(bc2))};
  const auto items = work_items(numels, block);
  ort_optim::parallel_over_items(items, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) {
      const Item& it = items[k];
      float* p = params[it.tensor].data_ptr<float>();
      const float* g = grads[it.tensor].data_ptr<float>();
      uint8_t* cm = codes_m[it.tensor].data_ptr<uint8_t>();
      uint8_t* cu = codes_u[it.tensor].data_ptr<uint8_t>();
      float* sm = scales_m[it.tensor].data_ptr<float>();
      float* su = scales_u[it.tensor].data_ptr<float>();
      for (int64_t b = it.begin; b < it.end; b += block) {
        const int64_t n = std::min(block, it.end - b), byte = bits == 8 ? b : b / 2;
        if (bits == 8)
          lowbit_block<8>(p + b, g + b, cm + byte, cu + byte, sm[b / block], su[b / block], n, a);
        else
          lowbit_block<4>(p + b, g + b, cm + byte, cu + byte, sm[b / block], su[b / block], n, a);
      }
    }
  });
}

// fp16 <-> fp32 for a run of elements (16 lanes with AVX-512, scalar c10::Half otherwise).
inline void half_to_float(const at::Half* src, int64_t n, float* dst) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
#endif
  for (; i < n; ++i) dst[i] = float(src[i]);
}

inline void float_to_half(const float* src, int64_t n, at::Half* dst) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                        _mm512_cvtps_ph(_mm512_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
  for (; i < n; ++i) dst[i] = at::Half(src[i]);
}

// Asks for every cache line of [p, p + bytes).
inline void prefetch_all(const void* p, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(static_cast<const char*>(p) + o, 1, 3);
}

// prefetch_ahead: how many work items ahead to prefetch whole (0: none), the most a software prefetch can do
// against the cold start of each small tensor's arrays.
void mixed_floor_step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                      const std::vector<at::Tensor>& masters, const std::vector<at::Tensor>& exp_avgs,
                      const std::vector<at::Tensor>& exp_avg_sqs, double c, int64_t prefetch_ahead) {
  std::vector<int64_t> numels;
  for (const auto& p : params) {
    TORCH_CHECK(p.scalar_type() == at::kHalf && p.is_contiguous(), "params must be contiguous float16");
    numels.push_back(p.numel());
  }
  const float k = float(c);
  const auto items = work_items(numels, 1);
  ort_optim::parallel_over_items(items, [&](int64_t begin, int64_t end) {
    constexpr int64_t kBlock = 1024;
    alignas(64) float g[kBlock];
    const auto prefetch = [&](int64_t j) {
      const Item& it = items[j];
      const int64_t n = it.end - it.begin;
      prefetch_all(params[it.tensor].data_ptr<at::Half>() + it.begin, 2 * n);
      prefetch_all(grads[it.tensor].data_ptr<at::Half>() + it.begin, 2 * n);
      for (const auto* list : {&masters, &exp_avgs, &exp_avg_sqs})
        prefetch_all((*list)[it.tensor].data_ptr<float>() + it.begin, 4 * n);
    };
    for (int64_t j = begin; j < std::min(end, begin + prefetch_ahead); ++j) prefetch(j);
    for (int64_t j = begin; j < end; ++j) {
      if (prefetch_ahead > 0 && j + prefetch_ahead < end) prefetch(j + prefetch_ahead);
      const Item& it = items[j];
      at::Half* p16 = params[it.tensor].data_ptr<at::Half>();
      const at::Half* g16 = grads[it.tensor].data_ptr<at::Half>();
      float* w = masters[it.tensor].data_ptr<float>();
      float* m = exp_avgs[it.tensor].data_ptr<float>();
      float* v = exp_avg_sqs[it.tensor].data_ptr<float>();
      for (int64_t b = it.begin; b < it.end; b += kBlock) {
        const int64_t n = std::min(kBlock, it.end - b);
        half_to_float(g16 + b, n, g);
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) {
          m[b + i] = m[b + i] * k + g[i];
          v[b + i] = v[b + i] * k + g[i];
          w[b + i] = w[b + i] * k + g[i];
        }
        float_to_half(w + b, n, p16 + b);
      }
    }
  });
}

// The distinct cache lines a check reads for these tensors, in the check's order: per param its TensorImpl, its
// storage, each state's TensorImpl and storage (states: per state list, one tensor per param), its step tensor's,
// its AutogradMeta's grad field, its gradient's TensorImpl and storage; then steps'. As TensorWatch lists them for
// AdamPlan (data pointers compared for states only), plus the gradients it finds at check time. Written into out
// (int64, listed lines first); returns how many. (Listing allocates a few large buffers only: see keep_first.)
int64_t validation_floor_lines(const std::vector<at::Tensor>& params,
                               const std::vector<std::vector<at::Tensor>>& states,
                               const std::vector<at::Tensor>& step_tensors, const at::Tensor& steps, at::Tensor out) {
  namespace md = ort_optim::metadata;
  TORCH_CHECK(step_tensors.size() == params.size(), "one step tensor per param");
  for (const auto& list : states) {
    TORCH_CHECK(list.size() == params.size(), "every state list needs one tensor per param");
  }
  const size_t data_offset = md::storage_data_offset();
  std::vector<uintptr_t> all;  // in order, with repeats until keep_first
  all.reserve(32 * (params.size() + 1));
  auto add = [&](uintptr_t line) { all.push_back(line); };
  auto watched = [&](const at::Tensor& t, md::Role role) {
    md::impl_lines(t.unsafeGetTensorImpl(), role, t.dim(), add);
    md::storage_lines(t.storage().unsafeGetStorageImpl(), false, data_offset, add);
  };
  for (size_t i = 0; i < params.size(); ++i) {
    TORCH_CHECK(params[i].grad().defined(), "params[", i, "] has no gradient");
    md::planned_lines(params[i], states, i, step_tensors[i], /*compare_data=*/false, data_offset, add);
    watched(params[i].grad(), md::Role::kGrad);
  }
  watched(steps, md::Role::kWatched);
  std::vector<uint32_t> no_begins;
  md::keep_first(all, no_begins);
  TORCH_CHECK(out.scalar_type() == at::kLong && out.is_contiguous() && size_t(out.numel()) >= all.size(),
              "out must be a contiguous int64 tensor of at least ", all.size(), " elements");
  std::copy(all.begin(), all.end(), out.data_ptr<int64_t>());
  const int64_t count = int64_t(all.size());
  return count;
}

// One load per listed line (lines[0, count)), the line `ahead` places later prefetched first: the least a check of
// these lines can cost. Returns the bytes' sum (so that the loads cannot be left out).
int64_t touch_lines(const at::Tensor& lines, int64_t count, int64_t ahead) {
  TORCH_CHECK(lines.scalar_type() == at::kLong && lines.is_contiguous() && count <= lines.numel(),
              "lines must be a contiguous int64 tensor of at least count elements");
  const int64_t* line = lines.data_ptr<int64_t>();
  int64_t sum = 0;
  for (int64_t i = 0; i < std::min(count, ahead); ++i) __builtin_prefetch(reinterpret_cast<const void*>(line[i]));
  for (int64_t i = 0; i < count; ++i) {
    if (i + ahead < count) __builtin_prefetch(reinterpret_cast<const void*>(line[i + ahead]));
    sum += *reinterpret_cast<const volatile char*>(line[i]);
  }
  return sum;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("lowbit_floor_step", &lowbit_floor_step, "the cheapest block-quantised Adam step (a bound, not a format)");
  m.def("mixed_floor_step", &mixed_floor_step, "the mixed step's memory traffic with no arithmetic to speak of");
  m.def("validation_floor_lines", &validation_floor_lines, "the cache lines a plan's check reads for these tensors");
  m.def("touch_lines", &touch_lines, "one load per line, ideally prefetched: the floor of a check of these lines");
}
