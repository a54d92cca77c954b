// Conversions between the storage dtypes (float32, float16, bfloat16, float64) and the float/double scratch arrays
// the kernels compute in, and the power-of-two block scale of fp16 states. Header-only: the Adam kernel, the low-bit
// formats and the gradient statistics inline these into their loops. The fp16/bf16 conversions are explicit (F16C,
// bit tricks), because c10::Half in a loop stays scalar and runs at a tenth of memory speed.
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__F16C__) && defined(__AVX__)
#include <immintrin.h>
#define ORT_OPTIM_F16C 1
#endif

namespace ort_optim {

// fp16 states are scaled by a power of two so that the block's absolute maximum lands in (kFp16Limit/2, kFp16Limit]:
// half of fp16's range is left as headroom, and the rule is idempotent (see README.md, "fp16 states").
constexpr float kFp16Limit = 32768.0f;

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

// Whether a low-bit or fp8 second moment's block scale marks an overflowed v (its sign bit set, not NaN): the block's
// code 0 then reads as v = inf (ort_optim/_spec.py, LowBitFormat and Fp8Format).
inline bool overflow_flagged(float scale) { return std::signbit(scale) && !std::isnan(scale); }

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
inline void float_to_half(const float* src, int64_t n, uint16_t* dst, float mul) {
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

inline void bf16_to_float(const uint16_t* src, int64_t n, float* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = bits_to_float(uint32_t(src[i]) << 16);
}

// dst[i] = bf16(src[i] * mul): the product rounded to float, then to bfloat16 to nearest even, like
// c10::BFloat16(float); NaN becomes the quiet NaN 0x7FC0.
inline void float_to_bf16(const float* src, int64_t n, uint16_t* dst, float mul = 1.0f) {
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
inline float fp16_block_scale(float amax) {
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
// registers; where it is inf or NaN the scale is the largest finite one's (an overflowed v or an inf gradient's
// moment keeps its own value, the others theirs). no_zero (a second moment's sqrt(v)): a positive value that would
// round to 0 takes the smallest subnormal code (no zero level: formats.quantize_fp16).
inline void store_fp16_scaled(const float* src, int64_t n, uint16_t* dst, float* scale_out, uint32_t amax_bits,
                              bool no_zero = false) {
  if (amax_bits >= 0x7F800000u) {
    amax_bits = 0;
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t b = float_to_bits(src[i]) & 0x7FFFFFFFu;
      if (b < 0x7F800000u) amax_bits = std::max(amax_bits, b);
    }
  }
  float s = fp16_block_scale(bits_to_float(amax_bits));
  float_to_half(src, n, dst, s);
  if (no_zero) {
    for (int64_t i = 0; i < n; ++i) {
      if ((dst[i] & 0x7FFFu) == 0 && src[i] > 0.0f) dst[i] = 1;
    }
  }
  *scale_out = s;
}

}  // namespace ort_optim
