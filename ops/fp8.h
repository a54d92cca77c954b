// fp8 states: float8_e4m3fn / float8_e5m2 codes with a power-of-two float32 scale per 256 elements (ops/README.md,
// "fp8 states"; ort_optim/_spec.py, Fp8Format, states the rules and ort_optim/formats.py's quantize_fp8 is the
// definition, bit for bit). Decoded and encoded by exponent and mantissa arithmetic on the bits (no tables, no
// search), in branch-free loops over one block that the compiler vectorises, with AVX-512 by 16 lanes at once (the
// decode through float16's conversion, fp8_values16). Both moments of a block are coded in one loop that hashes
// each element once (Fp8PairCoder): fp8_store_pair's, and the Adam kernel's, which codes one block while it updates
// the next (update_fp8 in adam_kernel.cpp). That loop is bound by its vector instructions (the update's divisions
// and square roots run beside them), so its common case is short: a vector whose codes are all normal (no zero, no
// subnormal code) is coded by integer arithmetic on the bits (Fp8Coder16), finished on the packed bytes; the others
// take the general form (fp8_codes16).
#pragma once

#include <c10/core/ScalarType.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "conversions.h"
#include "ort_optim_spec.h"  // generated from ort_optim/_spec.py into the build folder (backends/native.py)
#include "rounding.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__) && \
    defined(ORT_OPTIM_F16C)
#define ORT_OPTIM_FP8_AVX512 1
#endif

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

// A block's exponent k for a largest magnitude amax (bits; finite, normal): the smallest k with amax / 2**k at most the
// largest finite value, 1.75 * 2**emax in both formats (amax's mantissa tells whether its exponent suffices), capped
// at 127 - emax.
template <int kEmax>
inline int32_t fp8_block_exponent(uint32_t amax) {
  const int32_t e = int32_t(amax >> 23) - 127;
  return std::min(e - kEmax + ((amax & 0x7FFFFFu) > spec::kFp8MaxMantissa ? 1 : 0), 127 - kEmax);
}

// The bits of a block's largest magnitude as the block codes it (_spec.Fp8Format; formats.fp8_coded_amax): amax (bits;
// finite) divided by 2**k0, k0 = fp8_block_exponent(amax), rounded in the format with add below the kept bits (the
// random bits of a step; half an ulp minus one plus the lowest kept bit: to nearest even), at most the largest finite
// value, times 2**k0. 0 where amax lies below 2**(emax + kFp8MinExponent - 1): a zero block however it rounds.
template <int kMb, int kEmax>
inline uint32_t fp8_coded_amax(uint32_t amax, uint32_t add) {
  if (int32_t(amax >> 23) - 127 < kEmax + spec::kFp8MinExponent - 1) return 0;
  constexpr int kShift = 23 - kMb;
  const int32_t k0 = fp8_block_exponent<kEmax>(amax);
  const uint32_t y = amax - (uint32_t(k0) << 23);  // (amax / 2**k0: normal, exponent emax - 1 or emax)
  const uint32_t kept = ((y + add) >> kShift) << kShift;
  return std::min(kept, (uint32_t(kEmax + 127) << 23) | spec::kFp8MaxMantissa) + (uint32_t(k0) << 23);
}

// fp8_coded_amax in a step: rounded stochastically with 16 random bits (those of the block's first element). A second
// moment's finite amax is at most kFp8MaxRootBits first (_spec.FP8_MAX_ROOT: the decoded v = M * M stays finite).
template <int kMb, int kEmax, bool kSecondMoment>
inline uint32_t fp8_coded_amax_sr(uint32_t amax, uint32_t random16) {
  if (amax >= 0x7F800000u) return amax;
  return fp8_coded_amax<kMb, kEmax>(kSecondMoment ? std::min(amax, spec::kFp8MaxRootBits) : amax,
                                    random16 << (23 - kMb - 16));
}

// The code of a block's coded largest magnitude (bits, fp8_coded_amax) at the block's 1 / scale inv: the code every
// element equal to the largest takes and none exceeds (exact, but at a second moment's floor of k: to nearest even).
template <int kMb, int kBias, int kMaxCode>
inline int32_t fp8_top_code(uint32_t coded_amax, float inv) {
  return std::min(fp8_round<kMb, kBias>(bits_to_float(coded_amax) * inv), kMaxCode);
}

// Whether a block whose coded largest magnitude is coded_amax (bits, fp8_coded_amax) is a zero block (scale 0, codes
// 0): below 2**(emax + kFp8MinExponent). A decoded block's largest value is coded_amax itself, so a re-encode decides
// the same.
template <int kEmax>
inline bool fp8_zero_block(uint32_t coded_amax) {
  return int32_t(coded_amax >> 23) - 127 < kEmax + spec::kFp8MinExponent;
}

// A second moment's smallest block exponent k (_spec.Fp8Format.min_sq_exponent, _spec.MIN_SQRT_V): below it, the
// block is coded with this k.
template <int kMb>
constexpr int32_t fp8_min_sq_exponent() {
  static_assert(kMb == 3 || kMb == 2, "e4m3fn or e5m2");
  return kMb == 3 ? spec::kFp8E4M3MinSqExponent : spec::kFp8E5M2MinSqExponent;
}

// The bits of 1 / 2**k for a block that fp8_store codes with a scale 2**k, k = fp8_block_exponent(coded_amax) (a
// finite, non-zero block, not overflowed; for a second moment k at least fp8_min_sq_exponent); 0 for every other
// block (zero, non-finite, overflowed, a second moment's below that floor), which the plain stores handle.
template <int kMb, int kBias, int kEmax, int kMaxCode, bool kSecondMoment>
inline uint32_t fp8_regular_inverse(uint32_t coded_amax) {
  if (coded_amax >= 0x7F800000u || fp8_zero_block<kEmax>(coded_amax)) return 0;
  const int32_t k = fp8_block_exponent<kEmax>(coded_amax);
  if (kSecondMoment && k < fp8_min_sq_exponent<kMb>()) return 0;
  return uint32_t(127 - k) << 23;
}

#ifdef ORT_OPTIM_FP8_AVX512

// fp8_code of 16 elements with bits b of a regular block (finite, no overflowed v; amax: the bits of its largest
// magnitude, top: the code of its coded largest magnitude, inv: 1 / its scale), with add the random bits placed right
// below the kept bits (16 random bits shifted left by 23 - kMb - 16). Every case: Fp8PairCoder::code16 takes it for
// the vectors that its shorter form leaves out. Subnormal codes, which most vectors lack, take a branch.
template <int kMb, int kBias, bool kSecondMoment>
inline __m512i fp8_codes16(__m512i b, __m512i amax, __m512i top, __m512 inv, __m512i add) {
  constexpr int kShift = 23 - kMb;
  const __m512 min_normal = _mm512_set1_ps(bits_to_float(uint32_t(127 + 1 - kBias) << 23));
  const __m512i ab = _mm512_and_si512(b, _mm512_set1_epi32(0x7FFFFFFF));
  const __m512 y = _mm512_mul_ps(_mm512_castsi512_ps(ab), inv);
  const __m512i yb = _mm512_castps_si512(y);
  __m512i code = _mm512_sub_epi32(_mm512_srli_epi32(_mm512_add_epi32(yb, add), kShift),
                                  _mm512_set1_epi32((127 - kBias) << kMb));
  const __mmask16 subnormal = _mm512_cmp_ps_mask(y, min_normal, _CMP_LT_OQ);
  if (subnormal) {
    const __m512i fixed = _mm512_cvttps_epi32(
        _mm512_mul_ps(_mm512_min_ps(y, min_normal), _mm512_set1_ps(bits_to_float(uint32_t(127 + kBias + 22) << 23))));
    code = _mm512_mask_blend_epi32(subnormal, code, _mm512_srli_epi32(_mm512_add_epi32(fixed, add), kShift));
  }
  code = _mm512_mask_mov_epi32(_mm512_min_epi32(code, top), _mm512_cmpeq_epi32_mask(ab, amax), top);
  if constexpr (kSecondMoment) return _mm512_max_epi32(code, _mm512_set1_epi32(1));  // (no inf in a regular block)
  const __mmask16 negative = _mm512_movepi32_mask(b) & _mm512_test_epi32_mask(code, code);
  return _mm512_mask_or_epi32(code, negative, code, _mm512_set1_epi32(0x80));
}
#endif

// The two fp8 formats as types, for the templates below: mantissa bits, exponent bias, largest exponent, largest
// finite magnitude code (the values of kFp8E4M3 and kFp8E5M2).
template <int kMb_, int kBias_, int kEmax_, int kMaxCode_>
struct Fp8Type {
  static constexpr int kMb = kMb_, kBias = kBias_, kEmax = kEmax_, kMaxCode = kMaxCode_;
};
using Fp8E4M3 = Fp8Type<3, 7, 8, 0x7E>;
using Fp8E5M2 = Fp8Type<2, 15, 15, 0x7B>;

#ifdef ORT_OPTIM_FP8_AVX512
// One moment's codes of 16 elements of a regular block (fp8_regular_inverse of amax_bits non-zero), for
// Fp8PairCoder. The elements whose y = |x| / scale is normal in the format (|x| >= low, as bits) take a shorter form of
// fp8_codes16: y's bits are |x|'s less k << 23 (scale 2**k: exact), so the code is ((|x| + add) >> (23 - kMb)) -
// ((127 - bias + k) << kMb), normal (>= 1: no zero, and a second moment needs no floor), whose difference and cap are
// taken on the packed bytes (the code before the cap is below 256, so its low byte less the bias's is the code); the
// cap is the code of the coded largest magnitude (top, found once), which the block's largest magnitudes take. The
// other elements (zero, subnormal codes, a second moment's sign bit, which then fails |x| >= low as a signed
// integer) take fp8_codes16.
template <class F, bool kSecondMoment>
struct Fp8Coder16 {
  static constexpr int kShift = 23 - F::kMb;
  __m512i amax, low, top32;
  __m512 inv;
  __m128i bias, top;

  // amax_bits: the block's largest magnitude; coded_bits: as coded (fp8_coded_amax); inv_bits: 1 / the block's scale.
  Fp8Coder16(uint32_t amax_bits, uint32_t coded_bits, uint32_t inv_bits) {
    const int32_t k = 127 - int32_t(inv_bits >> 23);
    const float inv_f = bits_to_float(inv_bits);
    const int32_t top_code = fp8_top_code<F::kMb, F::kBias, F::kMaxCode>(coded_bits, inv_f);
    amax = _mm512_set1_epi32(int(amax_bits));
    top32 = _mm512_set1_epi32(top_code);
    inv = _mm512_set1_ps(inv_f);
    // (min_normal * 2**k as bits; the block exponent keeps it a normal float32 for every k a regular block takes,
    // and the lowest normal float32 if not: every float32 subnormal |x| takes fp8_codes16)
    low = _mm512_set1_epi32(std::max(128 - F::kBias + k, 1) << 23);
    bias = _mm_set1_epi8(char(uint32_t(127 - F::kBias + k) << F::kMb));
    top = _mm_set1_epi8(char(top_code));
  }

  // The lanes of ab (= |x| as bits; a second moment: x's bits) that take fp8_codes16.
  inline __mmask16 other(__m512i ab) const { return _mm512_cmplt_epi32_mask(ab, low); }

  // The codes of the lanes that other() leaves, with b x's bits and ab its magnitude's.
  inline __m128i normal_codes(__m512i b, __m512i ab, __m512i add) const {
    __m128i c = low_bytes16(_mm512_srli_epi32(_mm512_add_epi32(ab, add), kShift));
    c = _mm_min_epu8(_mm_sub_epi8(c, bias), top);
    c = _mm_mask_mov_epi8(c, _mm512_cmpeq_epi32_mask(ab, amax), top);
    if constexpr (!kSecondMoment) {  // the sign (the code is not 0): + 0x80
      c = _mm_mask_add_epi8(c, _mm512_movepi32_mask(b), c, _mm_set1_epi8(char(0x80)));
    }
    return c;
  }

  // The codes of every lane.
  inline __m128i codes(__m512i b, __m512i add) const {
    return low_bytes16(fp8_codes16<F::kMb, F::kBias, kSecondMoment>(b, amax, top32, inv, add));
  }

  // fp8_codes16's add for the 16 random bits r >> 16 (kHigh; exp_avg) or r & 0xFFFF (exp_avg_sq) of
  // r = fmix32(...) = x ^ (x >> 16), with x the hash before fmix32's last step: r >> 16 is x >> 16, and
  // r & 0xFFFF is (x ^ (x >> 16)) & 0xFFFF.
  template <bool kHigh>
  static inline __m512i random_add(__m512i x) {
    constexpr int kLeft = kShift - 16;
    const __m512i high = _mm512_srli_epi32(x, 16 - kLeft), mask = _mm512_set1_epi32(int(0xFFFFu << kLeft));
    if constexpr (kHigh) return _mm512_and_si512(high, mask);
    return _mm512_ternarylogic_epi32(_mm512_slli_epi32(x, kLeft), high, mask, 0x28);  // (a ^ b) & c
  }
};

// The codes of both fp8 moments of one block of 256 elements in a step, 16 elements per call of code16 (in order),
// when both blocks are regular (fp8_regular_inverse of both amax non-zero): the same codes and scales as
// moment_random_bits then fp8_store of each moment. amax_m, amax_v: the bits of the block's largest |m| and sqrt(v).
// fp8_store_pair's vector loop, and the Adam kernel's loop that codes one block while it updates the next.
template <class FM, class FV>
struct Fp8PairCoder {
  uint32_t r0, coded_m, coded_v;  // the block's first element's random bits; each largest magnitude as coded
  uint32_t inv_m, inv_v;  // the bits of 1 / scale of each moment; 0: not a regular block (nothing coded here)
  Fp8Coder16<FM, false> coder_m;
  Fp8Coder16<FV, true> coder_v;
  __m512i e_hash, step_hash;
  uint8_t* cm;
  uint8_t* cv;

  // m: the block's new exp_avg (its first element's random bits round both largest magnitudes).
  Fp8PairCoder(uint32_t amax_m, uint32_t amax_v, const float* m, int64_t off, uint32_t step, uint8_t* codes_m,
               uint8_t* codes_v)
      : r0(moment_random_bits_of(m[0], off, moment_step_hash(step))),
        coded_m(fp8_coded_amax_sr<FM::kMb, FM::kEmax, false>(amax_m, r0 >> 16)),
        coded_v(fp8_coded_amax_sr<FV::kMb, FV::kEmax, true>(amax_v, r0 & 0xFFFFu)),
        inv_m(fp8_regular_inverse<FM::kMb, FM::kBias, FM::kEmax, FM::kMaxCode, false>(coded_m)),
        inv_v(fp8_regular_inverse<FV::kMb, FV::kBias, FV::kEmax, FV::kMaxCode, true>(coded_v)),
        coder_m(amax_m, coded_m, inv_m),
        coder_v(amax_v, coded_v, inv_v),
        e_hash(element_hash16(off)),
        step_hash(_mm512_set1_epi32(int(moment_step_hash(step)))),
        cm(codes_m + off),
        cv(codes_v + off) {}

  bool regular() const { return inv_m != 0 && inv_v != 0; }

  // Elements [i, i + 16) of the block: m and root (= sqrt(v)) point at element i. fmix32 of moment_random_bits
  // without its last step (Fp8Coder16::random_add); m's raw bits, as a regular block holds no NaN m (its largest |m|
  // is finite). Always inlined: update_fp8 calls it inside the params' loop, whose other ports' work it is; called
  // out of line there (as GCC chose once that loop grew), the step took 20% longer.
  __attribute__((always_inline)) inline void code16(const float* m, const float* root, int64_t i) {
    const __m512i bm = _mm512_castps_si512(_mm512_loadu_ps(m)), bv = _mm512_castps_si512(_mm512_loadu_ps(root));
    const __m512i x = fmix32x16_but_last(_mm512_ternarylogic_epi32(bm, e_hash, step_hash, 0x96));  // (a ^ b ^ c)
    e_hash = _mm512_add_epi32(e_hash, _mm512_set1_epi32(int(kElementHashStep16)));
    const __m512i add_m = Fp8Coder16<FM, false>::template random_add<true>(x);
    const __m512i add_v = Fp8Coder16<FV, true>::template random_add<false>(x);
    const __m512i ab_m = _mm512_and_si512(bm, _mm512_set1_epi32(0x7FFFFFFF));
    __m128i code_m, code_v;
    if (__builtin_expect((coder_m.other(ab_m) | coder_v.other(bv)) == 0, 1)) {
      code_m = coder_m.normal_codes(bm, ab_m, add_m);
      code_v = coder_v.normal_codes(bv, bv, add_v);
    } else {
      code_m = coder_m.codes(bm, add_m);
      code_v = coder_v.codes(bv, add_v);
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(cm + i), code_m);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(cv + i), code_v);
  }

  // The scales 2**k of both blocks (the block index: off / spec::kFp8Block).
  void write_scales(float* scales_m, float* scales_v, int64_t block) const {
    scales_m[block] = bits_to_float((254u << 23) - inv_m);
    scales_v[block] = bits_to_float((254u << 23) - inv_v);
  }
};
#endif

#ifdef ORT_OPTIM_FP8_AVX512
// Fp8Values of 16 codes c[0, 16) of a block that is not flagged, as float16 bits (sign at bit 15) converted exactly by
// one instruction: e5m2 is float16's top byte (its magnitudes from 0x7C, which no encoder writes, are float16's inf
// and NaN: then false, nothing decoded); e4m3's magnitude below bit 14 reads as its value * 2**-8 (float16's exponent
// bias is 15, e4m3's 7; subnormals included), made exact again by the 2**8 folded into the power-of-two scale
// (k <= 119: no overflow). mul: fp8_multiplier of the block's scale.
template <int kMb>
inline float fp8_multiplier(float s) {
  return kMb == 2 ? s : 256.0f * s;
}
template <int kMb, bool kSecondMoment>
inline bool fp8_values16(const uint8_t* c, __m512 mul, __m512& x) {
  const __m128i c8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c));
  __m256i h;
  if constexpr (kMb == 2) {
    if (_mm_cmpge_epu8_mask(_mm_add_epi8(c8, c8), _mm_set1_epi8(char(0xF8)))) return false;  // (the magnitude * 2)
    h = _mm256_slli_epi16(_mm256_cvtepu8_epi16(c8), 8);
  } else {  // (sign-extended, the sign reaches bits 14 and 15: bit 14 cleared)
    h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(c8), 7), _mm256_set1_epi16(int16_t(0xBFFF)));
  }
  x = _mm512_mul_ps(_mm512_cvtph_ps(h), mul);
  if constexpr (kSecondMoment) x = _mm512_mul_ps(x, x);
  return true;
}
#endif

// The fp8 format of a state dtype, or nullptr.
const Fp8* fp8_of(at::ScalarType t);

// dst[0, n) = the values of elements [off, off + n) (off a multiple of spec::kFp8Block): code * scale, squared for a
// second moment (which holds sqrt(v)).
void fp8_load(const Fp8& f, bool second_moment, const void* codes, const float* scales, int64_t off, int64_t n,
              float* dst);

// Writes src[0, n) (v for a second moment; root: sqrt(v) when the caller has it) as the codes and scales of elements
// [off, off + n), rounding stochastically with rnd (moment_random_bits of this step's exp_avg).
void fp8_store(const Fp8& f, bool second_moment, const float* src, const float* root, int64_t off, int64_t n,
               void* codes, float* scales, const uint32_t* rnd);

// Both moments of one block in a step (off a multiple of spec::kFp8Block, len <= spec::kFp8Block): m, root =
// sqrt(v) (v: the second moment, as fp8_store takes it), amax_m and amax_v the bits of the block's largest |m| and
// root (found by the caller); the same codes and scales as moment_random_bits, then fp8_store of each, in one loop
// where both blocks get a scale (rnd: len scratch words for the other case).
void fp8_store_pair(const Fp8& fm, const Fp8& fv, const float* m, const float* v, const float* root, uint32_t amax_m,
                    uint32_t amax_v, int64_t off, int64_t len, uint32_t step, void* codes_m, float* scales_m,
                    void* codes_v, float* scales_v, uint32_t* rnd);

}  // namespace ort_optim
