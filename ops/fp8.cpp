// fp8 states (fp8.h; ops/README.md, "fp8 states").
#include "fp8.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "conversions.h"
#include "rounding.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__) && \
    defined(ORT_OPTIM_F16C)
#define ORT_OPTIM_FP8_AVX512 1
#endif

namespace ort_optim {
namespace {

const Fp8 kFp8E4M3{3, 7, 8, 0x7E};
const Fp8 kFp8E5M2{2, 15, 15, 0x7B};
constexpr int kFp8Block = spec::kFp8Block;

// The bits of the largest |x[i]| (a NaN's exceed infinity's); u = sqrt(x) where sqrt is set.
uint32_t fp8_block_amax(const float* x, int64_t len, bool sqrt, float* u) {
  uint32_t amax = 0;
  for (int64_t i = 0; i < len; ++i) {
    const float v = sqrt ? (u[i] = std::sqrt(x[i])) : x[i];
    amax = std::max(amax, float_to_bits(v) & 0x7FFFFFFFu);
  }
  return amax;
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
  for (int64_t q = 0; q < n; q += kFp8Block) {
    const int64_t len = std::min<int64_t>(kFp8Block, n - q);
    const float s = scales[(off + q) / kFp8Block];
    const Fp8Values<kMb, kBias, kSecondMoment> values{codes + off + q, s, kSecondMoment && overflow_flagged(s)};
    float* d = dst + q;
    int64_t i = 0;
#ifdef ORT_OPTIM_FP8_AVX512
    // The same values as Fp8Values, 16 codes at once: as float16 bits (sign at bit 15), converted exactly by one
    // instruction. e5m2 is float16's top byte (its magnitudes from 0x7C, which no encoder writes, are float16's inf
    // and NaN: those vectors go to the scalar loop); e4m3's magnitude below bit 14 reads as its value * 2**-8
    // (float16's exponent bias is 15, e4m3's 7; subnormals included), made exact again by the 2**8 folded into the
    // power-of-two scale (k <= 119: no overflow).
    if (!values.flagged) {
      const __m512 mul = _mm512_set1_ps(kMb == 2 ? s : 256.0f * s);
      for (; i + 16 <= len; i += 16) {
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + off + q + i));
        const __m256i c16 = _mm256_cvtepu8_epi16(bytes);
        const __m256i mag = _mm256_and_si256(c16, _mm256_set1_epi16(0x7F));
        if (kMb == 2 && _mm256_cmpge_epu16_mask(mag, _mm256_set1_epi16(0x7C))) break;
        const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(c16, _mm256_set1_epi16(0x80)), 8);
        const __m256i h = kMb == 2 ? _mm256_slli_epi16(c16, 8) : _mm256_or_si256(sign, _mm256_slli_epi16(mag, 7));
        __m512 x = _mm512_mul_ps(_mm512_cvtph_ps(h), mul);
        if constexpr (kSecondMoment) x = _mm512_mul_ps(x, x);
        _mm512_storeu_ps(d + i, x);
      }
    }
#endif
    for (; i < len; ++i) d[i] = values(i);
  }
}

// The code of one element u (sqrt(v) for a second moment) of a block with largest magnitude amax (bits) and
// 1 / scale inv, rounding stochastically with 16 random bits: they are added right below the kept bits (normal
// values: to the float32 bits; subnormal ones: to the value in fixed point with as many fraction bits, truncated from
// min(y, the smallest normal) * 2**(bias + 22)) and truncated. The block's largest magnitudes (always normal) add half
// an ulp minus one plus the lowest kept bit instead: to nearest even, so that the scale survives a decode and
// re-encode. One formula for every element, without branches: a loop over it vectorises.
template <int kMb, int kBias, int kMaxCode, bool kSecondMoment>
inline uint8_t fp8_code(float x, uint32_t amax, float inv, uint32_t random16) {
  constexpr int kShift = 23 - kMb;
  const float min_normal = bits_to_float(uint32_t(127 + 1 - kBias) << 23);
  const float to_fixed = bits_to_float(uint32_t(127 + kBias + 22) << 23);
  const uint32_t b = float_to_bits(x), ab = b & 0x7FFFFFFFu;
  const float y = bits_to_float(ab) * inv;
  const uint32_t yb = float_to_bits(y);
  const uint32_t add = ab == amax ? (1u << (kShift - 1)) - 1u + ((yb >> kShift) & 1u) : random16 << (kShift - 16);
  const int32_t normal = int32_t((yb + add) >> kShift) - ((127 - kBias) << kMb);
  const int32_t fixed = int32_t(std::min(y, min_normal) * to_fixed);
  const int32_t subnormal = int32_t((uint32_t(fixed) + add) >> kShift);
  int32_t code = std::min(y < min_normal ? subnormal : normal, kMaxCode);
  if constexpr (kSecondMoment) {
    // no zero level for sqrt(v) (the zero-point problem); code 0 is an overflowed v (only in a flagged block)
    code = ab == 0x7F800000u ? 0 : std::max(code, 1);
  } else {
    code = (b >> 31) != 0 && code > 0 ? code | 0x80 : code;  // the sign, never on a zero (no -0)
  }
  return uint8_t(code);
}

// A block's exponent k for its largest magnitude amax (bits; finite): the smallest k with amax / 2**k rounding to at
// most the largest finite code (amax's mantissa at 2**emax tells whether its exponent suffices), capped at
// 127 - emax. The block is coded with scale 2**k if amax > 0 and k >= spec::kFp8MinExponent, else it is a zero block.
template <int kMb, int kBias, int kEmax, int kMaxCode>
inline int32_t fp8_block_exponent(uint32_t amax) {
  const int32_t e = int32_t(amax >> 23) - 127;
  const float top = bits_to_float((amax & 0x7FFFFFu) | (uint32_t(kEmax + 127) << 23));
  return std::min(e - kEmax + (fp8_round<kMb, kBias>(top) > kMaxCode ? 1 : 0), 127 - kEmax);
}

// Writes src[0, n) (v for a second moment; root: sqrt(v) when the caller has it) as the codes and scales of elements
// [off, off + n), in a step, rounding stochastically with rnd (fp8_code).
template <int kMb, int kBias, int kEmax, int kMaxCode, bool kSecondMoment>
void fp8_store(const float* src, const float* root, int64_t off, int64_t n, uint8_t* codes, float* scales,
               const uint32_t* rnd) {
  float sqrt_v[kFp8Block];
  for (int64_t q = 0; q < n; q += kFp8Block) {
    const int64_t len = std::min<int64_t>(kFp8Block, n - q);
    const bool take_sqrt = kSecondMoment && !root;
    const float* u = take_sqrt ? sqrt_v : root ? root + q : src + q;
    uint32_t amax = fp8_block_amax(take_sqrt ? src + q : u, len, take_sqrt, sqrt_v);
    // sqrt(v) = inf and no NaN (whose bits exceed inf's): v overflowed float32, as torch's AdamW keeps it. The block
    // is coded by its finite values (codes >= 1), the overflowed ones take code 0 and the scale its sign bit
    // (_spec.Fp8Format): one element never makes its block's scale inf or NaN.
    const bool overflowed = kSecondMoment && amax == 0x7F800000u;
    if (overflowed) {
      amax = 0;
      for (int64_t i = 0; i < len; ++i) {
        const uint32_t b = float_to_bits(u[i]) & 0x7FFFFFFFu;
        amax = std::max(amax, b < 0x7F800000u ? b : 0u);
      }
    }
    uint8_t* out = codes + off + q;
    float s;
    if (amax >= 0x7F800000u) {  // inf or NaN in the block: it reads back as NaN everywhere (scale NaN, codes 0)
      s = std::numeric_limits<float>::quiet_NaN();
      std::memset(out, 0, len);
    } else {
      const int32_t k = fp8_block_exponent<kMb, kBias, kEmax, kMaxCode>(amax);
      if (amax == 0 || k < spec::kFp8MinExponent) {
        s = 0.0f;
        std::memset(out, 0, len);
      } else {
        s = bits_to_float(uint32_t(k + 127) << 23);
        const float inv = bits_to_float(uint32_t(127 - k) << 23);
        const uint32_t* r = rnd + q;
        for (int64_t i = 0; i < len; ++i) {
          out[i] = fp8_code<kMb, kBias, kMaxCode, kSecondMoment>(u[i], amax, inv,
                                                                 kSecondMoment ? r[i] & 0xFFFFu : r[i] >> 16);
        }
      }
      if (overflowed) {
        if (s == 0.0f) {  // a zero block: code 1 reads as 0 (times -0.0), code 0 as the overflowed v
          for (int64_t i = 0; i < len; ++i) out[i] = (float_to_bits(u[i]) & 0x7FFFFFFFu) == 0x7F800000u ? 0 : 1;
        }
        s = -s;  // (-0.0 for a zero block)
      }
    }
    scales[(off + q) / kFp8Block] = s;
  }
}

// The bits of 1 / 2**k for a block that fp8_store codes with a scale 2**k (finite amax > 0, not overflowed); 0 for
// every other block (zero, non-finite, overflowed), which the plain stores handle.
template <int kMb, int kBias, int kEmax, int kMaxCode>
inline uint32_t fp8_regular_inverse(uint32_t amax) {
  if (amax == 0 || amax >= 0x7F800000u) return 0;
  const int32_t k = fp8_block_exponent<kMb, kBias, kEmax, kMaxCode>(amax);
  return k < spec::kFp8MinExponent ? 0 : uint32_t(127 - k) << 23;
}

#ifdef ORT_OPTIM_FP8_AVX512
inline __m512i fmix32x16(__m512i x) {  // fmix32 on 16 lanes
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(int(0x85EBCA6Bu)));
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 13));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(int(0xC2B2AE35u)));
  return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
}

// fp8_code of 16 elements with bits b of a regular block (finite, no overflowed v; amax: the bits of its largest
// magnitude, inv: 1 / its scale) and 16 random bits per lane. Two cases that most vectors lack take branches: the
// block's largest magnitude (to nearest even) and subnormal codes.
template <int kMb, int kBias, int kMaxCode, bool kSecondMoment>
inline __m512i fp8_codes16(__m512i b, __m512i amax, __m512 inv, __m512i random16) {
  constexpr int kShift = 23 - kMb;
  const __m512 min_normal = _mm512_set1_ps(bits_to_float(uint32_t(127 + 1 - kBias) << 23));
  const __m512i ab = _mm512_and_si512(b, _mm512_set1_epi32(0x7FFFFFFF));
  const __m512 y = _mm512_mul_ps(_mm512_castsi512_ps(ab), inv);
  const __m512i yb = _mm512_castps_si512(y);
  __m512i add = _mm512_slli_epi32(random16, kShift - 16);
  const __mmask16 top = _mm512_cmpeq_epi32_mask(ab, amax);
  if (top) {
    const __m512i even = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(yb, kShift), _mm512_set1_epi32(1)),
                                          _mm512_set1_epi32(int((1u << (kShift - 1)) - 1u)));
    add = _mm512_mask_blend_epi32(top, add, even);
  }
  __m512i code = _mm512_sub_epi32(_mm512_srli_epi32(_mm512_add_epi32(yb, add), kShift),
                                  _mm512_set1_epi32((127 - kBias) << kMb));
  const __mmask16 subnormal = _mm512_cmp_ps_mask(y, min_normal, _CMP_LT_OQ);
  if (subnormal) {
    const __m512i fixed = _mm512_cvttps_epi32(
        _mm512_mul_ps(_mm512_min_ps(y, min_normal), _mm512_set1_ps(bits_to_float(uint32_t(127 + kBias + 22) << 23))));
    code = _mm512_mask_blend_epi32(subnormal, code, _mm512_srli_epi32(_mm512_add_epi32(fixed, add), kShift));
  }
  code = _mm512_min_epi32(code, _mm512_set1_epi32(kMaxCode));
  if constexpr (kSecondMoment) return _mm512_max_epi32(code, _mm512_set1_epi32(1));  // (no inf in a regular block)
  const __mmask16 negative = _mm512_movepi32_mask(b) & _mm512_test_epi32_mask(code, code);
  return _mm512_mask_or_epi32(code, negative, code, _mm512_set1_epi32(0x80));
}
#endif

// Both fp8 moments of one block of len <= kFp8Block elements in a step (fp8_store_pair): one loop hashes each element
// once and codes both moments, when both blocks are regular; else the two plain stores.
template <int kMbM, int kBiasM, int kEmaxM, int kMaxM, int kMbV, int kBiasV, int kEmaxV, int kMaxV>
void fp8_store_pair(const float* m, const float* v, const float* root, uint32_t amax_m, uint32_t amax_v, int64_t off,
                    int64_t len, uint32_t step, uint8_t* codes_m, float* scales_m, uint8_t* codes_v, float* scales_v,
                    uint32_t* rnd) {
  const uint32_t inv_m = fp8_regular_inverse<kMbM, kBiasM, kEmaxM, kMaxM>(amax_m),
                 inv_v = fp8_regular_inverse<kMbV, kBiasV, kEmaxV, kMaxV>(amax_v);
  if (inv_m == 0 || inv_v == 0) {
    fp8_random_bits(m, off, len, step, rnd);
    fp8_store<kMbM, kBiasM, kEmaxM, kMaxM, false>(m, nullptr, off, len, codes_m, scales_m, rnd);
    fp8_store<kMbV, kBiasV, kEmaxV, kMaxV, true>(v, root, off, len, codes_v, scales_v, rnd);
    return;
  }
  const float im = bits_to_float(inv_m), iv = bits_to_float(inv_v);
  const uint32_t e0 = uint32_t(off) * 0x9E3779B1u, step_hash = step * 0x85EBCA77u + 0x6A09E667u;
  uint8_t* __restrict__ cm = codes_m + off;
  uint8_t* __restrict__ cv = codes_v + off;
  int64_t i = 0;
#ifdef ORT_OPTIM_FP8_AVX512
  const __m512i amax_m16 = _mm512_set1_epi32(int(amax_m)), amax_v16 = _mm512_set1_epi32(int(amax_v));
  const __m512 im16 = _mm512_set1_ps(im), iv16 = _mm512_set1_ps(iv);
  __m512i e_hash = _mm512_mullo_epi32(
      _mm512_add_epi32(_mm512_set1_epi32(int(uint32_t(off))),
                       _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)),
      _mm512_set1_epi32(int(0x9E3779B1u)));
  for (; i + 16 <= len; i += 16) {
    const __m512i bm = _mm512_castps_si512(_mm512_loadu_ps(m + i)), bv = _mm512_castps_si512(_mm512_loadu_ps(root + i));
    const __m512i r = fmix32x16(_mm512_xor_si512(_mm512_xor_si512(bm, e_hash), _mm512_set1_epi32(int(step_hash))));
    e_hash = _mm512_add_epi32(e_hash, _mm512_set1_epi32(int(16u * 0x9E3779B1u)));
    const __m512i code_m = fp8_codes16<kMbM, kBiasM, kMaxM, false>(bm, amax_m16, im16, _mm512_srli_epi32(r, 16));
    const __m512i code_v = fp8_codes16<kMbV, kBiasV, kMaxV, true>(
        bv, amax_v16, iv16, _mm512_and_si512(r, _mm512_set1_epi32(0xFFFF)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(cm + i), _mm512_cvtepi32_epi8(code_m));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(cv + i), _mm512_cvtepi32_epi8(code_v));
  }
#endif
  for (; i < len; ++i) {
    const uint32_t r = fmix32(float_to_bits(m[i]) ^ (e0 + uint32_t(i) * 0x9E3779B1u) ^ step_hash);
    cm[i] = fp8_code<kMbM, kBiasM, kMaxM, false>(m[i], amax_m, im, r >> 16);
    cv[i] = fp8_code<kMbV, kBiasV, kMaxV, true>(root[i], amax_v, iv, r & 0xFFFFu);
  }
  scales_m[off / kFp8Block] = bits_to_float((254u << 23) - inv_m);
  scales_v[off / kFp8Block] = bits_to_float((254u << 23) - inv_v);
}

}  // namespace

const Fp8* fp8_of(at::ScalarType t) {
  return t == at::kFloat8_e4m3fn ? &kFp8E4M3 : t == at::kFloat8_e5m2 ? &kFp8E5M2 : nullptr;
}

void fp8_random_bits(const float* m, int64_t off, int64_t n, uint32_t step, uint32_t* r) {
  const uint32_t e0 = uint32_t(off) * 0x9E3779B1u, step_hash = step * 0x85EBCA77u + 0x6A09E667u;
  for (int64_t i = 0; i < n; ++i) r[i] = fmix32(float_to_bits(m[i]) ^ (e0 + uint32_t(i) * 0x9E3779B1u) ^ step_hash);
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

void fp8_store_pair(const Fp8& fm, const Fp8& fv, const float* m, const float* v, const float* root, uint32_t amax_m,
                    uint32_t amax_v, int64_t off, int64_t len, uint32_t step, void* codes_m, float* scales_m,
                    void* codes_v, float* scales_v, uint32_t* rnd) {
  uint8_t* cm = static_cast<uint8_t*>(codes_m);
  uint8_t* cv = static_cast<uint8_t*>(codes_v);
  if (fm.mantissa_bits == 3 && fv.mantissa_bits == 3) {
    fp8_store_pair<3, 7, 8, 0x7E, 3, 7, 8, 0x7E>(m, v, root, amax_m, amax_v, off, len, step, cm, scales_m, cv, scales_v,
                                                 rnd);
  } else if (fm.mantissa_bits == 3) {
    fp8_store_pair<3, 7, 8, 0x7E, 2, 15, 15, 0x7B>(m, v, root, amax_m, amax_v, off, len, step, cm, scales_m, cv,
                                                   scales_v, rnd);
  } else if (fv.mantissa_bits == 3) {
    fp8_store_pair<2, 15, 15, 0x7B, 3, 7, 8, 0x7E>(m, v, root, amax_m, amax_v, off, len, step, cm, scales_m, cv,
                                                   scales_v, rnd);
  } else {
    fp8_store_pair<2, 15, 15, 0x7B, 2, 15, 15, 0x7B>(m, v, root, amax_m, amax_v, off, len, step, cm, scales_m, cv,
                                                     scales_v, rnd);
  }
}

}  // namespace ort_optim
