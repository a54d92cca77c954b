// Gradient statistics (declarations in grad_stats.h; the arithmetic is specified in ops/README.md, "grad_stats").
#include "grad_stats.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <limits>
#include <utility>

#include "conversions.h"
#include "parallel_items.h"
#include "validation.h"

namespace ort_optim {
namespace {

// A float64 sum of squares over a sequence of arrays, in 32 fixed lanes plus one for leftovers: element j of an
// array goes to lane j % 32, except the last n % 32 elements, which go to the leftover lane; at the end the lanes are
// added in order, then the leftovers. Every lane sees the same additions in the same order whatever the instruction
// set or thread count, so the result is deterministic and the same on every machine. Four independent vector
// accumulators keep the adder busy, and keeping them across a work item's blocks pays for the final reduction once
// per 64K elements instead of once per 1024.
class SquareSum {
 public:
  template <typename T>
  void add(const T* x, int64_t n) {
    int64_t j = 0;
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<T, float>) {
      for (; j + kLanes <= n; j += kLanes) {
        for (int k = 0; k < 4; ++k) {
          const __m512d d = _mm512_cvtps_pd(_mm256_loadu_ps(x + j + 8 * k));
          vector_[k] = _mm512_add_pd(vector_[k], _mm512_mul_pd(d, d));
        }
      }
    }
#endif
    for (; j + kLanes <= n; j += kLanes) {
      for (int k = 0; k < kLanes; ++k) lanes_[k] += double(x[j + k]) * double(x[j + k]);
    }
    for (; j < n; ++j) leftovers_ += double(x[j]) * double(x[j]);
  }

#if defined(__AVX512F__) && defined(ORT_OPTIM_F16C)
  // add() of fp16 (kBf16 false) or bf16 values, converted in registers: the same lanes and the same bits as
  // converting them into a float array and adding that (both conversions are exact), without the round trip
  // through memory, which cost as much as the sum itself.
  template <bool kBf16>
  void add_16bit(const uint16_t* x, int64_t n) {
    int64_t j = 0;
    for (; j + kLanes <= n; j += kLanes) {
      for (int k = 0; k < 4; ++k) {
        const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + j + 8 * k));
        const __m256 f = kBf16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
                               : _mm256_cvtph_ps(h);
        const __m512d d = _mm512_cvtps_pd(f);
        vector_[k] = _mm512_add_pd(vector_[k], _mm512_mul_pd(d, d));
      }
    }
    for (; j < n; ++j) {
      const double d = kBf16 ? bits_to_float(uint32_t(x[j]) << 16) : c10::detail::fp16_ieee_to_fp32_value(x[j]);
      leftovers_ += d * d;
    }
  }
#endif

  double total() const {
    double lanes[kLanes];
    std::copy(lanes_, lanes_ + kLanes, lanes);
#if defined(__AVX512F__)
    // On this build float arrays went to vector_ and double arrays to lanes_; an array is all one or the other.
    double vector_lanes[kLanes];
    for (int k = 0; k < 4; ++k) _mm512_storeu_pd(vector_lanes + 8 * k, vector_[k]);
    for (int k = 0; k < kLanes; ++k) lanes[k] += vector_lanes[k];
#endif
    double total = 0.0;
    for (int k = 0; k < kLanes; ++k) total += lanes[k];
    return total + leftovers_;
  }

 private:
  static constexpr int kLanes = 32;
  double lanes_[kLanes] = {0.0};
  double leftovers_ = 0.0;
#if defined(__AVX512F__)
  __m512d vector_[4] = {_mm512_setzero_pd(), _mm512_setzero_pd(), _mm512_setzero_pd(), _mm512_setzero_pd()};
#endif
};

// The sum of squares of elements [begin, end) of one array of any float dtype, in SquareSum's lanes.
double square_sum(const void* data, at::ScalarType type, int64_t begin, int64_t end) {
  SquareSum sum;
  if (type == at::kDouble) {
    sum.add(static_cast<const double*>(data) + begin, end - begin);
  } else if (type == at::kFloat) {
    sum.add(static_cast<const float*>(data) + begin, end - begin);
#if defined(__AVX512F__) && defined(ORT_OPTIM_F16C)
  } else if (type == at::kHalf) {
    sum.add_16bit<false>(static_cast<const uint16_t*>(data) + begin, end - begin);
  } else if (type == at::kBFloat16) {
    sum.add_16bit<true>(static_cast<const uint16_t*>(data) + begin, end - begin);
#endif
  } else {
    float buf[kBlock];
    const char* base = static_cast<const char*>(data);
    const size_t esize = c10::elementSize(type);
    for (int64_t off = begin; off < end; off += kBlock) {
      const int64_t len = std::min(kBlock, end - off);
      load<float>(base + off * esize, type, len, buf, 1.0f);
      sum.add(buf, len);
    }
  }
  return sum.total();
}

// The sum of squares over work items: one SquareSum per item, the items' sums added in item order, so the result
// depends neither on the thread count nor on who asked (the grad_stats op, or a plan over the same tensors).
// source(t) gives tensor t's data pointer and dtype.
template <typename Source>
double sum_of_squares(const std::vector<WorkItem>& items, Source source) {
  std::vector<double> partial(items.size(), 0.0);
  parallel_over_items(items, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const WorkItem& item = items[i];
      const auto [data, type] = source(item.tensor);
      partial[i] = square_sum(data, type, item.begin, item.end);
    }
  });
  double total = 0.0;
  for (double p : partial) total += p;  // fixed order: deterministic whatever the thread count
  return total;
}

// A float64 total as grad_stats' float32 pair: [sum of squares, 1.0 if it is not finite]. A sum above float32's
// range is +inf (a plain conversion would throw "cannot be converted to type float without overflow" for finite
// gradients around 2e19 and larger); NaN stays NaN.
std::pair<float, bool> float_stats(double total) {
  const float sum = total > double(std::numeric_limits<float>::max()) ? std::numeric_limits<float>::infinity()
                                                                       : float(total);
  return {sum, !std::isfinite(total)};
}

}  // namespace

at::Tensor stats_tensor(double total) {
  const auto [sum, nonfinite] = float_stats(total);
  at::Tensor out = at::empty({2}, at::TensorOptions().dtype(at::kFloat));
  out.data_ptr<float>()[0] = sum;
  out.data_ptr<float>()[1] = nonfinite ? 1.0f : 0.0f;
  return out;
}

at::Tensor grad_stats_of(const std::vector<const at::Tensor*>& tensors) {
  // Resolved before the parallel region, like the Adam step's TensorWork: the loop then reads no tensor metadata.
  std::vector<at::Tensor> copies;  // contiguous stand-ins for non-contiguous tensors
  std::vector<std::pair<const void*, at::ScalarType>> sources;
  std::vector<int64_t> numels;
  sources.reserve(tensors.size());
  numels.reserve(tensors.size());
  for (const at::Tensor* t : tensors) {
    const void* data = t->data_ptr();
    if (!t->is_contiguous()) {
      copies.push_back(t->contiguous());
      data = copies.back().data_ptr();
    }
    sources.emplace_back(data, t->scalar_type());
    numels.push_back(t->numel());
  }
  return stats_tensor(sum_of_squares(make_work_items(numels), [&](int64_t t) { return sources[t]; }));
}

at::Tensor grad_stats_cpu(at::TensorList tensors) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    TORCH_CHECK(t.layout() == at::kStrided && t.device().is_cpu(), "ort_optim::grad_stats: tensors[", i,
                "] must be a dense CPU tensor");
    TORCH_CHECK(t.scalar_type() == at::kDouble || is_float_storage(t.scalar_type()), "ort_optim::grad_stats: ",
                "tensors[", i, "] has dtype ", t.scalar_type());
  }
  return grad_stats_of(pointers(tensors));
}

}  // namespace ort_optim
