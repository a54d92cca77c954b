// fp8 states: float8_e4m3fn / float8_e5m2 codes with a power-of-two float32 scale per 256 elements (ops/README.md,
// "fp8 states"; ort_optim/_spec.py, Fp8Format, states the rules and ort_optim/formats.py's quantize_fp8 is the
// definition, bit for bit). Decoded and encoded by exponent and mantissa arithmetic on the bits (no tables, no
// search), in branch-free loops over one block that the compiler vectorises, with AVX-512 by 16 lanes at once (the
// decode through float16's conversion); the Adam kernel calls the loads and stores per block of 256, and stores
// both moments of a block in one loop that hashes each element once (fp8_store_pair).
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <limits>

#include "conversions.h"
#include "ort_optim_spec.h"  // generated from ort_optim/_spec.py into the build folder (backends/native.py)

namespace ort_optim {

struct Fp8 {
  int mantissa_bits, bias, emax, max_code;
};

// The value of element i of one block of fp8 codes c (kMb mantissa bits, exponent bias kBias) with scale s: code * s,
// squared for a second moment, whose code 0 reads as inf in a flagged block (scale with its sign bit set, not NaN:
// an overflowed v). Branch-free, so that a loop calling it vectorises (fp8_load).
template <int kMb, int kBias, bool kSecondMoment>
struct Fp8Values {
  const uint8_t* c;
  float s;
  bool flagged;

  inline float operator()(int64_t i) const {
    const uint32_t code = c[i], mag = code & 0x7Fu;
    const float normal = bits_to_float((mag << (23 - kMb)) + (uint32_t(127 - kBias) << 23));
    const float sub_ulp = bits_to_float(uint32_t(127 + 1 - kBias - kMb) << 23);
    const float u = (mag >> kMb) == 0 ? float(int32_t(mag)) * sub_ulp : normal;
    const float x = bits_to_float(float_to_bits(u) | ((code & 0x80u) << 24)) * s;
    if constexpr (kSecondMoment) return flagged && code == 0 ? std::numeric_limits<float>::infinity() : x * x;
    return x;
  }
};

// The fp8 format of a state dtype, or nullptr.
const Fp8* fp8_of(at::ScalarType t);

// The random bits of the fp8 states of elements [off, off + n) in a step, from the step's new exp_avg m:
// fmix32(bits(m[i]) ^ (off + i) * 0x9E3779B1 ^ (step * 0x85EBCA77 + 0x6A09E667)); an fp8 exp_avg rounds with the top
// 16 bits, an fp8 second moment with the low 16 (formats.fp8_random_bits).
void fp8_random_bits(const float* m, int64_t off, int64_t n, uint32_t step, uint32_t* r);

// dst[0, n) = the values of elements [off, off + n) (off a multiple of spec::kFp8Block): code * scale, squared for a
// second moment (which holds sqrt(v)).
void fp8_load(const Fp8& f, bool second_moment, const void* codes, const float* scales, int64_t off, int64_t n,
              float* dst);

// Writes src[0, n) (v for a second moment; root: sqrt(v) when the caller has it) as the codes and scales of elements
// [off, off + n), rounding stochastically with rnd (fp8_random_bits of this step's exp_avg).
void fp8_store(const Fp8& f, bool second_moment, const float* src, const float* root, int64_t off, int64_t n,
               void* codes, float* scales, const uint32_t* rnd);

// Both moments of one block in a step (off a multiple of spec::kFp8Block, len <= spec::kFp8Block): m, root =
// sqrt(v) (v: the second moment, as fp8_store takes it), amax_m and amax_v the bits of the block's largest |m| and
// root (found by the caller); the same codes and scales as fp8_random_bits, then fp8_store of each, in one loop where
// both blocks get a scale (rnd: len scratch words for the other case).
void fp8_store_pair(const Fp8& fm, const Fp8& fv, const float* m, const float* v, const float* root, uint32_t amax_m,
                    uint32_t amax_v, int64_t off, int64_t len, uint32_t step, void* codes_m, float* scales_m,
                    void* codes_v, float* scales_v, uint32_t* rnd);

}  // namespace ort_optim
