// Stochastic rounding of bfloat16 params (ops/README.md, "Stochastic rounding"), and the counter-based hashes it is
// built from (splitmix64, murmur3's fmix32), and the random bits of the low-bit and fp8 moments' stochastic rounding.
// No generator state: the random bits are a function of (key or state, step, element), so a run resumes exactly from
// a checkpoint.
#pragma once

#include <cstdint>

#include "conversions.h"
#include "ort_optim_spec.h"  // generated from ort_optim/_spec.py into the build folder (backends/native.py)

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace ort_optim {

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

#ifdef __AVX512F__
// fmix32 on 16 lanes without its last step (x ^ (x >> 16)), for a caller that takes the result's two halves apart
// (Fp8PairCoder::code16 folds that step into each half).
inline __m512i fmix32x16_but_last(__m512i x) {
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(int(0x85EBCA6Bu)));
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 13));
  return _mm512_mullo_epi32(x, _mm512_set1_epi32(int(0xC2B2AE35u)));
}

// The low byte of each 32-bit lane of x, in order: _mm512_cvtepi32_epi8 (which truncates), by one byte permute where
// AVX-512 VBMI has it (the narrowing is two uops on Intel's AVX-512 cores, the permute one).
inline __m128i low_bytes16(__m512i x) {
#ifdef __AVX512VBMI__
  const __m512i first_bytes = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x3C383430, 0x2C282420, 0x1C181410,
                                               0x0C080400);
  return _mm512_castsi512_si128(_mm512_permutexvar_epi8(first_bytes, x));
#else
  return _mm512_cvtepi32_epi8(x);
#endif
}

inline __m512i fmix32x16(__m512i x) {  // fmix32 on 16 lanes
  x = fmix32x16_but_last(x);
  return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
}

// The element hashes e * 0x9E3779B1 (uint32) of elements off to off + 15, one per lane, of the moments' random bits
// (moment_random_bits); the next 16 elements' are these plus kElementHashStep16.
inline __m512i element_hash16(int64_t off) {
  return _mm512_mullo_epi32(_mm512_add_epi32(_mm512_set1_epi32(int(uint32_t(off))),
                                             _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)),
                            _mm512_set1_epi32(int(0x9E3779B1u)));
}
constexpr uint32_t kElementHashStep16 = 16u * 0x9E3779B1u;
#endif

// The random bits of the moment states' stochastic rounding in a step (ort_optim/_spec.py, MOMENT_RANDOM_BITS; the
// low-bit and fp8 formats): r = fmix32(bits(m) ^ e * 0x9E3779B1 ^ moment_step_hash(step)) for element e of a tensor
// whose new exp_avg there is m. exp_avg rounds with r >> 16, exp_avg_sq and max_exp_avg_sq with r & 0xFFFF: one hash
// per element for both moments. moment_random_bits gives r[i] of elements [off, off + n); the vector coders that hash
// as they code take the same pieces (element_hash16, fmix32x16).
inline uint32_t moment_step_hash(uint32_t step) { return step * 0x85EBCA77u + 0x6A09E667u; }
// A NaN m hashes as the canonical NaN (spec::kCanonicalNan): a NaN's sign and payload depend on the operations that
// made it, which differ between backends.
inline uint32_t moment_hash_bits(float m) { return m != m ? spec::kCanonicalNan : float_to_bits(m); }
inline uint32_t moment_random_bits_of(float m, int64_t e, uint32_t step_hash) {
  return fmix32(moment_hash_bits(m) ^ (uint32_t(e) * 0x9E3779B1u) ^ step_hash);
}
inline void moment_random_bits(const float* m, int64_t off, int64_t n, uint32_t step, uint32_t* r) {
  const uint32_t step_hash = moment_step_hash(step);
  int64_t i = 0;
#ifdef __AVX512F__
  __m512i e_hash = element_hash16(off);
  const __m512i step16 = _mm512_set1_epi32(int(step_hash));
  for (; i + 16 <= n; i += 16) {  // (the element hash advances by addition)
    const __m512 x = _mm512_loadu_ps(m + i);
    const __m512i b = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_castps_si512(x),
                                              _mm512_set1_epi32(int(spec::kCanonicalNan)));
    _mm512_storeu_si512(r + i, fmix32x16(_mm512_xor_si512(_mm512_xor_si512(b, e_hash), step16)));
    e_hash = _mm512_add_epi32(e_hash, _mm512_set1_epi32(int(kElementHashStep16)));
  }
#endif
  for (; i < n; ++i) r[i] = moment_random_bits_of(m[i], off + i, step_hash);
}

// dst[i] = bf16(src[i]) rounded stochastically: up in magnitude with probability (the dropped 16 bits) / 2^16, from
// 16 random bits of hash(key, element index off + i). key = splitmix64(rounding key ^ splitmix64(step)). Non-finite
// values round to nearest (NaN -> 0x7FC0).
inline void float_to_bf16_stochastic(const float* src, int64_t n, uint16_t* dst, uint64_t key, int64_t off) {
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

}  // namespace ort_optim
