// fp8 states (fp8.h; ops/README.md, "fp8 states").
#include "fp8.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "conversions.h"
#include "rounding.h"

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
    for (int64_t i = 0; i < len; ++i) d[i] = values(i);
  }
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
            // no zero level for sqrt(v) (the zero-point problem); code 0 is an overflowed v (only in a flagged block)
            code = ab == 0x7F800000u ? 0 : std::max(code, 1);
          } else {
            code = (b >> 31) != 0 && code > 0 ? code | 0x80 : code;  // the sign, never on a zero (no -0)
          }
          out[i] = uint8_t(code);
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

}  // namespace ort_optim
