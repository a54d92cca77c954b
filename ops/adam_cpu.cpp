// CPU implementations of ort_optim::adam_step_ and ort_optim::grad_stats (schemas in schema.cpp, math in README.md).
//
// Shape of the kernel: every tensor is cut into chunks of kChunk elements, all (tensor, chunk) work items of the
// call go into ONE at::parallel_for, and each chunk is processed in blocks of kBlock elements that are first
// converted into small float (or double) scratch arrays. The Adam math then runs over plain arrays, which the compiler
// vectorises; the fp16/bf16 conversions around it are explicit (F16C, bit tricks), because c10::Half in a loop
// stays scalar and runs at a tenth of memory speed.
#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/csrc/autograd/python_variable.h>  // THPVariable_Unpack: a Python tensor's at::Tensor
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <unordered_set>
#include <vector>

#include "ort_optim_spec.h"  // generated from ort_optim/_spec.py into the build folder (backends/native.py)

#if defined(__F16C__) && defined(__AVX__)
#include <immintrin.h>
#define ORT_OPTIM_F16C 1
#endif

namespace ort_optim {
namespace {

// Elements per quantisation block of fp16 states (one scale each) and per scratch block. Must equal
// QUANT_BLOCK in ort_optim/_spec.py and BLOCK in ort_optim/backends/triton.py (checked by the tests).
constexpr int64_t kBlock = 1024;
// Elements per parallel work item: big enough to amortise scheduling, small enough to balance 2000 small tensors.
constexpr int64_t kChunk = 64 * kBlock;
// fp16 states are scaled by a power of two so that the block's absolute maximum lands in (kFp16Limit/2, kFp16Limit]:
// half of fp16's range is left as headroom, and the rule is idempotent (see README.md, "fp16 states").
constexpr float kFp16Limit = 32768.0f;

enum Mode : int64_t { kAdamL2 = 0, kAdamWTransformers = 1, kAdamWTorch = 2 };

// ---- conversions between storage dtypes and the float/double scratch arrays ------------------------------------

inline float bits_to_float(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}
inline uint32_t float_to_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

// dst[i] = float(src[i]) * mul. The conversion is exact, so this equals converting and then multiplying; fused, the
// scaled fp16 states take one pass over the block instead of two. 16 lanes with AVX-512, 8 with F16C.
// kSquare: dst[i] = x * x of that x (a second moment stored as sqrt(v)), still in the one pass.
template <bool kSquare = false>
void half_to_float(const uint16_t* src, int64_t n, float* dst, float mul) {
  int64_t i = 0;
#if defined(ORT_OPTIM_F16C) && defined(__AVX512F__)
  const __m512 mul16 = _mm512_set1_ps(mul);
  for (; i + 16 <= n; i += 16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    const __m512 x = _mm512_mul_ps(_mm512_cvtph_ps(h), mul16);
    _mm512_storeu_ps(dst + i, kSquare ? _mm512_mul_ps(x, x) : x);
  }
#endif
#ifdef ORT_OPTIM_F16C
  const __m256 mul8 = _mm256_set1_ps(mul);
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    const __m256 x = _mm256_mul_ps(_mm256_cvtph_ps(h), mul8);
    _mm256_storeu_ps(dst + i, kSquare ? _mm256_mul_ps(x, x) : x);
  }
#endif
  for (; i < n; ++i) {
    const float x = c10::detail::fp16_ieee_to_fp32_value(src[i]) * mul;
    dst[i] = kSquare ? x * x : x;
  }
}

// dst[i] = fp16(src[i] * mul), the product rounded to float, then to half with round to nearest even (like
// c10::Half(float)): the same bits as multiplying into a temporary and converting that.
void float_to_half(const float* src, int64_t n, uint16_t* dst, float mul) {
  int64_t i = 0;
#if defined(ORT_OPTIM_F16C) && defined(__AVX512F__)
  const __m512 mul16 = _mm512_set1_ps(mul);
  for (; i + 16 <= n; i += 16) {
    const __m256i h = _mm512_cvtps_ph(_mm512_mul_ps(_mm512_loadu_ps(src + i), mul16),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), h);
  }
#endif
#ifdef ORT_OPTIM_F16C
  const __m256 mul8 = _mm256_set1_ps(mul);
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_mul_ps(_mm256_loadu_ps(src + i), mul8),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), h);
  }
#endif
  for (; i < n; ++i) dst[i] = c10::detail::fp16_ieee_from_fp32_value(src[i] * mul);
}

void bf16_to_float(const uint16_t* src, int64_t n, float* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = bits_to_float(uint32_t(src[i]) << 16);
}

// dst[i] = bf16(src[i] * mul): the product rounded to float, then to bfloat16 to nearest even, like
// c10::BFloat16(float); NaN becomes the quiet NaN 0x7FC0.
void float_to_bf16(const float* src, int64_t n, uint16_t* dst, float mul = 1.0f) {
  for (int64_t i = 0; i < n; ++i) {
    uint32_t b = float_to_bits(src[i] * mul);
    uint32_t rounded = (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
    dst[i] = ((b & 0x7FFFFFFFu) > 0x7F800000u) ? uint16_t(0x7FC0) : uint16_t(rounded);
  }
}

// dst[i] = value(src[i]) * mul, for any storage dtype the op accepts.
template <typename T>
void load(const void* src, at::ScalarType type, int64_t n, T* dst, T mul) {
  if constexpr (std::is_same_v<T, double>) {
    const double* s = static_cast<const double*>(src);
    for (int64_t i = 0; i < n; ++i) dst[i] = s[i] * mul;
  } else {
    switch (type) {
      case at::kFloat: {
        const float* s = static_cast<const float*>(src);
        for (int64_t i = 0; i < n; ++i) dst[i] = s[i] * mul;
        return;
      }
      case at::kHalf:
        half_to_float(static_cast<const uint16_t*>(src), n, dst, mul);
        return;
      default:  // kBFloat16 (validated before the parallel region; bf16 states are never scaled)
        bf16_to_float(static_cast<const uint16_t*>(src), n, dst);
        if (mul != 1.0f) {
          for (int64_t i = 0; i < n; ++i) dst[i] *= mul;
        }
        return;
    }
  }
}

template <typename T>
void store(const T* src, int64_t n, void* dst, at::ScalarType type) {
  if constexpr (std::is_same_v<T, double>) {
    std::memcpy(dst, src, n * sizeof(double));
  } else {
    switch (type) {
      case at::kFloat:
        std::memcpy(dst, src, n * sizeof(float));
        return;
      case at::kHalf:
        float_to_half(src, n, static_cast<uint16_t*>(dst), 1.0f);
        return;
      default:
        float_to_bf16(src, n, static_cast<uint16_t*>(dst));
        return;
    }
  }
}

// The power-of-two scale s for a block whose absolute maximum is amax: fp16(amax * s) lies in
// (kFp16Limit/2, kFp16Limit]. Zero or non-finite blocks get s = 1.
float fp16_block_scale(float amax) {
  if (!(amax > 0.0f) || !std::isfinite(amax)) return 1.0f;
  int e;
  float f = std::frexp(amax, &e);  // amax = f * 2^e, f in [0.5, 1)
  int k = (f == 0.5f) ? 16 - e : 15 - e;
  float scaled = std::ldexp(amax, std::clamp(k, -126, 126));
  // Rounding to fp16 can land exactly on kFp16Limit/2, which the inverse rule would read as the next scale up.
  if (c10::detail::fp16_ieee_to_fp32_value(c10::detail::fp16_ieee_from_fp32_value(scaled)) <= kFp16Limit / 2) ++k;
  return std::ldexp(1.0f, std::clamp(k, -126, 126));
}

// Writes a block of values as fp16 codes with one power-of-two scale; scale_out receives s (value = code / s).
// amax_bits: the bits of the block's largest |value| (see abs_bits), found by the Adam loop while the values were in
// registers.
void store_fp16_scaled(const float* src, int64_t n, uint16_t* dst, float* scale_out, uint32_t amax_bits) {
  float s = fp16_block_scale(bits_to_float(amax_bits));
  float_to_half(src, n, dst, s);
  *scale_out = s;
}


// ---- low-bit states: 8-bit and 4-bit block-quantised moments (README.md, "low-bit states") ----------------------
//
// The formats (block size, scale dtype, code levels) come from ort_optim/_spec.py through ort_optim_spec.h. A value
// is quantised by normalising it with its block's scale and taking the level index #{j : threshold[j] <= a}. The
// portable path finds it with one table lookup on the float's top bits (exponent and 8 mantissa bits, so no bucket
// holds two thresholds: checked when the map is built) plus one comparison, instead of a binary search over the
// levels. With AVX-512 (ORT_OPTIM_LOW_BIT_AVX512) 16 elements go at once and give the same bits: 8-bit codes decode
// by permutes of the 256 levels held in registers and encode through a packed bucket table (the bucket's code and
// its threshold's low bits, so the comparison needs no second lookup) read with scalar loads; 4-bit codes decode by
// a permute of the 16 levels held in a register and encode by a binary search over the thresholds in registers.
// The scalar step was about 15x slower than the fp32-moment step; vectorised, 2-5x (guides/low-bit-states.md, "Speed",
// has the measurements and why the remaining cost is compute, not bytes).

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define ORT_OPTIM_LOW_BIT_AVX512 1
#endif

class CodeMap {
 public:
  // thresholds: count - 1 increasing decision thresholds (ort_optim._spec.thresholds); snap: the factor applied to
  // a normalised magnitude before the search (exp_avg rounds toward zero, EXP_AVG_SNAP; 1 for sqrt(v)).
  CodeMap(const float* levels, const float* thresholds, int count, bool is_signed, int bits, float snap)
      : sign_bit_(is_signed ? 1 << (bits - 1) : 0), snap_(snap) {
    TORCH_CHECK(count == (is_signed ? 1 << (bits - 1) : 1 << bits), "ort_optim: code map has ", count, " levels");
    mid_.assign(thresholds, thresholds + count - 1);
    mid_.push_back(std::numeric_limits<float>::infinity());
    for (int c = 0; c < (1 << bits); ++c) {
      const int magnitude = is_signed ? c & (sign_bit_ - 1) : c;
      decode_[c] = (c & sign_bit_) ? -levels[magnitude] : levels[magnitude];
    }
    // Stochastic rounding's gap to the next level, hi - lo in float32 (as the rule computes it), per magnitude.
    for (int j = 0; j + 1 < count; ++j) gap_[j] = levels[j + 1] - levels[j];
    // The binary search's table: the thresholds, padded with +inf to 16 (only used for up to 15 thresholds).
    for (int j = 0; j < 16; ++j) search_[j] = j < count - 1 ? thresholds[j] : std::numeric_limits<float>::infinity();
    for (int step = 1; step <= 2; ++step) {
      for (int j = 0; j < 16; ++j) step_[step - 1][j] = j + step - 1 < 16 ? search_[j + step - 1] : search_[15];
    }
    min_bucket_ = float_to_bits(mid_[0]) >> kShift;
    const uint32_t max_bucket = float_to_bits(1.0f) >> kShift;
    for (uint32_t b = min_bucket_; b <= max_bucket; ++b) {
      const float start = bits_to_float(b << kShift), end = bits_to_float((b + 1) << kShift);
      const int at_or_below = int(std::upper_bound(mid_.begin(), mid_.end(), start) - mid_.begin());
      const int below_end = int(std::lower_bound(mid_.begin(), mid_.end(), end) - mid_.begin());
      TORCH_CHECK(below_end - at_or_below <= 1, "ort_optim: two code thresholds within one search bucket");
      bucket_.push_back(uint8_t(at_or_below));
      // mid_[at_or_below] is the first threshold above the bucket's start: if it lies inside the bucket, a value of
      // the bucket reaches it exactly when its low bits do; if not, never (kNever exceeds every low part).
      const uint32_t next = float_to_bits(mid_[at_or_below]);
      const uint32_t low = (next >> kShift) == b ? next & kLowMask : kNever;
      packed_.push_back(uint32_t(at_or_below) << 16 | low);
    }
  }

  // The level index of a normalised magnitude a >= 0: #{j : threshold[j] <= min(a * snap, 1)}.
  inline int magnitude_code(float a) const {
    a = a * snap_;
    a = a < 1.0f ? a : 1.0f;
    const int64_t b = int64_t(float_to_bits(a) >> kShift) - int64_t(min_bucket_);
    const int c = bucket_[b < 0 ? 0 : b];
    return c + (a >= mid_[c]);
  }

#ifdef ORT_OPTIM_LOW_BIT_AVX512
  // magnitude_code of 16 normalised magnitudes (finite, >= 0) by the packed bucket table (8-bit maps), in three
  // steps so that the table lookups between them can be scalar loads (on AMD Zen 4, 16 scalar loads take about
  // two thirds of the time of one 16-lane gather): bucket_keys, then entry per element, then codes.
  inline __m512i bucket_keys(__m512 a) const {
    a = _mm512_min_ps(_mm512_mul_ps(a, _mm512_set1_ps(snap_)), _mm512_set1_ps(1.0f));
    // Below the first bucket, every value gets the first bucket's code, as the clamp b < 0 ? 0 does above; its
    // start has low bits 0, which never reach the first threshold above it.
    return _mm512_max_epu32(_mm512_castps_si512(a), _mm512_set1_epi32(int(min_bucket_ << kShift)));
  }
  inline uint32_t entry(uint32_t key) const { return packed_[(key >> kShift) - min_bucket_]; }
  static inline __m512i codes_of_entries(__m512i key, __m512i e) {
    const __m512i c = _mm512_srli_epi32(e, 16);
    const __mmask16 up = _mm512_cmpge_epu32_mask(_mm512_and_si512(key, _mm512_set1_epi32(kLowMask)),
                                                 _mm512_and_si512(e, _mm512_set1_epi32(0xFFFF)));
    return _mm512_mask_add_epi32(c, up, c, _mm512_set1_epi32(1));
  }

  // The same by a binary search over the thresholds T (kLevels - 1 of them: 7 or 15) held in registers (4-bit
  // maps). Its first step compares with a constant, the second picks one of two constants, the others permute.
  template <int kLevels>
  inline __m512i magnitude_codes_by_search(__m512 a) const {
    static_assert(kLevels == 8 || kLevels == 16, "4-bit maps have 8 (signed) or 16 levels");
    constexpr int half = kLevels / 2, quarter = kLevels / 4;
    a = _mm512_min_ps(_mm512_mul_ps(a, _mm512_set1_ps(snap_)), _mm512_set1_ps(1.0f));
    __mmask16 k = _mm512_cmp_ps_mask(a, _mm512_set1_ps(search_[half - 1]), _CMP_GE_OQ);
    __m512i c = _mm512_maskz_mov_epi32(k, _mm512_set1_epi32(half));
    __m512 t = _mm512_mask_blend_ps(k, _mm512_set1_ps(search_[quarter - 1]),
                                    _mm512_set1_ps(search_[half + quarter - 1]));
    c = _mm512_mask_add_epi32(c, _mm512_cmp_ps_mask(a, t, _CMP_GE_OQ), c, _mm512_set1_epi32(quarter));
    // c is a multiple of 2 * step: step_[step - 1][c] = T[c + step - 1]
    for (int step = quarter / 2; step >= 1; step /= 2) {
      t = _mm512_permutexvar_ps(c, _mm512_load_ps(step_[step - 1]));
      c = _mm512_mask_add_epi32(c, _mm512_cmp_ps_mask(a, t, _CMP_GE_OQ), c, _mm512_set1_epi32(step));
    }
    return c;
  }
#endif

  int sign_bit() const { return sign_bit_; }
  const float* decode() const { return decode_; }
  const float* gap() const { return gap_; }
  // The magnitude code rounded stochastically (exp_avg; _spec.EXP_AVG_SR_ULPS has the rule): from the non-zero level
  // at or below (magnitude_code), one level up iff (lowered(a) - lo) > (r >> 8) * 2^-24 * (hi - lo). r: 32 random bits.
  inline int stochastic_magnitude_code(float a, uint32_t r) const {
    const int m = magnitude_code(a);
    if (m == 0 || m + 1 >= sign_bit_) return m;  // below the lowest non-zero level (toward zero), or the top one
    const uint32_t ab = float_to_bits(a);
    const float lowered = bits_to_float(ab > spec::kExpAvgSrUlps ? ab - spec::kExpAvgSrUlps : 0u);
    return m + ((lowered - decode_[m]) > float(r >> 8) * 0x1p-24f * gap_[m]);
  }

 private:
  static constexpr int kShift = 15;  // keeps the exponent and 8 mantissa bits
  static constexpr uint32_t kLowMask = (1u << kShift) - 1, kNever = 1u << kShift;
  int sign_bit_;
  float snap_;
  alignas(64) float decode_[256] = {0.0f};
  alignas(64) float gap_[256] = {0.0f};  // gap_[j] = levels[j + 1] - levels[j]; 0 past the top level
  alignas(64) float search_[16];
  alignas(64) float step_[2][16];  // the search's tables for steps 1 and 2: step_[s - 1][j] = search_[j + s - 1]
  std::vector<float> mid_;
  uint32_t min_bucket_ = 0;
  std::vector<uint8_t> bucket_;
  std::vector<uint32_t> packed_;  // per bucket: its code << 16 | the low bits of the threshold inside it, or kNever
};

struct LowBit {
  int bits, block;
  bool bf16_scales;
  CodeMap exp_avg, exp_avg_sq;  // exp_avg_sq's codes hold sqrt(v)

  const CodeMap& map(bool second_moment) const { return second_moment ? exp_avg_sq : exp_avg; }
  float scale(const void* scales, int64_t block_index) const {
    return bf16_scales ? bits_to_float(uint32_t(static_cast<const uint16_t*>(scales)[block_index]) << 16)
                       : static_cast<const float*>(scales)[block_index];
  }
};

template <size_t N, size_t M>
LowBit make_low_bit(int bits, int block, bool bf16_scales, const float (&m_levels)[N], const float (&m_thresholds)[N - 1],
                    const float (&v_levels)[M], const float (&v_thresholds)[M - 1]) {
  return LowBit{bits, block, bf16_scales, CodeMap(m_levels, m_thresholds, int(N), true, bits, spec::kExpAvgSnap),
                CodeMap(v_levels, v_thresholds, int(M), false, bits, 1.0f)};
}

const LowBit& q8() {
  static const LowBit f = make_low_bit(spec::kQ8Bits, spec::kQ8Block, spec::kQ8Bf16Scales, spec::kQ8ExpAvgLevels,
                                       spec::kQ8ExpAvgThresholds, spec::kQ8ExpAvgSqLevels, spec::kQ8ExpAvgSqThresholds);
  return f;
}
const LowBit& q4() {
  static const LowBit f = make_low_bit(spec::kQ4Bits, spec::kQ4Block, spec::kQ4Bf16Scales, spec::kQ4ExpAvgLevels,
                                       spec::kQ4ExpAvgThresholds, spec::kQ4ExpAvgSqLevels, spec::kQ4ExpAvgSqThresholds);
  return f;
}

#ifdef ORT_OPTIM_LOW_BIT_AVX512
// t[idx] for 16 indices in [0, 128), t in 8 registers: four 2-register permutes on the low 5 bits, bits 5 and 6 pick.
inline __m512 lookup128(const __m512* t, __m512i idx) {
  __m512 r[4];
  for (int k = 0; k < 4; ++k) r[k] = _mm512_permutex2var_ps(t[2 * k], idx, t[2 * k + 1]);
  const __mmask16 b5 = _mm512_test_epi32_mask(idx, _mm512_set1_epi32(32));
  const __mmask16 b6 = _mm512_test_epi32_mask(idx, _mm512_set1_epi32(64));
  return _mm512_mask_blend_ps(b6, _mm512_mask_blend_ps(b5, r[0], r[1]), _mm512_mask_blend_ps(b5, r[2], r[3]));
}
#endif

// d[0, len) = the values of one block's codes c (8-bit: one per byte; 4-bit: element 2j in the low nibble of byte
// j), scale s; v = u * u for a second moment. The scalar loops are the reference and do the vector loops' tails.
template <int kBits, bool kSecondMoment>
void decode_block(const CodeMap& map, const uint8_t* c, float s, int64_t len, float* d) {
  const float* decode = map.decode();
  int64_t i = 0;
#ifdef ORT_OPTIM_LOW_BIT_AVX512
  const __m512 s16 = _mm512_set1_ps(s);
  if constexpr (kBits == 8 && !kSecondMoment) {
    // exp_avg: sign-magnitude codes, so the 128 magnitudes (lookup128) and the code's top bit as the float's sign
    const __m512 table[8] = {_mm512_load_ps(decode), _mm512_load_ps(decode + 16), _mm512_load_ps(decode + 32),
                             _mm512_load_ps(decode + 48), _mm512_load_ps(decode + 64), _mm512_load_ps(decode + 80),
                             _mm512_load_ps(decode + 96), _mm512_load_ps(decode + 112)};
    for (; i + 16 <= len; i += 16) {
      const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + i)));
      const __m512i sign = _mm512_and_si512(_mm512_slli_epi32(idx, 24), _mm512_set1_epi32(int(0x80000000u)));
      const __m512 x = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(lookup128(table, idx)), sign));
      _mm512_storeu_ps(d + i, _mm512_mul_ps(x, s16));
    }
  } else if constexpr (kBits == 8) {
    // The 256 levels in 16 registers: eight 2-register permutes look up the code's low 5 bits in each 32-level
    // eighth of the table, and its top 3 bits pick one of the eight (a gather is twice as slow on AMD Zen 4).
    __m512 table[16];
    for (int k = 0; k < 16; ++k) table[k] = _mm512_load_ps(decode + 16 * k);
    for (; i + 16 <= len; i += 16) {
      const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + i)));
      __m512 r[8];
      for (int k = 0; k < 8; ++k) r[k] = _mm512_permutex2var_ps(table[2 * k], idx, table[2 * k + 1]);
      const __mmask16 b5 = _mm512_test_epi32_mask(idx, _mm512_set1_epi32(32));
      const __mmask16 b6 = _mm512_test_epi32_mask(idx, _mm512_set1_epi32(64));
      const __mmask16 b7 = _mm512_test_epi32_mask(idx, _mm512_set1_epi32(128));
      for (int k = 0; k < 4; ++k) r[k] = _mm512_mask_blend_ps(b5, r[2 * k], r[2 * k + 1]);
      for (int k = 0; k < 2; ++k) r[k] = _mm512_mask_blend_ps(b6, r[2 * k], r[2 * k + 1]);
      __m512 x = _mm512_mul_ps(_mm512_mask_blend_ps(b7, r[0], r[1]), s16);
      if constexpr (kSecondMoment) x = _mm512_mul_ps(x, x);
      _mm512_storeu_ps(d + i, x);
    }
  } else {
    const __m512 table = _mm512_load_ps(decode);
    for (; i + 16 <= len; i += 16) {
      // 8 bytes -> 16 codes in order: byte j, then byte j >> 4; the permute reads only each lane's low 4 bits
      const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + i / 2));
      const __m128i codes = _mm_unpacklo_epi8(bytes, _mm_srli_epi16(bytes, 4));
      __m512 x = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_cvtepu8_epi32(codes), table), s16);
      if constexpr (kSecondMoment) x = _mm512_mul_ps(x, x);
      _mm512_storeu_ps(d + i, x);
    }
  }
#endif
  for (; i < len; ++i) {
    const float x = (kBits == 8 ? decode[c[i]] : decode[(c[i >> 1] >> ((i & 1) * 4)) & 15]) * s;
    d[i] = kSecondMoment ? x * x : x;
  }
}

inline uint32_t fmix32(uint32_t x);

// The random bits of exp_avg's stochastic rounding: a hash of the value's float32 bits, its element index e and the
// step (_spec.EXP_AVG_SR_ULPS).
inline uint32_t exp_avg_random_bits(float x, uint64_t e, uint32_t step) {
  return fmix32(fmix32(float_to_bits(x) ^ (uint32_t(e) * 0x9E3779B1u)) ^ (step * 0x85EBCA77u + 0x6A09E667u));
}

// dst[0, n) = the values of elements [off, off + n) (off a multiple of the format's block); v = u * u for a second
// moment.
template <int kBits, bool kSecondMoment>
void low_bit_load(const LowBit& f, const uint8_t* codes, const void* scales, int64_t off, int64_t n, float* dst) {
  const CodeMap& map = f.map(kSecondMoment);
  for (int64_t q = 0; q < n; q += f.block) {
    const int64_t len = std::min<int64_t>(f.block, n - q);
    const uint8_t* c = kBits == 8 ? codes + off + q : codes + (off + q) / 2;
    decode_block<kBits, kSecondMoment>(map, c, f.scale(scales, (off + q) / f.block), len, dst + q);
  }
}

void low_bit_load(const LowBit& f, bool second_moment, const uint8_t* codes, const void* scales, int64_t off,
                  int64_t n, float* dst) {
  if (f.bits == 8) {
    second_moment ? low_bit_load<8, true>(f, codes, scales, off, n, dst)
                  : low_bit_load<8, false>(f, codes, scales, off, n, dst);
  } else {
    second_moment ? low_bit_load<4, true>(f, codes, scales, off, n, dst)
                  : low_bit_load<4, false>(f, codes, scales, off, n, dst);
  }
}

#ifdef ORT_OPTIM_LOW_BIT_AVX512
inline __m512i fmix32x16(__m512i x) {  // fmix32 on 16 lanes
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(int(0x85EBCA6Bu)));
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 13));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(int(0xC2B2AE35u)));
  return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
}

#endif

// Codes of one block of (finite) values u[0, len) with 1 / scale inv, written as the format stores them. Signed:
// exp_avg's map (sign-magnitude codes).
template <int kBits, bool kSigned>
void encode_block(const CodeMap& map, const float* u, int64_t len, float inv, uint8_t* out, uint64_t first_index,
                  uint32_t step) {
  const int sign_bit = map.sign_bit();
  int64_t i = 0;
#ifdef ORT_OPTIM_LOW_BIT_AVX512
  const __m512 inv16 = _mm512_set1_ps(inv);
  const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF);
  const int64_t vector_end = len & ~int64_t(15);
  alignas(64) uint32_t keys[256], entries[256];
  if constexpr (kBits == 8) {
    for (; i < vector_end; i += 16) {
      const __m512 x = _mm512_loadu_ps(u + i);
      const __m512 a = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(x), abs_mask)), inv16);
      _mm512_store_si512(keys + i, map.bucket_keys(a));
    }
    for (i = 0; i < vector_end; ++i) {
      uint32_t key = keys[i];
#ifdef __GNUC__
      asm("" : "+r"(key));  // keeps the loop scalar: vectorised, the compiler emulates a gather, slower still
#endif
      entries[i] = map.entry(key);
    }
  }
  // exp_avg's stochastic rounding: its levels and gaps in registers (8 or 1 of each: 128 or 16 entries), and
  // each lane's e * 0x9E3779B1 (e = first_index + i + lane), advanced by 16 * 0x9E3779B1 per iteration.
  constexpr int kTableRegs = kBits == 8 ? 8 : 1;
  __m512 level_table[kTableRegs], gap_table[kTableRegs];
  __m512i e_hash = _mm512_setzero_si512();
  if constexpr (kSigned) {
    for (int k = 0; k < kTableRegs; ++k) {
      level_table[k] = _mm512_load_ps(map.decode() + 16 * k);
      gap_table[k] = _mm512_load_ps(map.gap() + 16 * k);
    }
    e_hash = _mm512_mullo_epi32(
        _mm512_add_epi32(_mm512_set1_epi32(int(uint32_t(first_index))),
                         _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)),
        _mm512_set1_epi32(int(0x9E3779B1u)));
  }
  for (i = 0; i < vector_end; i += 16) {
    const __m512 x = _mm512_loadu_ps(u + i);
    __m512i code;
    if constexpr (kBits == 8) {
      code = CodeMap::codes_of_entries(_mm512_load_si512(keys + i), _mm512_load_si512(entries + i));
    } else {
      const __m512 a = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(x), abs_mask)), inv16);
      code = map.magnitude_codes_by_search<kSigned ? 8 : 16>(a);
    }
    if constexpr (kSigned) {  // stochastically one level up: CodeMap::stochastic_magnitude_code, 16 lanes
      const __m512 a = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(x), abs_mask)), inv16);
      const __m512 lowered = _mm512_castsi512_ps(_mm512_max_epi32(
          _mm512_sub_epi32(_mm512_castps_si512(a), _mm512_set1_epi32(int(spec::kExpAvgSrUlps))), _mm512_setzero_si512()));
      // lo = levels[code] and hi - lo from registers (permutes, not gathers: a 16-lane gather costs about as much as
      // the rest of this loop on Zen 4)
      __m512 lo, gap;
      if constexpr (kBits == 8) {
        lo = lookup128(level_table, code);
        gap = lookup128(gap_table, code);
      } else {
        lo = _mm512_permutexvar_ps(code, level_table[0]);
        gap = _mm512_permutexvar_ps(code, gap_table[0]);
      }
      __m512i r = _mm512_xor_si512(_mm512_castps_si512(x), e_hash);  // e * 0x9E3779B1, stepped by addition
      e_hash = _mm512_add_epi32(e_hash, _mm512_set1_epi32(int(16u * 0x9E3779B1u)));
      r = _mm512_xor_si512(fmix32x16(r), _mm512_set1_epi32(int(step * 0x85EBCA77u + 0x6A09E667u)));
      r = fmix32x16(r);
      const __m512 threshold = _mm512_mul_ps(
          _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(r, 8)), _mm512_set1_ps(0x1p-24f)), gap);
      const __mmask16 up = _mm512_cmp_ps_mask(_mm512_sub_ps(lowered, lo), threshold, _CMP_GT_OQ) &
                           _mm512_cmpgt_epi32_mask(code, _mm512_setzero_si512()) &
                           _mm512_cmplt_epi32_mask(code, _mm512_set1_epi32(sign_bit - 1));
      code = _mm512_mask_add_epi32(code, up, code, _mm512_set1_epi32(1));
    }
    if constexpr (kSigned) {  // the sign, for a non-zero magnitude of a negative value
      const __mmask16 negative = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ) &
                                 _mm512_test_epi32_mask(code, code);
      code = _mm512_mask_or_epi32(code, negative, code, _mm512_set1_epi32(sign_bit));
    }
    const __m128i bytes = _mm512_cvtepi32_epi8(code);
    if constexpr (kBits == 8) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), bytes);
    } else {  // element 2j's code in the low nibble of byte j, 2j + 1's in the high one: c[2j] + 16 * c[2j + 1]
      const __m128i pairs = _mm_maddubs_epi16(bytes, _mm_set1_epi16(0x1001));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(out + i / 2), _mm_packus_epi16(pairs, pairs));
    }
  }
#endif
  uint8_t c[256];
  const int64_t tail = i;  // the scalar loop does what the vector loop left (and everything without AVX-512)
  for (; i < len; ++i) {
    const float a = std::fabs(u[i]) * inv;
    const int m = kSigned ? map.stochastic_magnitude_code(a, exp_avg_random_bits(u[i], first_index + uint64_t(i), step))
                          : map.magnitude_code(a);
    c[i - tail] = uint8_t(m | ((kSigned && u[i] < 0.0f && m > 0) ? sign_bit : 0));
  }
  if constexpr (kBits == 8) {
    std::memcpy(out + tail, c, len - tail);
  } else {
    uint8_t* o = out + tail / 2;
    for (int64_t j = 0; j < len - tail; j += 2) o[j >> 1] = uint8_t(c[j] | ((tail + j + 1 < len ? c[j + 1] : 0) << 4));
  }
}

// The bits of the largest |x[i]| (abs_bits ordering: a NaN's exceed infinity's); u = sqrt(x) where sqrt is set
// (u may be x itself then).
uint32_t block_amax(const float* x, int64_t len, bool sqrt, float* u) {
  uint32_t amax = 0;
  int64_t i = 0;
#ifdef ORT_OPTIM_LOW_BIT_AVX512
  __m512i amax16 = _mm512_setzero_si512();
  const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF);
  for (; i + 16 <= len; i += 16) {
    __m512 v = _mm512_loadu_ps(x + i);
    if (sqrt) {
      v = _mm512_sqrt_ps(v);
      _mm512_storeu_ps(u + i, v);
    }
    amax16 = _mm512_max_epu32(amax16, _mm512_and_si512(_mm512_castps_si512(v), abs_mask));
  }
  amax = _mm512_reduce_max_epu32(amax16);
#endif
  for (; i < len; ++i) {
    const float v = sqrt ? (u[i] = std::sqrt(x[i])) : x[i];
    amax = std::max(amax, float_to_bits(v) & 0x7FFFFFFFu);
  }
  return amax;
}

// Writes src[0, n) as the codes and scales of elements [off, off + n). root: sqrt(src) when the caller has it (a
// second moment's codes hold sqrt(v)), else nullptr.
template <int kBits, bool kSecondMoment>
void low_bit_store(const LowBit& f, const float* src, const float* root, int64_t off, int64_t n, uint8_t* codes,
                   void* scales, uint32_t step) {
  const CodeMap& map = f.map(kSecondMoment);
  const bool second_moment = kSecondMoment;
  float sqrt_v[256];
  for (int64_t q = 0; q < n; q += f.block) {
    const int64_t len = std::min<int64_t>(f.block, n - q);
    const bool take_sqrt = second_moment && !root;
    const float* u = take_sqrt ? sqrt_v : root ? root + q : src + q;
    uint32_t amax = block_amax(take_sqrt ? src + q : u, len, take_sqrt, sqrt_v);
    // The scale: the block's absolute maximum, rounded to nearest even where the format stores bfloat16 scales
    // (which may overflow to inf: then the block is non-finite, like one holding inf).
    if (f.bf16_scales && amax < 0x7F800000u) amax = (amax + 0x7FFFu + ((amax >> 16) & 1u)) & 0xFFFF0000u;
    if (amax < 0x00800000u) amax = 0;  // below float32's smallest normal: a zero block (_spec.MIN_SCALE)
    uint8_t* out = kBits == 8 ? codes + off + q : codes + (off + q) / 2;
    float s;
    if (amax < 0x7F800000u) {
      s = bits_to_float(amax);
      encode_block<kBits, !kSecondMoment>(map, u, len, s > 0.0f ? 1.0f / s : 0.0f, out, uint64_t(off + q), step);
    } else {  // inf or NaN in the block: it reads back as NaN everywhere (scale NaN, codes 0)
      s = std::numeric_limits<float>::quiet_NaN();
      std::memset(out, 0, kBits == 8 ? len : (len + 1) / 2);
    }
    const int64_t block_index = (off + q) / f.block;
    if (f.bf16_scales) {
      static_cast<uint16_t*>(scales)[block_index] = uint16_t(float_to_bits(s) >> 16);
    } else {
      static_cast<float*>(scales)[block_index] = s;
    }
  }
}

// step: the Adam step (from 1) of an exp_avg, mixed into its stochastic rounding.
void low_bit_store(const LowBit& f, bool second_moment, const float* src, const float* root, int64_t off, int64_t n,
                   uint8_t* codes, void* scales, uint32_t step = 0) {
  if (f.bits == 8) {
    second_moment ? low_bit_store<8, true>(f, src, root, off, n, codes, scales, step)
                  : low_bit_store<8, false>(f, src, root, off, n, codes, scales, step);
  } else {
    second_moment ? low_bit_store<4, true>(f, src, root, off, n, codes, scales, step)
                  : low_bit_store<4, false>(f, src, root, off, n, codes, scales, step);
  }
}

// ---- fp8 states: float8_e4m3fn / float8_e5m2 codes, a power-of-two scale per 256 elements (README.md, "fp8 states")
//
// Decoded and encoded by exponent and mantissa arithmetic on the bits (no tables, no search), in branch-free loops
// over one block that the compiler vectorises; ort_optim/_spec.py (Fp8Format) states the rules and
// reference.quantize_fp8 is the definition, bit for bit.

struct Fp8 {
  int mantissa_bits, bias, emax, max_code;
};
const Fp8 kFp8E4M3{3, 7, 8, 0x7E};
const Fp8 kFp8E5M2{2, 15, 15, 0x7B};
constexpr int kFp8Block = spec::kFp8Block;

const Fp8* fp8_of(at::ScalarType t) {
  return t == at::kFloat8_e4m3fn ? &kFp8E4M3 : t == at::kFloat8_e5m2 ? &kFp8E5M2 : nullptr;
}

// y >= 0 (finite, below 2**(emax + 1)) rounded to nearest even in the format, as a code (not saturated): normal values
// by rounding the float32 mantissa to kMb bits, subnormal ones by adding and subtracting 2**23 to y * 2**(bias - 1 +
// kMb) (< 9: the float32 addition rounds to nearest even at integers; the build forbids contracting or
// reassociating it).
template <int kMb, int kBias>
inline int32_t fp8_round(float y) {
  constexpr int kShift = 23 - kMb;
  const uint32_t b = float_to_bits(y);
  const int32_t normal = int32_t((b + (1u << (kShift - 1)) - 1u + ((b >> kShift) & 1u)) >> kShift) -
                         ((127 - kBias) << kMb);
  const float scaled = y * bits_to_float(uint32_t(127 + kBias - 1 + kMb) << 23);
  const int32_t subnormal = int32_t((scaled + 8388608.0f) - 8388608.0f);
  return y < bits_to_float(uint32_t(127 + 1 - kBias) << 23) ? subnormal : normal;
}

// dst[0, n) = the values of elements [off, off + n) (off a multiple of kFp8Block): code * scale, squared for a
// second moment (which holds sqrt(v)).
template <int kMb, int kBias, bool kSecondMoment>
void fp8_load(const uint8_t* codes, const float* scales, int64_t off, int64_t n, float* dst) {
  const float sub_ulp = bits_to_float(uint32_t(127 + 1 - kBias - kMb) << 23);
  for (int64_t q = 0; q < n; q += kFp8Block) {
    const int64_t len = std::min<int64_t>(kFp8Block, n - q);
    const float s = scales[(off + q) / kFp8Block];
    const uint8_t* c = codes + off + q;
    float* d = dst + q;
    for (int64_t i = 0; i < len; ++i) {
      const uint32_t code = c[i], mag = code & 0x7Fu;
      const float normal = bits_to_float((mag << (23 - kMb)) + (uint32_t(127 - kBias) << 23));
      const float u = (mag >> kMb) == 0 ? float(int32_t(mag)) * sub_ulp : normal;
      const float x = bits_to_float(float_to_bits(u) | ((code & 0x80u) << 24)) * s;
      d[i] = kSecondMoment ? x * x : x;
    }
  }
}

// The random bits of the fp8 states of elements [off, off + n) in a step, from the step's new exp_avg m:
// fmix32(bits(m[i]) ^ (off + i) * 0x9E3779B1 ^ (step * 0x85EBCA77 + 0x6A09E667)); an fp8 exp_avg rounds with the top
// 16 bits, an fp8 second moment with the low 16 (reference.fp8_random_bits).
void fp8_random_bits(const float* m, int64_t off, int64_t n, uint32_t step, uint32_t* r) {
  const uint32_t e0 = uint32_t(off) * 0x9E3779B1u, step_hash = step * 0x85EBCA77u + 0x6A09E667u;
  for (int64_t i = 0; i < n; ++i) r[i] = fmix32(float_to_bits(m[i]) ^ (e0 + uint32_t(i) * 0x9E3779B1u) ^ step_hash);
}

// Writes src[0, n) (v for a second moment; root: sqrt(v) when the caller has it) as the codes and scales of elements
// [off, off + n), in a step. The codes round stochastically: 16 random bits (rnd, from fp8_random_bits) are added
// right below the kept bits (normal values: to the float32 bits; subnormal ones: to the value in fixed point with as
// many fraction bits, truncated from min(y, the smallest normal) * 2**(bias + 22)) and truncated. The block's
// largest magnitudes (always normal) add half an ulp minus one plus the lowest kept bit instead: to nearest even, so
// that the scale survives a decode and re-encode. One formula for every element, without branches: the loop
// vectorises.
template <int kMb, int kBias, int kEmax, int kMaxCode, bool kSecondMoment>
void fp8_store(const float* src, const float* root, int64_t off, int64_t n, uint8_t* codes, float* scales,
               const uint32_t* rnd) {
  constexpr int kShift = 23 - kMb;
  const float min_normal = bits_to_float(uint32_t(127 + 1 - kBias) << 23);
  const float to_fixed = bits_to_float(uint32_t(127 + kBias + 22) << 23);
  float sqrt_v[kFp8Block];
  for (int64_t q = 0; q < n; q += kFp8Block) {
    const int64_t len = std::min<int64_t>(kFp8Block, n - q);
    const bool take_sqrt = kSecondMoment && !root;
    const float* u = take_sqrt ? sqrt_v : root ? root + q : src + q;
    const uint32_t amax = block_amax(take_sqrt ? src + q : u, len, take_sqrt, sqrt_v);
    uint8_t* out = codes + off + q;
    float s;
    if (amax >= 0x7F800000u) {  // inf or NaN in the block: it reads back as NaN everywhere (scale NaN, codes 0)
      s = std::numeric_limits<float>::quiet_NaN();
      std::memset(out, 0, len);
    } else {
      // k: the smallest with amax / 2**k rounding to at most the largest finite code (amax's mantissa at 2**emax
      // tells whether its exponent suffices), capped at 127 - emax; below the smallest exponent, a zero block.
      const int32_t e = int32_t(amax >> 23) - 127;
      const float top = bits_to_float((amax & 0x7FFFFFu) | (uint32_t(kEmax + 127) << 23));
      const int32_t k = std::min(e - kEmax + (fp8_round<kMb, kBias>(top) > kMaxCode ? 1 : 0), 127 - kEmax);
      if (amax == 0 || k < spec::kFp8MinExponent) {
        s = 0.0f;
        std::memset(out, 0, len);
      } else {
        s = bits_to_float(uint32_t(k + 127) << 23);
        const float inv = bits_to_float(uint32_t(127 - k) << 23);
        const uint32_t* r = rnd + q;
        for (int64_t i = 0; i < len; ++i) {
          const uint32_t b = float_to_bits(u[i]), ab = b & 0x7FFFFFFFu;
          const float y = bits_to_float(ab) * inv;
          const uint32_t yb = float_to_bits(y);
          const uint32_t random = (kSecondMoment ? r[i] & 0xFFFFu : r[i] >> 16) << (kShift - 16);
          const uint32_t add = ab == amax ? (1u << (kShift - 1)) - 1u + ((yb >> kShift) & 1u) : random;
          const int32_t normal = int32_t((yb + add) >> kShift) - ((127 - kBias) << kMb);
          const int32_t fixed = int32_t(std::min(y, min_normal) * to_fixed);
          const int32_t subnormal = int32_t((uint32_t(fixed) + add) >> kShift);
          int32_t code = std::min(y < min_normal ? subnormal : normal, kMaxCode);
          if constexpr (kSecondMoment) {
            code = std::max(code, 1);  // no zero level for sqrt(v) (the zero-point problem)
          } else {
            code = (b >> 31) != 0 && code > 0 ? code | 0x80 : code;  // the sign, never on a zero (no -0)
          }
          out[i] = uint8_t(code);
        }
      }
    }
    scales[(off + q) / kFp8Block] = s;
  }
}

void fp8_load(const Fp8& f, bool second_moment, const void* codes, const float* scales, int64_t off, int64_t n,
              float* dst) {
  const uint8_t* c = static_cast<const uint8_t*>(codes);
  if (f.mantissa_bits == 3) {
    second_moment ? fp8_load<3, 7, true>(c, scales, off, n, dst) : fp8_load<3, 7, false>(c, scales, off, n, dst);
  } else {
    second_moment ? fp8_load<2, 15, true>(c, scales, off, n, dst) : fp8_load<2, 15, false>(c, scales, off, n, dst);
  }
}

void fp8_store(const Fp8& f, bool second_moment, const float* src, const float* root, int64_t off, int64_t n,
               void* codes, float* scales, const uint32_t* rnd) {
  uint8_t* c = static_cast<uint8_t*>(codes);
  if (f.mantissa_bits == 3) {
    second_moment ? fp8_store<3, 7, 8, 0x7E, true>(src, root, off, n, c, scales, rnd)
                  : fp8_store<3, 7, 8, 0x7E, false>(src, root, off, n, c, scales, rnd);
  } else {
    second_moment ? fp8_store<2, 15, 15, 0x7B, true>(src, root, off, n, c, scales, rnd)
                  : fp8_store<2, 15, 15, 0x7B, false>(src, root, off, n, c, scales, rnd);
  }
}

// ---- stochastic rounding of bfloat16 params (README.md, "stochastic rounding") ----------------------------------

inline uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

inline uint32_t fmix32(uint32_t x) {  // murmur3's 32-bit finaliser
  x ^= x >> 16;
  x *= 0x85EBCA6Bu;
  x ^= x >> 13;
  x *= 0xC2B2AE35u;
  return x ^ (x >> 16);
}

// dst[i] = bf16(src[i]) rounded stochastically: up in magnitude with probability (the dropped 16 bits) / 2^16, from
// 16 random bits of hash(key, element index off + i). key = splitmix64(rounding key ^ splitmix64(step)). Non-finite
// values round to nearest (NaN -> 0x7FC0).
void float_to_bf16_stochastic(const float* src, int64_t n, uint16_t* dst, uint64_t key, int64_t off) {
  const uint32_t k_lo = uint32_t(key), k_hi = uint32_t(key >> 32);
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t e = uint64_t(off + i);
    const uint32_t r = fmix32(fmix32(uint32_t(e) * 0x9E3779B1u + uint32_t(e >> 32) * 0x85EBCA77u + k_lo) ^ k_hi);
    const uint32_t b = float_to_bits(src[i]);
    if ((b & 0x7FFFFFFFu) < 0x7F800000u) {
      dst[i] = uint16_t((b + (r >> 16)) >> 16);
    } else {
      dst[i] = ((b & 0x7FFFFFFFu) > 0x7F800000u) ? uint16_t(0x7FC0) : uint16_t(b >> 16);
    }
  }
}

// ---- the Adam update ------------------------------------------------------------------------------------------

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

template <typename T>
struct Scratch {
  T p[kBlock], g[kBlock], m[kBlock], v[kBlock], vmax[kBlock], root[kBlock];
  uint32_t fp8_rnd[kBlock];  // the random bits of fp8 states (fp8_random_bits)
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
                 const float* root = nullptr, uint32_t step = 0, const Fp8* fp8 = nullptr,
                 const uint32_t* fp8_rnd = nullptr) {
  char* dst = static_cast<char*>(base) + off * c10::elementSize(type);
  if constexpr (std::is_same_v<T, float>) {
    if (fp8) {
      fp8_store(*fp8, second_moment, src, root, off, n, base, scales, fp8_rnd);
      return;
    }
    if (low_bit) {
      low_bit_store(*low_bit, second_moment, src, root, off, n, static_cast<uint8_t*>(base), scales, step);
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
                        float_to_bits(std::sqrt(bits_to_float(amax_bits))) & 0x7FFFFFFFu);
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

// |x| as bits: orders like |x| for non-NaN floats, and an integer max vectorises (a float max does not without
// fast-math). A NaN's bits exceed infinity's, so a block with a NaN still reads as non-finite.
inline uint32_t abs_bits(float x) { return float_to_bits(x) & 0x7FFFFFFFu; }

// Block maxima of |m|, |v| and |vmax| as abs_bits, for the fp16 quantiser.
struct BlockMax {
  uint32_t m = 0, v = 0, vmax = 0;
  double grad_squares = 0.0;  // the block's sum of g * g (the gradients as loaded), in T, summed in vector lanes
};

// The update over one staged block. kAmax: also find the block maxima (when a state is stored as scaled fp16),
// in the same pass rather than in one more pass per state.
// kRoot: also write sqrt(v) (sqrt(vmax) with amsgrad), which a low-bit second moment stores, to root.
template <typename T, int64_t kMode, bool kAmsgrad, bool kAmax, bool kRoot = false>
BlockMax adam_loop(T* __restrict__ p, const T* __restrict__ g, T* __restrict__ m, T* __restrict__ v,
                   T* __restrict__ vmax, int64_t n, const TensorWork& w, const Hyper& h,
                   T* __restrict__ root = nullptr) {
  const T grad_mul = T(h.grad_mul), b2 = T(h.beta2), one_minus_b1 = T(1.0 - h.beta1),
          one_minus_b2 = T(1.0 - h.beta2);
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
    m[i] = m[i] + one_minus_b1 * (gi - m[i]);  // = b1*m + (1-b1)*g, in torch's lerp form
    v[i] = v[i] * b2 + one_minus_b2 * gi * gi;
    T vi = v[i];
    if (kAmsgrad) {
      vmax[i] = std::max(vmax[i], vi);  // the max of the raw v; bias correction comes after
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

// One block of one tensor: [off, off + n) with off a multiple of kBlock.
// grad_squares receives the block's sum of squares of the gradients as loaded (adam_loop's).
template <typename T, int64_t kMode, bool kAmsgrad>
void adam_block(const TensorWork& w, const Hyper& h, int64_t off, int64_t n, Scratch<T>& s, double& grad_squares) {
  T* g = stage<T>(w.grad, w.grad_type, nullptr, off, n, s.g);
  T* p = w.master ? stage<T>(w.master, at::kFloat, nullptr, off, n, s.p)
                  : stage<T>(w.param, w.param_type, nullptr, off, n, s.p);
  T* m = stage<T>(w.exp_avg, w.exp_avg_type, w.exp_avg_scale, off, n, s.m, w.exp_avg_low_bit, false, w.exp_avg_fp8);
  T* v = stage<T>(w.exp_avg_sq, w.exp_avg_sq_type, w.exp_avg_sq_scale, off, n, s.v, w.exp_avg_sq_low_bit, true,
                  w.exp_avg_sq_fp8);
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
  if constexpr (std::is_same_v<T, float>) {
    if (w.exp_avg_fp8 || w.exp_avg_sq_fp8) fp8_random_bits(m, off, n, w.step, s.fp8_rnd);
  }

  // Write back what was staged.
  if (m == s.m) {
    store_state<T>(s.m, w.exp_avg, w.exp_avg_type, w.exp_avg_scale, off, n, max.m, w.exp_avg_low_bit, false, nullptr,
                   w.step, w.exp_avg_fp8, s.fp8_rnd);
  }
  if (v == s.v) {
    store_state<T>(s.v, w.exp_avg_sq, w.exp_avg_sq_type, w.exp_avg_sq_scale, off, n, max.v, w.exp_avg_sq_low_bit, true,
                   kAmsgrad ? nullptr : root, w.step, w.exp_avg_sq_fp8, s.fp8_rnd);
  }
  if (kAmsgrad && vmax == s.vmax) {
    store_state<T>(s.vmax, w.max_exp_avg_sq, w.exp_avg_sq_type, w.max_exp_avg_sq_scale, off, n, max.vmax,
                   w.exp_avg_sq_low_bit, true, root, w.step, w.exp_avg_sq_fp8, s.fp8_rnd);
  }
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

struct WorkItem {
  int64_t tensor, begin, end;
};

std::vector<WorkItem> make_work_items(const std::vector<int64_t>& numels) {
  std::vector<WorkItem> items;
  for (int64_t t = 0; t < int64_t(numels.size()); ++t) {
    for (int64_t b = 0; b < numels[t]; b += kChunk) items.push_back({t, b, std::min(numels[t], b + kChunk)});
  }
  return items;
}

// Hardware prefetchers stop at page boundaries, so with many small tensors every tensor would start with cold
// misses; asking for the first kPrefetchBytes of the next work item's arrays hides them.
constexpr int64_t kPrefetchBytes = 4096;

void prefetch_range(const void* base, size_t element_size, int64_t begin, int64_t end) {
  if (base == nullptr) return;
  const char* p = static_cast<const char*>(base) + begin * element_size;
  const int64_t bytes = std::min<int64_t>((end - begin) * int64_t(element_size), kPrefetchBytes);
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b);
}

void prefetch_item(const TensorWork& w, const WorkItem& item) {
  prefetch_range(w.grad, c10::elementSize(w.grad_type), item.begin, item.end);
  prefetch_range(w.master ? static_cast<const void*>(w.master) : w.param,
                 w.master ? sizeof(float) : c10::elementSize(w.param_type), item.begin, item.end);
  prefetch_range(w.exp_avg, c10::elementSize(w.exp_avg_type), item.begin, item.end);
  prefetch_range(w.exp_avg_sq, c10::elementSize(w.exp_avg_sq_type), item.begin, item.end);
}

// grad_squares: nullptr, or one slot per work item for the sum of squares of its gradients (as loaded, before any
// multiplier): the blocks' sums from the update loop, added in block order (the plain step's gradient norm).
template <typename T, int64_t kMode, bool kAmsgrad>
void run_adam(const std::vector<TensorWork>& work, const std::vector<WorkItem>& items, const Hyper& h,
              double* grad_squares) {
  at::parallel_for(0, int64_t(items.size()), 1, [&](int64_t begin, int64_t end) {
    Scratch<T> scratch;
    for (int64_t i = begin; i < end; ++i) {
      const WorkItem& item = items[i];
      if (i + 1 < end) prefetch_item(work[items[i + 1].tensor], items[i + 1]);
      double item_squares = 0.0;
      for (int64_t off = item.begin; off < item.end; off += kBlock) {
        double block_squares;
        adam_block<T, kMode, kAmsgrad>(work[item.tensor], h, off, std::min(kBlock, item.end - off), scratch,
                                       block_squares);
        item_squares += block_squares;
      }
      if (grad_squares != nullptr) grad_squares[i] = item_squares;
    }
  });
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

// ---- validation (all of it happens before anything is written) ------------------------------------------------

bool is_low_precision(at::ScalarType t) { return t == at::kHalf || t == at::kBFloat16; }
bool is_float_storage(at::ScalarType t) { return t == at::kFloat || is_low_precision(t); }

void check_list_length(const at::TensorList& list, size_t n, const char* name, bool optional) {
  TORCH_CHECK(list.size() == n || (optional && list.empty()), "ort_optim::adam_step_: ", name, " has ",
              list.size(), " tensors but params has ", n, optional ? " (pass n tensors or none)" : "");
}

// Bytes of its storage a view reaches (0 for an empty tensor): from the storage's start to the end of its last element.
size_t bytes_needed(int64_t offset, c10::IntArrayRef sizes, c10::IntArrayRef strides, size_t element_size) {
  int64_t last = offset;
  for (size_t d = 0; d < sizes.size(); ++d) {
    if (sizes[d] == 0) return 0;
    last += (sizes[d] - 1) * strides[d];
  }
  return size_t(last + 1) * element_size;
}

size_t bytes_needed(const at::Tensor& t) {
  return bytes_needed(t.storage_offset(), t.sizes(), t.strides(), t.element_size());
}

// A storage freed or shrunk in place (untyped_storage().resize_(0), as CPU offload and FSDP do) under a tensor that
// still claims its elements: writing through it would write into freed memory.
void check_storage(const at::Tensor& t, const char* name, size_t i) {
  TORCH_CHECK(!t.has_storage() || t.storage().nbytes() >= bytes_needed(t), "ort_optim::adam_step_: ", name, "[", i,
              "] has a storage of ", t.has_storage() ? t.storage().nbytes() : 0, " bytes but needs ", bytes_needed(t),
              " (was its storage freed or resized in place?)");
}

void check_same_shape(const at::Tensor& t, const at::Tensor& p, const char* name, size_t i) {
  TORCH_CHECK(t.sizes() == p.sizes(), "ort_optim::adam_step_: ", name, "[", i, "] has shape ", t.sizes(),
              " but params[", i, "] has shape ", p.sizes());
  TORCH_CHECK(t.device() == p.device(), "ort_optim::adam_step_: ", name, "[", i, "] is on ", t.device(),
              " but params[", i, "] is on ", p.device());
  check_storage(t, name, i);
}

void check_state(const at::Tensor& t, const at::Tensor& p, const char* name, size_t i, bool is_double) {
  // uint8 (low-bit) codes have their own shape rules, checked with their scales (check_scales)
  if (t.scalar_type() != at::kByte || is_double) {
    check_same_shape(t, p, name, i);
  } else {
    check_storage(t, name, i);
  }
  TORCH_CHECK(t.is_contiguous(), "ort_optim::adam_step_: ", name, "[", i, "] must be contiguous");
  TORCH_CHECK(is_double ? t.scalar_type() == at::kDouble
                        : is_float_storage(t.scalar_type()) || t.scalar_type() == at::kByte || fp8_of(t.scalar_type()),
              "ort_optim::adam_step_: ", name, "[", i, "] has dtype ", t.scalar_type(),
              is_double ? "; float64 params need float64 states"
                        : "; states must be float32, bfloat16, float16, uint8 (low-bit codes) or float8_e4m3fn / "
                          "float8_e5m2 (fp8 codes)");
}

// The low-bit format of a uint8 state, told by its scales' dtype: float32 -> 8-bit, bfloat16 -> 4-bit.
const LowBit* low_bit_of(const at::Tensor& state, const at::Tensor& scales) {
  if (state.scalar_type() != at::kByte) return nullptr;
  return scales.scalar_type() == at::kBFloat16 ? &q4() : &q8();
}

void check_scales(const at::TensorList& scales, const at::TensorList& states, size_t i, const char* name,
                  const at::Tensor& p) {
  const at::Tensor& t = states[i];
  if (scales.empty()) {
    TORCH_CHECK(t.scalar_type() != at::kByte, "ort_optim::adam_step_: the uint8 (low-bit) state scaled by ", name,
                "[", i, "] needs its block scales; ", name, " is empty");
    TORCH_CHECK(!fp8_of(t.scalar_type()), "ort_optim::adam_step_: the ", t.scalar_type(), " (fp8) state scaled by ",
                name, "[", i, "] needs its block scales; ", name, " is empty");
    return;
  }
  const at::Tensor& s = scales[i];
  if (fp8_of(t.scalar_type())) {  // (its shape is the param's: check_state)
    const int64_t blocks = (p.numel() + kFp8Block - 1) / kFp8Block;
    TORCH_CHECK(s.device() == t.device() && s.is_contiguous() && s.scalar_type() == at::kFloat &&
                    s.numel() == blocks,
                "ort_optim::adam_step_: ", name, "[", i, "] must be a contiguous float32 tensor of ", blocks,
                " block scales on the state's device (", t.scalar_type(), " codes, one scale per ", kFp8Block, ")");
    check_storage(s, name, i);
    return;
  }
  TORCH_CHECK(t.scalar_type() == at::kHalf || t.scalar_type() == at::kByte, "ort_optim::adam_step_: ", name, "[", i,
              "] is given but the state it scales is ", t.scalar_type(), ", not float16, uint8 or fp8");
  TORCH_CHECK(s.device() == t.device() && s.is_contiguous(), "ort_optim::adam_step_: ", name, "[", i,
              "] must be contiguous, on the state's device");
  check_storage(s, name, i);
  if (t.scalar_type() == at::kHalf) {
    const int64_t blocks = (t.numel() + kBlock - 1) / kBlock;
    TORCH_CHECK(s.scalar_type() == at::kFloat && s.numel() == blocks, "ort_optim::adam_step_: ", name, "[", i,
                "] must be a contiguous float32 tensor of ", blocks, " block scales on the state's device");
    return;
  }
  TORCH_CHECK(s.scalar_type() == at::kFloat || s.scalar_type() == at::kBFloat16, "ort_optim::adam_step_: ", name,
              "[", i, "] has dtype ", s.scalar_type(), "; uint8 states take float32 scales (8-bit codes) or ",
              "bfloat16 scales (4-bit codes, two per byte)");
  const LowBit& f = *low_bit_of(t, s);
  const int64_t n = p.numel(), blocks = (n + f.block - 1) / f.block;
  TORCH_CHECK(s.numel() == blocks, "ort_optim::adam_step_: ", name, "[", i, "] has ", s.numel(), " scales; a ",
              f.bits, "-bit state of ", n, " elements has ", blocks, " blocks of ", f.block);
  if (f.bits == 8) {
    TORCH_CHECK(t.sizes() == p.sizes(), "ort_optim::adam_step_: the 8-bit state scaled by ", name, "[", i,
                "] has shape ", t.sizes(), " but params[", i, "] has shape ", p.sizes());
  } else {
    TORCH_CHECK(t.dim() == 1 && t.numel() == (n + 1) / 2, "ort_optim::adam_step_: the 4-bit state scaled by ", name,
                "[", i, "] must be a flat uint8 tensor of ", (n + 1) / 2, " bytes (two codes each), got shape ",
                t.sizes());
  }
  TORCH_CHECK(t.device() == p.device(), "ort_optim::adam_step_: the state scaled by ", name, "[", i,
              "] is on ", t.device(), " but params[", i, "] is on ", p.device());
}

double scalar_value(const c10::optional<at::Tensor>& t, const char* name) {
  TORCH_CHECK(t->numel() == 1, "ort_optim::adam_step_: ", name, " must have exactly one element, got ",
              t->numel());
  return t->item<double>();
}

// The per-parameter state lists of a call, in the schema's order (all but exp_avgs/exp_avg_sqs may be empty).
struct StateLists {
  at::TensorList exp_avgs, exp_avg_sqs, max_exp_avg_sqs, master_params, exp_avg_scales, exp_avg_sq_scales,
      max_exp_avg_sq_scales;
};

// Returns whether the param is float64.
bool check_param(const at::Tensor& p, size_t i, bool has_master) {
  const at::ScalarType pt = p.scalar_type();
  TORCH_CHECK(pt == at::kDouble || is_float_storage(pt), "ort_optim::adam_step_: params[", i, "] has dtype ", pt,
              "; supported are float32, float64, float16 and bfloat16");
  TORCH_CHECK(p.layout() == at::kStrided && p.device().is_cpu(), "ort_optim::adam_step_: params[", i,
              "] must be a dense CPU tensor");
  TORCH_CHECK(!has_master || is_low_precision(pt), "ort_optim::adam_step_: master_params given but params[", i,
              "] is ", pt, "; master weights are for float16/bfloat16 params");
  check_storage(p, "params", i);
  return pt == at::kDouble;
}

void check_grad(const at::Tensor& g, const at::Tensor& p, size_t i, bool is_double) {
  TORCH_CHECK(g.layout() == at::kStrided, "ort_optim::adam_step_: grads[", i, "] is sparse; Adam needs dense gradients");
  check_same_shape(g, p, "grads", i);
  TORCH_CHECK(is_double ? g.scalar_type() == at::kDouble : is_float_storage(g.scalar_type()),
              "ort_optim::adam_step_: grads[", i, "] has dtype ", g.scalar_type(), " for a ", p.scalar_type(),
              " parameter");
}

// Everything but the gradients. Returns whether the params are float64 (they cannot share a call with others).
bool check_params_and_states(at::TensorList params, const StateLists& s, const at::Tensor& steps) {
  const size_t n = params.size();
  check_list_length(s.exp_avgs, n, "exp_avgs", false);
  check_list_length(s.exp_avg_sqs, n, "exp_avg_sqs", false);
  check_list_length(s.max_exp_avg_sqs, n, "max_exp_avg_sqs", true);
  check_list_length(s.master_params, n, "master_params", true);
  check_list_length(s.exp_avg_scales, n, "exp_avg_scales", true);
  check_list_length(s.exp_avg_sq_scales, n, "exp_avg_sq_scales", true);
  check_list_length(s.max_exp_avg_sq_scales, n, "max_exp_avg_sq_scales", true);
  TORCH_CHECK(s.max_exp_avg_sq_scales.empty() || !s.max_exp_avg_sqs.empty(),
              "ort_optim::adam_step_: max_exp_avg_sq_scales given without max_exp_avg_sqs");
  TORCH_CHECK(steps.scalar_type() == at::kDouble && steps.dim() == 1 && size_t(steps.numel()) == n &&
                  steps.is_contiguous() && steps.device().is_cpu(),
              "ort_optim::adam_step_: steps must be a contiguous float64 CPU tensor of shape [", n, "]");
  check_storage(steps, "steps", 0);
  const bool amsgrad = !s.max_exp_avg_sqs.empty();
  TORCH_CHECK(s.exp_avg_sq_scales.empty() == s.max_exp_avg_sq_scales.empty() || !amsgrad,
              "ort_optim::adam_step_: max_exp_avg_sqs share exp_avg_sqs' dtype, so both or neither need scales");
  bool any_double = false, any_single = false;
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    const bool is_double = check_param(p, i, !s.master_params.empty());
    (is_double ? any_double : any_single) = true;
    check_state(s.exp_avgs[i], p, "exp_avgs", i, is_double);
    check_state(s.exp_avg_sqs[i], p, "exp_avg_sqs", i, is_double);
    if (amsgrad) {
      check_state(s.max_exp_avg_sqs[i], p, "max_exp_avg_sqs", i, is_double);
      TORCH_CHECK(s.max_exp_avg_sqs[i].scalar_type() == s.exp_avg_sqs[i].scalar_type(), "ort_optim::adam_step_: ",
                  "max_exp_avg_sqs[", i, "] must have the dtype of exp_avg_sqs[", i, "]");
    }
    if (!s.master_params.empty()) {
      check_same_shape(s.master_params[i], p, "master_params", i);
      TORCH_CHECK(s.master_params[i].scalar_type() == at::kFloat && s.master_params[i].is_contiguous(),
                  "ort_optim::adam_step_: master_params[", i, "] must be a contiguous float32 tensor");
    }
    check_scales(s.exp_avg_scales, s.exp_avgs, i, "exp_avg_scales", p);
    check_scales(s.exp_avg_sq_scales, s.exp_avg_sqs, i, "exp_avg_sq_scales", p);
    if (amsgrad) {
      check_scales(s.max_exp_avg_sq_scales, s.max_exp_avg_sqs, i, "max_exp_avg_sq_scales", p);
      TORCH_CHECK(s.max_exp_avg_sq_scales.empty() ||
                      s.max_exp_avg_sq_scales[i].scalar_type() == s.exp_avg_sq_scales[i].scalar_type(),
                  "ort_optim::adam_step_: max_exp_avg_sq_scales[", i, "] must have the dtype of exp_avg_sq_scales[",
                  i, "] (max_exp_avg_sqs share exp_avg_sqs' format)");
    }
  }
  TORCH_CHECK(!(any_double && any_single), "ort_optim::adam_step_: float64 params cannot share a call with ",
              "other dtypes; group them separately");
  return any_double;
}

// ---- one step over validated inputs (shared by the op and AdamPlan) -------------------------------------------

// The state pointers and sizes of every parameter; the param, grad and per-step fields are filled by update().
std::vector<TensorWork> state_work(at::TensorList params, const StateLists& s) {
  std::vector<TensorWork> work(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    TensorWork& w = work[i];
    w.exp_avg = s.exp_avgs[i].data_ptr();
    w.exp_avg_sq = s.exp_avg_sqs[i].data_ptr();
    w.max_exp_avg_sq = s.max_exp_avg_sqs.empty() ? nullptr : s.max_exp_avg_sqs[i].data_ptr();
    w.master = s.master_params.empty() ? nullptr : s.master_params[i].data_ptr<float>();
    // (bfloat16 scales of 4-bit states are kept as raw pointers too; LowBit reads them as bfloat16)
    w.exp_avg_scale = s.exp_avg_scales.empty() ? nullptr : static_cast<float*>(s.exp_avg_scales[i].data_ptr());
    w.exp_avg_sq_scale =
        s.exp_avg_sq_scales.empty() ? nullptr : static_cast<float*>(s.exp_avg_sq_scales[i].data_ptr());
    w.max_exp_avg_sq_scale =
        s.max_exp_avg_sq_scales.empty() ? nullptr : static_cast<float*>(s.max_exp_avg_sq_scales[i].data_ptr());
    if (!s.exp_avg_scales.empty()) w.exp_avg_low_bit = low_bit_of(s.exp_avgs[i], s.exp_avg_scales[i]);
    if (!s.exp_avg_sq_scales.empty()) w.exp_avg_sq_low_bit = low_bit_of(s.exp_avg_sqs[i], s.exp_avg_sq_scales[i]);
    w.exp_avg_fp8 = fp8_of(s.exp_avgs[i].scalar_type());
    w.exp_avg_sq_fp8 = fp8_of(s.exp_avg_sqs[i].scalar_type());
    w.exp_avg_type = s.exp_avgs[i].scalar_type();
    w.exp_avg_sq_type = s.exp_avg_sqs[i].scalar_type();
    w.numel = params[i].numel();
  }
  return work;
}

struct Scaling {
  c10::optional<double> grad_scale, max_grad_norm;  // inputs (FusedAdam's step(grad_scale=...) and max_grad_norm)
  float norm = 0.0f;  // output: the global L2 norm of the unscaled gradients, before clipping
  bool skip = false;  // output: the step was skipped (inf/NaN gradients, an overflowing unscale, or found_inf)
};

struct StepOptions {
  double lr, beta1, beta2, eps, weight_decay;
  int64_t mode;
  bool bias_correction, maximize;
  c10::optional<at::Tensor> lr_tensor, inv_grad_scale, found_inf, grad_scale;
  c10::optional<at::Tensor> rounding_keys;  // stochastic rounding of bfloat16 params (README.md)
  // Set by AdamPlan::step_scaled (then inv_grad_scale and grad_scale are empty): the gradients are unscaled and
  // clipped by a multiplier computed from their statistics, and the step is skipped on inf/NaN (see "gradient
  // statistics"); the unscaled gradients are written back as with grad_scale.
  Scaling* scaling = nullptr;
  // Set by AdamPlan::step(grad_norm=true): receives the sum of squares of the gradients the update read, added per
  // work item in item order (deterministic whatever the thread count); NaN when the step was skipped.
  double* grad_square_sum = nullptr;
};

c10::optional<double> scaled_grad_multiplier(Scaling& scaling, const std::vector<TensorWork>& work,
                                             const std::vector<WorkItem>& items, bool found_inf);

// rounding_keys: int64 [n], one key per param; only for bfloat16 params without master weights.
void check_rounding_keys(const c10::optional<at::Tensor>& keys, const std::vector<const at::Tensor*>& params,
                         const std::vector<TensorWork>& work) {
  if (!keys.has_value()) return;
  const at::Tensor& k = *keys;
  TORCH_CHECK(k.scalar_type() == at::kLong && k.dim() == 1 && size_t(k.numel()) == params.size() &&
                  k.is_contiguous() && k.device().is_cpu(),
              "ort_optim::adam_step_: rounding_keys must be a contiguous int64 CPU tensor of shape [",
              params.size(), "]");
  for (size_t i = 0; i < params.size(); ++i) {
    TORCH_CHECK(params[i]->scalar_type() == at::kBFloat16 && work[i].master == nullptr,
                "ort_optim::adam_step_: rounding_keys (stochastic rounding) given but params[", i, "] is ",
                params[i]->scalar_type(), work[i].master ? " with a master weight" : "",
                "; stochastic rounding is for bfloat16 params without master weights");
  }
}

// ---- autograd's version counters ------------------------------------------------------------------------------

// The kernels write through data pointers, which autograd does not see. A step marks every tensor it wrote as
// modified in place, as torch's own in-place ops do (torch.optim.AdamW's foreach and for-loop steps): it bumps the
// tensor's version counter, so that a backward still needing the old value (a second backward over a retained graph
// that saved a param, a p.detach() saved by a later forward) raises autograd's "modified by an inplace operation"
// error instead of silently computing with the new one. update() marks them once it knows that the step is taken,
// before the kernel runs (a skipped step writes nothing and marks nothing). Tensors without a version counter (made
// under torch.inference_mode()) are skipped, as torch.autograd.graph.increment_version skips them. Views of one
// buffer share one counter (FusedAdam's flat state buffers): consecutive tensors with the same counter are bumped
// once, so a bucket's moments cost one atomic increment, not one per param.
static_assert(sizeof(c10::VariableVersion) == sizeof(void*), "c10::VariableVersion is one intrusive_ptr");

// The counter object a tensor's version counter points to (shared by a view and its base); nullptr without one.
inline const void* counter_of(const c10::TensorImpl* impl) {
  return *reinterpret_cast<const void* const*>(&impl->version_counter());
}

// Brings a tensor's counter into the cache ahead of its bump (with the intent to write it).
inline void prefetch_counter(const c10::TensorImpl* impl) {
  if (const void* counter = counter_of(impl)) __builtin_prefetch(static_cast<const char*>(counter) + 16, 1);
}

class VersionBumps {
 public:
  void add(const at::Tensor& t) { add(t.unsafeGetTensorImpl()); }
  void add(c10::TensorImpl* impl) {
    const void* counter = counter_of(impl);
    if (counter == nullptr || counter == last_) return;  // (an inference tensor; or a view of the last one's base)
    last_ = counter;
    impl->bump_version();
  }
  void add(at::TensorList tensors) {
    for (const at::Tensor& t : tensors) add(t);
  }

 private:
  const void* last_ = nullptr;
};

// Called by update() once the step is known to be taken, with whether it unscales the gradients in place too.
using MarkWritten = std::function<void(bool grads)>;

// The step itself: params[i] and grads[i] are validated, work[i] holds their states. Writes nothing when skipped;
// otherwise calls mark_written first (see "autograd's version counters").
void update(std::vector<TensorWork>& work, const std::vector<WorkItem>& items,
            const std::vector<const at::Tensor*>& params, const std::vector<const at::Tensor*>& grads,
            double* steps, bool is_double, bool amsgrad, const StepOptions& o, const MarkWritten& mark_written) {
  TORCH_CHECK(o.mode >= 0 && o.mode <= 2, "ort_optim::adam_step_: adam_w_mode must be 0, 1 or 2, got ", o.mode);
  check_rounding_keys(o.rounding_keys, params, work);
  const bool found_inf = o.found_inf.has_value() && scalar_value(o.found_inf, "found_inf") != 0.0;
  if (o.grad_square_sum != nullptr) *o.grad_square_sum = std::numeric_limits<double>::quiet_NaN();
  if (found_inf && o.scaling == nullptr) return;  // skipped (a scaled step still reports the gradients' norm)
  double grad_mul = o.inv_grad_scale.has_value() ? scalar_value(o.inv_grad_scale, "inv_grad_scale") : 1.0;
  const double lr = o.lr_tensor.has_value() ? scalar_value(o.lr_tensor, "lr_tensor") : o.lr;
  double grad_scale = o.grad_scale.has_value() ? scalar_value(o.grad_scale, "grad_scale") : 0.0;
  if (o.scaling != nullptr && o.scaling->grad_scale.has_value()) grad_scale = *o.scaling->grad_scale;
  TORCH_CHECK(grad_scale == 0.0 || (std::isfinite(grad_scale) && grad_scale != 0.0),
              "ort_optim::adam_step_: grad_scale must be finite and non-zero, got ", grad_scale);

  // Non-contiguous params and grads are processed through contiguous copies; params (and grads when they are
  // unscaled in place) are copied back at the end.
  std::vector<std::pair<size_t, at::Tensor>> param_copies, grad_copies;
  double last_t = -1.0, step_size = 0.0, bc2_sqrt = 1.0;
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& p = *params[i];
    const at::Tensor& g = *grads[i];
    TensorWork& w = work[i];
    if (p.is_contiguous()) {
      w.param = p.data_ptr();
    } else {
      param_copies.emplace_back(i, p.contiguous());
      w.param = param_copies.back().second.data_ptr();
    }
    if (g.is_contiguous()) {
      w.grad = g.data_ptr();
    } else {
      // (checked here, before anything is written: an expand()ed gradient cannot receive one value per element)
      TORCH_CHECK(grad_scale == 0.0 || at::has_internal_overlap(g) != at::MemOverlap::Yes, "ort_optim::adam_step_: ",
                  "grads[", i, "] overlaps itself (an expand()ed tensor), so it cannot be unscaled in place");
      grad_copies.emplace_back(i, g.contiguous());
      w.grad = grad_copies.back().second.data_ptr();
    }
    w.param_type = p.scalar_type();
    w.grad_type = g.scalar_type();
    const double t = steps[i] + 1.0;
    if (t != last_t) {  // the params of a bucket usually share their step count: two pow() per call, not per param
      const double bc1 = o.bias_correction ? 1.0 - std::pow(o.beta1, t) : 1.0;
      const double bc2 = o.bias_correction ? 1.0 - std::pow(o.beta2, t) : 1.0;
      step_size = o.mode == kAdamWTorch ? lr / bc1 : lr * std::sqrt(bc2) / bc1;
      bc2_sqrt = std::sqrt(bc2);
      last_t = t;
    }
    w.step_size = step_size;
    w.bc2_sqrt = bc2_sqrt;
    w.step = uint32_t(uint64_t(t));
    w.stochastic = o.rounding_keys.has_value();
    if (w.stochastic) {
      w.round_key = splitmix64(uint64_t(o.rounding_keys->data_ptr<int64_t>()[i]) ^ splitmix64(uint64_t(t)));
    }
  }
  if (o.scaling != nullptr) {
    const c10::optional<double> multiplier = scaled_grad_multiplier(*o.scaling, work, items, found_inf);
    if (!multiplier.has_value()) return;  // skipped: nothing written, the contiguous copies are dropped
    grad_mul = *multiplier;
  }
  if (o.maximize) grad_mul = -grad_mul;
  mark_written(grad_scale != 0.0);
  const Hyper h{lr, o.beta1, o.beta2, o.eps, o.weight_decay, grad_mul, o.mode, grad_scale};
  std::vector<double> grad_squares(o.grad_square_sum != nullptr ? items.size() : 0, 0.0);
  double* squares = o.grad_square_sum != nullptr ? grad_squares.data() : nullptr;
  if (is_double) {
    dispatch_adam<double>(work, items, h, amsgrad, squares);
  } else {
    dispatch_adam<float>(work, items, h, amsgrad, squares);
  }
  if (o.grad_square_sum != nullptr) {
    double total = 0.0;
    for (double q : grad_squares) total += q;  // fixed order, as sum_of_squares
    *o.grad_square_sum = total;
  }
  for (const auto& [i, copy] : param_copies) params[i]->copy_(copy);
  if (grad_scale != 0.0) {
    for (const auto& [i, copy] : grad_copies) grads[i]->copy_(copy);
  }
  for (size_t i = 0; i < params.size(); ++i) steps[i] += 1.0;
}

std::vector<WorkItem> work_items(const std::vector<TensorWork>& work) {
  std::vector<int64_t> numels;
  for (const auto& w : work) numels.push_back(w.numel);
  return make_work_items(numels);
}

std::vector<const at::Tensor*> pointers(at::TensorList tensors) {
  std::vector<const at::Tensor*> out;
  out.reserve(tensors.size());
  for (const at::Tensor& t : tensors) out.push_back(&t);
  return out;
}

void adam_step_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                   at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs, at::TensorList master_params,
                   at::TensorList exp_avg_scales, at::TensorList exp_avg_sq_scales,
                   at::TensorList max_exp_avg_sq_scales, const at::Tensor& steps, double lr, double beta1,
                   double beta2, double eps, double weight_decay, int64_t mode, bool bias_correction,
                   bool maximize, const c10::optional<at::Tensor>& lr_tensor,
                   const c10::optional<at::Tensor>& inv_grad_scale, const c10::optional<at::Tensor>& found_inf,
                   const c10::optional<at::Tensor>& grad_scale, const c10::optional<at::Tensor>& rounding_keys) {
  const StateLists states{exp_avgs,       exp_avg_sqs,       max_exp_avg_sqs,      master_params,
                          exp_avg_scales, exp_avg_sq_scales, max_exp_avg_sq_scales};
  check_list_length(grads, params.size(), "grads", false);
  const bool is_double = check_params_and_states(params, states, steps);
  for (size_t i = 0; i < params.size(); ++i) check_grad(grads[i], params[i], i, is_double);
  std::vector<TensorWork> work = state_work(params, states);
  const StepOptions options{lr,       beta1,     beta2,          eps,       weight_decay, mode, bias_correction,
                            maximize, lr_tensor, inv_grad_scale, found_inf, grad_scale, rounding_keys};
  update(work, work_items(work), pointers(params), pointers(grads), steps.data_ptr<double>(), is_double,
         !max_exp_avg_sqs.empty(), options, [&](bool unscaled_grads) {
           VersionBumps bumps;
           bumps.add(params);
           if (unscaled_grads) bumps.add(grads);
           for (at::TensorList list : {exp_avgs, exp_avg_sqs, max_exp_avg_sqs, master_params, exp_avg_scales,
                                       exp_avg_sq_scales, max_exp_avg_sq_scales}) {
             bumps.add(list);
           }
           bumps.add(steps);
         });
}

// ---- gradient statistics --------------------------------------------------------------------------------------

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
// depends neither on the thread count nor on who asked (grad_stats, or a plan's scaled step over the same tensors).
// source(t) gives tensor t's data pointer and dtype.
template <typename Source>
double sum_of_squares(const std::vector<WorkItem>& items, Source source) {
  std::vector<double> partial(items.size(), 0.0);
  at::parallel_for(0, int64_t(items.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const WorkItem& item = items[i];
      if (i + 1 < end) {
        const auto [next, next_type] = source(items[i + 1].tensor);
        prefetch_range(next, c10::elementSize(next_type), items[i + 1].begin, items[i + 1].end);
      }
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

// grad_stats' float32 [sum of squares, 1.0 if not finite] of a float64 total of squares.
at::Tensor stats_tensor(double total) {
  const auto [sum, nonfinite] = float_stats(total);
  at::Tensor out = at::empty({2}, at::TensorOptions().dtype(at::kFloat));
  out.data_ptr<float>()[0] = sum;
  out.data_ptr<float>()[1] = nonfinite ? 1.0f : 0.0f;
  return out;
}

// grad_stats over validated dense CPU tensors of float dtypes.
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

// Loss-scale unscaling, the inf/NaN check and global-norm clipping of a plan's scaled step, computed on the host from
// the gradients' statistics with no tensor ops. The arithmetic is FusedAdam._scaling's, in float32 and in torch's
// order (max_norm / x is reciprocal(x) * max_norm there), so both paths multiply the gradients by the same bits.

// The multiplier of every gradient (1/grad_scale times the clip coefficient), or nothing when the step must be
// skipped; sets scaling's outputs.
c10::optional<double> scaled_grad_multiplier(Scaling& scaling, const std::vector<TensorWork>& work,
                                             const std::vector<WorkItem>& items, bool found_inf) {
  const auto [sum, nonfinite] = float_stats(sum_of_squares(items, [&](int64_t t) {
    return std::make_pair(work[t].grad, work[t].grad_type);
  }));
  float inv = 1.0f;
  if (scaling.grad_scale.has_value()) inv = 1.0f / float(*scaling.grad_scale);
  // Every |g| / grad_scale <= norm, so a finite norm proves that unscaling stays finite (traps.md #14). The square
  // root is torch's own (a one-element tensor op, as in _scaling): torch's CPU float sqrt is not always correctly
  // rounded (MKL's vector math), and std::sqrt would then differ from it in the last bit.
  scaling.norm = at::scalar_tensor(sum, at::TensorOptions().dtype(at::kFloat)).sqrt().item<float>() * inv;
  if (scaling.max_grad_norm.has_value()) {
    const float coef = (1.0f / (scaling.norm + 1e-6f)) * float(*scaling.max_grad_norm);
    inv = inv * (coef > 1.0f ? 1.0f : coef);  // torch.clamp(max=1.0): NaN stays NaN (and the step is skipped)
  }
  scaling.skip = nonfinite || !std::isfinite(scaling.norm) || found_inf;
  if (scaling.skip) return c10::nullopt;
  return double(inv);
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

// ---- AdamPlan: one bucket's params and states, resolved once for many steps -----------------------------------

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
           std::vector<int64_t> param_objects, std::vector<int64_t> idle_objects)
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

  // Whether this plan can step now: every tensor it holds is as it was (data pointers of storages re-allocated in
  // place are re-resolved), every param has a usable gradient and no idle param has one. -1 when it can; else the
  // position of the first param that cannot (params.size() + j for idle_params[j]). Writes no tensor. step() and
  // grad_stats() need a successful check() first.
  int64_t check() {
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

  // One step with the params' current gradients, after a successful check(). grad_norm: also return grad_stats'
  // float32 [sum of squares, 1.0 if not finite] of the gradients as loaded, from the update's own pass (NaN sum when
  // the step was skipped); else an empty tensor.
  at::Tensor step(double lr, double beta1, double beta2, double eps, double weight_decay, int64_t mode,
                  bool bias_correction, bool maximize, c10::optional<at::Tensor> lr_tensor,
                  c10::optional<at::Tensor> inv_grad_scale, c10::optional<at::Tensor> found_inf,
                  c10::optional<at::Tensor> grad_scale, c10::optional<at::Tensor> rounding_keys, bool grad_norm) {
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

  // grad_stats over the params' current gradients, after a successful check().
  at::Tensor grad_stats() {
    TORCH_CHECK(checked_, "ort_optim.AdamPlan: grad_stats() needs a successful check() first");
    return grad_stats_of(grads_);
  }

 private:
  // Bumps the version counters of what a step writes (see VersionBumps), called by update() before its kernel runs:
  // the params (as check() resolved them), the gradients when they are unscaled in place, then the states, step
  // tensors and steps, one tensor per counter (state_counters_). Each counter is an allocation of its own, cold by
  // now: they are prefetched a few tensors ahead.
  void mark_written(bool unscaled_grads) {
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
  static constexpr size_t kCounterLookahead = 8;

  // Forgets what check() resolved for the step; passes a result through.
  int64_t release(int64_t result = -1) {
    checked_ = false;
    param_pointers_.clear();
    return result;
  }

  // The tensor of a Python tensor object. The plan may read it: FusedAdam checks a plan only while the group's
  // params list, which holds these objects, is the one the plan was made from.
  static const at::Tensor& tensor_of(PyObject* object) { return THPVariable_Unpack(object); }

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

  Watch watch(const at::Tensor& t) {
    const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
    Watch w{impl,      t.storage(), t.storage().data(), t.storage_offset(), bytes_needed(t), t.dtype(),
            uint32_t(geometry_.size()), uint16_t(t.dim())};
    geometry_.insert(geometry_.end(), t.sizes().begin(), t.sizes().end());
    geometry_.insert(geometry_.end(), t.strides().begin(), t.strides().end());
    return w;
  }

  // Whether the tensor still views the same storage the same way, and that storage still holds the view; records
  // whether the storage's data moved (the same storage re-allocated: resize_(0), then resize_(n)).
  bool still(Watch& w) const {
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

  // a == b[0, a.size()): a loop, where std::equal would call memcmp for the one or two dims of a typical tensor.
  static bool same(c10::IntArrayRef a, const int64_t* b) {
    for (size_t d = 0; d < a.size(); ++d) {
      if (a[d] != b[d]) return false;
    }
    return true;
  }

  // A state's storage was re-allocated in place: point the kernel's view at the new memory (same offset).
  void resolve_state(size_t i, size_t slot, const Watch& w) {
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

  // What the op's check_grad accepts, without raising: FusedAdam's own validation names the param when it is not.
  bool usable_grad(const at::Tensor& g, const Watch& param) const {
    if (!g.defined() || g.layout() != at::kStrided || !g.device().is_cpu()) return false;
    const at::ScalarType gt = g.scalar_type();
    if (!(is_double_ ? gt == at::kDouble : is_float_storage(gt))) return false;
    const c10::IntArrayRef sizes = g.sizes();
    if (sizes.size() != param.dim || !same(sizes, geometry_.data() + param.geometry)) return false;
    return g.has_storage() && g.storage().nbytes() >= bytes_needed(g);
  }

  // p.grad without Tensor::grad()'s is_leaf() check, which costs a call per param and warns for a non-leaf param
  // without a gradient (an idle param may be one).
  static const at::Tensor& grad_of(const at::Tensor& p) { return p.unsafeGetTensorImpl()->grad(); }

  // What check() reads is a chain of dependent pointers per param (its Python object, TensorImpl, then its storage
  // and autograd meta, then the grad's TensorImpl and storage; the states' TensorImpls), all cold by the next step.
  // Walked one param at a time, the core waits on one miss after another; prefetching each link a few params ahead
  // keeps several in flight.
  void prefetch_metadata(size_t i) const {
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

  static void prefetch_object(const void* object, size_t bytes) {
    for (size_t b = 0; b < bytes; b += 64) __builtin_prefetch(static_cast<const char*>(object) + b);
  }

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

 public:
  // step() with loss-scale unscaling, the inf/NaN check and global-norm clipping, after a successful check(): sums
  // the squares of the gradients check() resolved, computes the multiplier on the host (FusedAdam._scaling's float32
  // math, no tensor ops) and steps unless it must skip. Returns float32 [unscaled global norm, 1.0 if skipped].
  at::Tensor step_scaled(double lr, double beta1, double beta2, double eps, double weight_decay, int64_t mode,
                         bool bias_correction, bool maximize, c10::optional<at::Tensor> lr_tensor,
                         c10::optional<at::Tensor> grad_scale, c10::optional<double> max_grad_norm,
                         c10::optional<at::Tensor> found_inf, c10::optional<at::Tensor> rounding_keys) {
    TORCH_CHECK(checked_, "ort_optim.AdamPlan: step_scaled() needs a successful check() first");
    // The scale is read here, not in Python: a CPU scalar read by the CPU kernel, like the gradients (FusedAdam
    // takes this path only when grad_scale lives on the CPU).
    c10::optional<double> scale;
    if (grad_scale.has_value()) {
      TORCH_CHECK(grad_scale->device().is_cpu(), "ort_optim.AdamPlan: grad_scale must be a CPU tensor");
      scale = scalar_value(grad_scale, "grad_scale");
    }
    Scaling scaling{scale, max_grad_norm};
    StepOptions options{lr,       beta1,     beta2,        eps,      weight_decay, mode, bias_correction,
                        maximize, lr_tensor, c10::nullopt, found_inf, c10::nullopt, rounding_keys};
    options.scaling = &scaling;
    update(work_, items_, param_pointers_, grads_, steps_.data_ptr<double>(), is_double_, !max_exp_avg_sqs_.empty(),
           options, [this](bool unscaled_grads) { mark_written(unscaled_grads); });
    release();
    at::Tensor out = at::empty({2}, at::TensorOptions().dtype(at::kFloat));
    out.data_ptr<float>()[0] = scaling.norm;
    out.data_ptr<float>()[1] = scaling.skip ? 1.0f : 0.0f;
    return out;
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(ort_optim, CPU, m) {
  m.impl("adam_step_", &adam_step_cpu);
  m.impl("grad_stats", &grad_stats_cpu);
}

// A CPU-only helper class rather than an op: it has no schema of its own, and FusedAdam calls the adam_step_ op
// wherever it is not available (other backends, torch.compile).
TORCH_LIBRARY_FRAGMENT(ort_optim, m) {
  m.class_<AdamPlan>("AdamPlan")
      .def(torch::init<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                       std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                       std::vector<at::Tensor>, std::vector<at::Tensor>, at::Tensor, std::vector<at::Tensor>,
                       std::vector<int64_t>, std::vector<int64_t>>())
      .def("check", &AdamPlan::check)
      .def("step", &AdamPlan::step)
      .def("grad_stats", &AdamPlan::grad_stats)
      .def("step_scaled", &AdamPlan::step_scaled);
}

}  // namespace ort_optim
