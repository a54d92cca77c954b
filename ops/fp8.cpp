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
    if (!values.flagged) {  // 16 codes at once (fp8_values16), the rest of the block by the scalar loop from the first
      const __m512 mul = _mm512_set1_ps(fp8_multiplier<kMb>(s));  // e5m2 vector that fp8_values16 leaves to it
      for (__m512 x; i + 16 <= len && fp8_values16<kMb, kSecondMoment>(codes + off + q + i, mul, x); i += 16) {
        _mm512_storeu_ps(d + i, x);
      }
    }
#endif
    for (; i < len; ++i) d[i] = values(i);
  }
}

// The code of one element u (sqrt(v) for a second moment) of a block with largest magnitude amax (bits), coded as top
// (the code of fp8_coded_amax), and 1 / scale inv, rounding stochastically with 16 random bits: they are added right
// below the kept bits (normal values: to the float32 bits; subnormal ones: to the value in fixed point with as many
// fraction bits, truncated from min(y, the smallest normal) * 2**(bias + 22)) and truncated, then capped at top. The
// block's largest magnitudes take top, so that a decoded block's largest value is the coded one and a re-encode
// gives the same scale. One formula for every element, without branches: a loop over it vectorises.
template <int kMb, int kBias, bool kSecondMoment>
inline uint8_t fp8_code(float x, uint32_t amax, int32_t top, float inv, uint32_t random16) {
  constexpr int kShift = 23 - kMb;
  const float min_normal = bits_to_float(uint32_t(127 + 1 - kBias) << 23);
  const float to_fixed = bits_to_float(uint32_t(127 + kBias + 22) << 23);
  const uint32_t b = float_to_bits(x), ab = b & 0x7FFFFFFFu;
  const float y = bits_to_float(ab) * inv;
  const uint32_t yb = float_to_bits(y);
  const uint32_t add = random16 << (kShift - 16);
  const int32_t normal = int32_t((yb + add) >> kShift) - ((127 - kBias) << kMb);
  const int32_t fixed = int32_t(std::min(y, min_normal) * to_fixed);
  const int32_t subnormal = int32_t((uint32_t(fixed) + add) >> kShift);
  int32_t code = ab == amax ? top : std::min(y < min_normal ? subnormal : normal, top);
  if constexpr (kSecondMoment) {
    // no zero level for sqrt(v) (the zero-point problem); code 0 is an overflowed v (only in a flagged block)
    code = ab == 0x7F800000u ? 0 : std::max(code, 1);
  } else {
    code = (b >> 31) != 0 && code > 0 ? code | 0x80 : code;  // the sign, never on a zero (no -0)
  }
  return uint8_t(code);
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
      const uint32_t* r = rnd + q;
      const uint32_t coded =
          fp8_coded_amax_sr<kMb, kEmax, kSecondMoment>(amax, kSecondMoment ? r[0] & 0xFFFFu : r[0] >> 16);
      if (fp8_zero_block<kEmax>(coded)) {
        s = 0.0f;
        std::memset(out, 0, len);
      } else {
        int32_t k = fp8_block_exponent<kEmax>(coded);
        if (kSecondMoment) k = std::max(k, fp8_min_sq_exponent<kMb>());
        s = bits_to_float(uint32_t(k + 127) << 23);
        const float inv = bits_to_float(uint32_t(127 - k) << 23);
        const int32_t top = fp8_top_code<kMb, kBias, kMaxCode>(coded, inv);
        for (int64_t i = 0; i < len; ++i) {
          const uint32_t bits = kSecondMoment ? r[i] & 0xFFFFu : r[i] >> 16;
          out[i] = fp8_code<kMb, kBias, kSecondMoment>(u[i], amax, top, inv, bits);
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



// Both fp8 moments of one block of len <= kFp8Block elements in a step (fp8_store_pair): one loop hashes each element
// once and codes both moments (Fp8PairCoder), when both blocks are regular; else the two plain stores.
template <class FM, class FV>
void fp8_store_pair(const float* m, const float* v, const float* root, uint32_t amax_m, uint32_t amax_v, int64_t off,
                    int64_t len, uint32_t step, uint8_t* codes_m, float* scales_m, uint8_t* codes_v, float* scales_v,
                    uint32_t* rnd) {
  const uint32_t step_hash = moment_step_hash(step), r0 = moment_random_bits_of(m[0], off, step_hash);
  const uint32_t coded_m = fp8_coded_amax_sr<FM::kMb, FM::kEmax, false>(amax_m, r0 >> 16),
                 coded_v = fp8_coded_amax_sr<FV::kMb, FV::kEmax, true>(amax_v, r0 & 0xFFFFu);
  const uint32_t inv_m = fp8_regular_inverse<FM::kMb, FM::kBias, FM::kEmax, FM::kMaxCode, false>(coded_m),
                 inv_v = fp8_regular_inverse<FV::kMb, FV::kBias, FV::kEmax, FV::kMaxCode, true>(coded_v);
  if (inv_m == 0 || inv_v == 0) {
    moment_random_bits(m, off, len, step, rnd);
    fp8_store<FM::kMb, FM::kBias, FM::kEmax, FM::kMaxCode, false>(m, nullptr, off, len, codes_m, scales_m, rnd);
    fp8_store<FV::kMb, FV::kBias, FV::kEmax, FV::kMaxCode, true>(v, root, off, len, codes_v, scales_v, rnd);
    return;
  }
  const float im = bits_to_float(inv_m), iv = bits_to_float(inv_v);
  const int32_t top_m = fp8_top_code<FM::kMb, FM::kBias, FM::kMaxCode>(coded_m, im),
                top_v = fp8_top_code<FV::kMb, FV::kBias, FV::kMaxCode>(coded_v, iv);
  uint8_t* __restrict__ cm = codes_m + off;
  uint8_t* __restrict__ cv = codes_v + off;
  int64_t i = 0;
#ifdef ORT_OPTIM_FP8_AVX512
  Fp8PairCoder<FM, FV> coder(amax_m, amax_v, m, off, step, codes_m, codes_v);
  for (; i + 16 <= len; i += 16) coder.code16(m + i, root + i, i);
#endif
  for (; i < len; ++i) {
    const uint32_t r = moment_random_bits_of(m[i], off + i, step_hash);
    cm[i] = fp8_code<FM::kMb, FM::kBias, false>(m[i], amax_m, top_m, im, r >> 16);
    cv[i] = fp8_code<FV::kMb, FV::kBias, true>(root[i], amax_v, top_v, iv, r & 0xFFFFu);
  }
  scales_m[off / kFp8Block] = bits_to_float((254u << 23) - inv_m);
  scales_v[off / kFp8Block] = bits_to_float((254u << 23) - inv_v);
}

}  // namespace

const Fp8* fp8_of(at::ScalarType t) {
  return t == at::kFloat8_e4m3fn ? &kFp8E4M3 : t == at::kFloat8_e5m2 ? &kFp8E5M2 : nullptr;
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
  const auto pair = [&](auto fm_type, auto fv_type) {
    fp8_store_pair<decltype(fm_type), decltype(fv_type)>(m, v, root, amax_m, amax_v, off, len, step, cm, scales_m, cv,
                                                         scales_v, rnd);
  };
  if (fm.mantissa_bits == 3) {
    fv.mantissa_bits == 3 ? pair(Fp8E4M3{}, Fp8E4M3{}) : pair(Fp8E4M3{}, Fp8E5M2{});
  } else {
    fv.mantissa_bits == 3 ? pair(Fp8E5M2{}, Fp8E4M3{}) : pair(Fp8E5M2{}, Fp8E5M2{});
  }
}

}  // namespace ort_optim
