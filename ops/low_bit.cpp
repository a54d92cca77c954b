// Low-bit states: the encoders and decoders of one block of 8-bit or 4-bit codes, and the loads and stores of a
// range of elements built from them (formats in low_bit.h, specification in ops/README.md, "Low-bit states").
//
// The formats (block size, scale dtype, code levels) come from ort_optim/_spec.py through ort_optim_spec.h. A value
// is quantised by normalising it with its block's scale and taking the level index #{j : threshold[j] <= a}. The
// portable path finds it with one table lookup on the float's top bits (exponent and 8 mantissa bits, so no bucket
// holds two thresholds: checked when the map is built) plus one comparison, instead of a binary search over the
// levels. With AVX-512 (ORT_OPTIM_LOW_BIT_AVX512) 16 elements go at once and give the same bits: 8-bit codes decode
// by permutes of the 256 levels held in registers (on AMD Zen 4 with VBMI, ORT_OPTIM_LOW_BIT_BYTE_PLANES: 64 at a
// time, by byte permutes of the levels' byte planes: the top two, as the levels are bfloat16 values) and encode
// (Coder8) by bit arithmetic on the maps' binade grids (the binade's shift and offset from two tables in registers,
// no search); 4-bit codes decode by a permute of the 16 levels held in a register and encode (Coder4) by a bucketed
// search (CodeMap::SearchBuckets: a permute by the float's top bits gives the count of thresholds below its bucket and
// the one threshold inside it) or, for a map whose thresholds do not fit buckets, a binary search over the thresholds
// in registers. The Adam kernel's fused 4-bit step (and on AMD Zen 4 its fused 8-bit step,
// ORT_OPTIM_LOW_BIT_FUSED_Q8) codes a block in the loop that updates the next. The scalar path takes about 15x the
// fp32-moment step's time, the vectorised one about 2-4x (one thread, hot, on AMD Zen 4: 8-bit 1.11 ns per parameter
// in the kernel against 0.55 for fp32 moments; guides/low-bit-states.md, "Speed", has the measurements and why the
// remaining cost is compute, not bytes).

#include "low_bit.h"

#include <cmath>
#include <cstring>
#include <type_traits>

#include "rounding.h"

namespace ort_optim {
namespace {

template <size_t N, size_t M>
LowBit make_low_bit(int bits, int block, bool bf16_scales, const float (&m_levels)[N],
                    const float (&m_thresholds)[N - 1], const float (&v_levels)[M],
                    const float (&v_thresholds)[M - 1], bool relative, bool sq_stochastic,
                    const float (&v_sr_thresholds)[M - 1], const float (&v_squares)[M],
                    const float (&v_square_gaps)[M], float min_sq_scale) {
  const CodeMap v_nearest(v_levels, v_thresholds, int(M), false, bits, 1.0f);
  return LowBit{bits, block, bf16_scales,
                CodeMap(m_levels, m_thresholds, int(N), true, bits, spec::kExpAvgSnap, /*sr_from_zero=*/relative),
                v_nearest, relative, sq_stochastic,
                sq_stochastic ? CodeMap(v_levels, v_sr_thresholds, int(M), false, bits, spec::kExpAvgSnap,
                                        /*sr_from_zero=*/true, v_squares, v_square_gaps)
                              : v_nearest,
                float_to_bits(min_sq_scale)};
}


#ifdef ORT_OPTIM_LOW_BIT_BYTE_PLANES
// decode_block's 8-bit vector loop, 64 codes at a time (CodeMap::levels64): d = level * s, squared for a second
// moment, root = |level * s| (kRoot); kSigned: exp_avg's sign-magnitude codes. Returns how many elements it decoded
// (a multiple of 64; decode_block's loops do the rest).
template <bool kSigned, bool kSecondMoment, bool kRoot, bool kTop2>
inline int64_t decode_planes(const CodeMap& map, const uint8_t* c, __m512 s16, int64_t len, float* d, float* root) {
  __m512i planes[4][4];
  map.load_planes(planes);
  int64_t i = 0;
  for (; i + 64 <= len; i += 64) {
    __m512i levels[4];
    CodeMap::levels64<kSigned, kTop2>(planes, _mm512_loadu_si512(c + i), levels);
    for (int k = 0; k < 4; ++k) {
      __m512 x = _mm512_mul_ps(_mm512_castsi512_ps(levels[k]), s16);
      if constexpr (kRoot) _mm512_storeu_ps(root + i + 16 * k, _mm512_abs_ps(x));
      if constexpr (kSecondMoment) x = _mm512_mul_ps(x, x);
      _mm512_storeu_ps(d + i + 16 * k, x);
    }
  }
  return i;
}
template <bool kSigned, bool kSecondMoment, bool kRoot>
inline int64_t decode_planes(const CodeMap& map, const uint8_t* c, __m512 s16, int64_t len, float* d, float* root) {
  return map.bf16_levels() ? decode_planes<kSigned, kSecondMoment, kRoot, true>(map, c, s16, len, d, root)
                           : decode_planes<kSigned, kSecondMoment, kRoot, false>(map, c, s16, len, d, root);
}
#endif

// d[0, len) = the values of one block's codes c (8-bit: one per byte; 4-bit: element 2j in the low nibble of byte
// j), scale s; v = u * u for a second moment. The scalar loops are the reference and do the vector loops' tails.
// kRoot (a second moment): also root[0, len) = u = |level * s|, the decoded sqrt(v) (= level * |s| bit for bit: the
// rounding is symmetric, only the sign differs). kRelative (a relative 4-bit exp_avg): d[i] = q * root[i], 0 where
// q = 0, with q = level * s (low_bit_relative_load).
template <int kBits, bool kSecondMoment, bool kRoot = false, bool kRelative = false>
void decode_block(const CodeMap& map, const uint8_t* c, float s, int64_t len, float* d, float* root = nullptr) {
  static_assert(kSecondMoment || !kRoot, "a root is decoded with a second moment");
  static_assert(!kRelative || (kBits == 4 && !kSecondMoment), "a relative exp_avg is 4-bit");
  const float* decode = map.decode();
  int64_t i = 0;
#ifdef ORT_OPTIM_LOW_BIT_AVX512
  const __m512 s16 = _mm512_set1_ps(s);
  // (the map's own signedness picks the 8-bit branch: load_root decodes the unsigned sqrt(v) map as a first moment)
  if (kBits == 8 && !kSecondMoment && map.sign_bit() != 0) {
    // exp_avg: sign-magnitude codes, so the 128 magnitudes (lookup128) and the code's top bit as the float's sign
    const __m512 table[8] = {_mm512_load_ps(decode), _mm512_load_ps(decode + 16), _mm512_load_ps(decode + 32),
                             _mm512_load_ps(decode + 48), _mm512_load_ps(decode + 64), _mm512_load_ps(decode + 80),
                             _mm512_load_ps(decode + 96), _mm512_load_ps(decode + 112)};
#ifdef ORT_OPTIM_LOW_BIT_BYTE_PLANES
    i = decode_planes<true, false, false>(map, c, s16, len, d, root);
#endif
    for (; i + 16 <= len; i += 16) {
      const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + i)));
      const __m512i sign = _mm512_and_si512(_mm512_slli_epi32(idx, 24), _mm512_set1_epi32(int(0x80000000u)));
      const __m512 x = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(lookup128(table, idx)), sign));
      _mm512_storeu_ps(d + i, _mm512_mul_ps(x, s16));
    }
  } else if (kBits == 8) {
    // The 256 levels in 16 registers: eight 2-register permutes look up the code's low 5 bits in each 32-level
    // eighth of the table, and its top 3 bits pick one of the eight (a gather is twice as slow on AMD Zen 4).
#ifdef ORT_OPTIM_LOW_BIT_BYTE_PLANES
    i = decode_planes<false, kSecondMoment, kRoot>(map, c, s16, len, d, root);
#endif
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
      if constexpr (kRoot) _mm512_storeu_ps(root + i, _mm512_abs_ps(x));
      if constexpr (kSecondMoment) x = _mm512_mul_ps(x, x);
      _mm512_storeu_ps(d + i, x);
    }
  } else {
    const __m512 table = _mm512_load_ps(decode);
    for (; i + 16 <= len; i += 16) {
      // 8 bytes -> 16 codes in order (nibbles4); the permute reads only each lane's low 4 bits
      __m512 x = _mm512_mul_ps(_mm512_permutexvar_ps(nibbles4(c + i / 2), table), s16);
      if constexpr (kRoot) _mm512_storeu_ps(root + i, _mm512_abs_ps(x));
      if constexpr (kSecondMoment) x = _mm512_mul_ps(x, x);
      if constexpr (kRelative) {  // (not equal, unordered: a NaN q multiplies, as in the scalar loop)
        x = _mm512_maskz_mul_ps(_mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_NEQ_UQ), x,
                                _mm512_loadu_ps(root + i));
      }
      _mm512_storeu_ps(d + i, x);
    }
  }
#endif
  for (; i < len; ++i) {
    const float x = (kBits == 8 ? decode[c[i]] : decode[(c[i >> 1] >> ((i & 1) * 4)) & 15]) * s;
    if constexpr (kRoot) root[i] = std::fabs(x);
    d[i] = kSecondMoment ? x * x : kRelative ? (x == 0.0f ? 0.0f : x * root[i]) : x;
  }
}

// dst[0, n) = the values of elements [off, off + n) (off a multiple of the format's block); v = u * u for a second
// moment.
template <int kBits, bool kSecondMoment>
void low_bit_load(const LowBit& f, const uint8_t* codes, const void* scales, int64_t off, int64_t n, float* dst) {
  const CodeMap& map = f.map(kSecondMoment);
  for (int64_t q = 0; q < n; q += f.block) {
    const int64_t len = std::min<int64_t>(f.block, n - q);
    const uint8_t* c = kBits == 8 ? codes + off + q : codes + (off + q) / 2;
    const float s = f.scale(scales, (off + q) / f.block);
    decode_block<kBits, kSecondMoment>(map, c, s, len, dst + q);
    if (kSecondMoment && overflow_flagged(s)) {
      // a block holding an overflowed v (_spec.LowBitFormat): its code 0 reads as v = inf
      for (int64_t i = 0; i < len; ++i) {
        const int code = kBits == 8 ? c[i] : (c[i >> 1] >> ((i & 1) * 4)) & 15;
        if (code == 0) dst[q + i] = std::numeric_limits<float>::infinity();
      }
    }
  }
}

// Codes of one block of (finite) values u[0, len) with 1 / scale inv, written as the format stores them. Signed:
// exp_avg's map (sign-magnitude codes). kDecoded (4-bit sqrt(v)): also decoded[0, len) = level * s, the values the
// codes read back as with scale s. kSquare (4-bit sqrt(v) in a step): rounded stochastically, unbiased in v, by a map
// built with squares (_spec.EXP_AVG_SQ_STOCHASTIC). rnd: the random bits of the block's elements (moment_random_bits)
// where the map rounds stochastically (exp_avg, kSquare), else unused.
template <int kBits, bool kSigned, bool kDecoded = false, bool kSquare = false>
void encode_block(const CodeMap& map, const float* u, int64_t len, float inv, uint8_t* out, const uint32_t* rnd,
                  float* decoded = nullptr, float s = 0.0f) {
  static_assert(!kDecoded || (kBits == 4 && !kSigned), "decoded values are taken from a 4-bit sqrt(v)'s codes");
  static_assert(!kSquare || (kBits == 4 && !kSigned), "sqrt(v) rounds in the square in the 4-bit format");
  constexpr bool kStochastic = kSigned || kSquare;
  const int sign_bit = map.sign_bit();
  int64_t i = 0;
#ifdef ORT_OPTIM_LOW_BIT_AVX512
  const int64_t vector_end = len & ~int64_t(15);
  if constexpr (kBits == 8) {
    Coder8<kSigned> coder(map);
    coder.set_inverse(inv);
    for (; i < vector_end; i += 16) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), low_bytes16(coder.code16(u, i, rnd)));
    }
  } else {
    const auto code = [&](auto buckets) {
      using Coder = Coder4<kSigned, kSquare, decltype(buckets)::value>;
      Coder coder(map, inv);
      for (; i < vector_end; i += 16) {
        const __m512 x = _mm512_loadu_ps(u + i);
        const __m512i code = coder.codes4(x, kStochastic ? Coder::random16(rnd + i) : _mm512_setzero_ps());
        if constexpr (kDecoded) {
          _mm512_storeu_ps(decoded + i, _mm512_mul_ps(_mm512_permutexvar_ps(code, _mm512_load_ps(map.decode())),
                                                      _mm512_set1_ps(s)));
        }
        Coder::store4(code, out + i / 2);
      }
    };
    map.buckets_ready(!kSigned) ? code(std::true_type{}) : code(std::false_type{});
  }
#endif
  uint8_t c[256];
  const int64_t tail = i;  // the scalar loop does what the vector loop left (and everything without AVX-512)
  for (; i < len; ++i) {
    const float a = std::fabs(u[i]) * inv;
    const int m = kStochastic
                      ? map.stochastic_magnitude_code(a, kSigned ? rnd[i] >> 16 : rnd[i] & 0xFFFFu)
                      : map.magnitude_code(a);
    c[i - tail] = uint8_t(m | ((kSigned && u[i] < 0.0f && m > 0) ? sign_bit : 0));
    if constexpr (kDecoded) decoded[i] = map.decode()[m] * s;
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

// r[i] = m[i] / u[i] (IEEE division), 0 where u[i] = 0 (a relative exp_avg's ratio); returns the bits of the largest
// |r[i]|, as block_amax.
uint32_t block_ratio_amax(const float* m, const float* u, int64_t len, float* r) {
  uint32_t amax = 0;
  int64_t i = 0;
#ifdef ORT_OPTIM_LOW_BIT_AVX512
  __m512i amax16 = _mm512_setzero_si512();
  const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF);
  for (; i + 16 <= len; i += 16) {
    const __m512 ui = _mm512_loadu_ps(u + i);
    // (not equal, unordered: a NaN u divides, as in the scalar loop; masked-off lanes are +0)
    const __mmask16 nonzero = _mm512_cmp_ps_mask(ui, _mm512_setzero_ps(), _CMP_NEQ_UQ);
    const __m512 x = _mm512_maskz_div_ps(nonzero, _mm512_loadu_ps(m + i), ui);
    _mm512_storeu_ps(r + i, x);
    amax16 = _mm512_max_epu32(amax16, _mm512_and_si512(_mm512_castps_si512(x), abs_mask));
  }
  amax = _mm512_reduce_max_epu32(amax16);
#endif
  for (; i < len; ++i) {
    r[i] = u[i] == 0.0f ? 0.0f : m[i] / u[i];
    amax = std::max(amax, float_to_bits(r[i]) & 0x7FFFFFFFu);
  }
  return amax;
}

template <int kBits>
void load_root(const LowBit& f, const uint8_t* codes, const void* scales, int64_t off, int64_t n, float* u);

// Writes src[0, n) as the codes and scales of elements [off, off + n). root: sqrt(src) when the caller has it (a
// second moment's codes hold sqrt(v)), else nullptr. A relative exp_avg (f.relative): divisor = u, the decoded
// sqrt(v) it is coded against (src holds m, the codes r = m / u). A 4-bit second moment: stored_root, where given,
// receives the decoded sqrt(v) of the codes written (load_root's values). rnd: the step's random bits of the elements
// (moment_random_bits), nullptr outside a step.
template <int kBits, bool kSecondMoment>
void low_bit_store(const LowBit& f, const float* src, const float* root, int64_t off, int64_t n, uint8_t* codes,
                   void* scales, const uint32_t* rnd, const float* divisor = nullptr, float* stored_root = nullptr) {
  const CodeMap& map = f.map(kSecondMoment);
  const bool second_moment = kSecondMoment;
  float sqrt_v[256];
  for (int64_t q = 0; q < n; q += f.block) {
    const int64_t len = std::min<int64_t>(f.block, n - q);
    const bool take_sqrt = second_moment && !root;
    const float* u = take_sqrt ? sqrt_v : root ? root + q : src + q;
    uint32_t amax;
    if (!kSecondMoment && divisor) {
      amax = block_ratio_amax(src + q, divisor + q, len, sqrt_v);  // (sqrt_v holds the ratios)
      u = sqrt_v;
    } else {
      amax = block_amax(take_sqrt ? src + q : u, len, take_sqrt, sqrt_v);
    }
    // sqrt(v) = inf and no NaN (whose bits exceed inf's): v overflowed float32, as torch's AdamW keeps it. The block
    // is coded by its finite values (codes >= 1), the overflowed ones take code 0, and the scale its sign bit
    // (_spec.LowBitFormat): one element never makes its block's scale inf or NaN.
    float finite_u[256];
    const bool overflowed = kSecondMoment && amax == 0x7F800000u;
    if (overflowed) {
      amax = 0;
      for (int64_t i = 0; i < len; ++i) {
        const uint32_t b = float_to_bits(u[i]) & 0x7FFFFFFFu;
        finite_u[i] = b < 0x7F800000u ? u[i] : 0.0f;
        amax = std::max(amax, b < 0x7F800000u ? b : 0u);
      }
      u = finite_u;
    }
    amax = f.scale_bits(amax, kSecondMoment, rnd != nullptr ? rnd + q : nullptr);  // the scale
    uint8_t* out = kBits == 8 ? codes + off + q : codes + (off + q) / 2;
    float s;
    // the decoded sqrt(v) comes from the encoder, but for the rare overflowed and NaN blocks (decoded after storing)
    bool root_decoded = false, encoded = false;
    if (amax < 0x7F800000u) {
      s = bits_to_float(amax);
      if constexpr (kSecondMoment && kBits == 4) {
        // in a step, a stochastic sqrt(v) (_spec.EXP_AVG_SQ_STOCHASTIC); conversions keep the nearest rule
        const bool in_square = f.sq_stochastic && rnd != nullptr;
        const float inv = s > 0.0f ? 1.0f / s : 0.0f;
        if (stored_root && !overflowed) {
          // (s is the bfloat16 scale as stored, read back exactly; >= 0)
          if (in_square) {
            encode_block<kBits, false, true, true>(f.exp_avg_sq_sr, u, len, inv, out, rnd + q, stored_root + q, s);
          } else {
            encode_block<kBits, false, true>(map, u, len, inv, out, nullptr, stored_root + q, s);
          }
          root_decoded = encoded = true;
        } else if (in_square) {
          encode_block<kBits, false, false, true>(f.exp_avg_sq_sr, u, len, inv, out, rnd + q);
          encoded = true;
        }
      }
      if (!encoded) {
        encode_block<kBits, !kSecondMoment>(map, u, len, s > 0.0f ? 1.0f / s : 0.0f, out,
                                            kSecondMoment ? nullptr : rnd + q);
      }
      if (overflowed) {
        const float* v_root = take_sqrt ? sqrt_v : root ? root + q : src + q;
        for (int64_t i = 0; i < len; ++i) {
          const int shift = kBits == 8 ? 0 : int(i & 1) * 4;
          uint8_t& byte = kBits == 8 ? out[i] : out[i >> 1];
          const int code = (byte >> shift) & (kBits == 8 ? 0xFF : 0xF);
          const int fixed = std::isinf(v_root[i]) ? 0 : std::max(code, 1);
          byte = uint8_t((byte & ~((kBits == 8 ? 0xFF : 0xF) << shift)) | (fixed << shift));
        }
        s = -s;  // (-0.0 for a zero block)
      }
    } else {  // inf or NaN in the block: it reads back as NaN everywhere (scale NaN, codes 0)
      s = std::numeric_limits<float>::quiet_NaN();
      std::memset(out, 0, kBits == 8 ? len : (len + 1) / 2);
    }
    f.store_scale(scales, (off + q) / f.block, s);
    if (kSecondMoment && stored_root && !root_decoded) {
      load_root<kBits>(f, codes, scales, off + q, len, stored_root + q);
    }
  }
}

// u[0, n) = the decoded sqrt(v) of a second moment's codes [off, off + n): level * |s|, inf for an overflowed v
// (code 0 in a flagged block), NaN in a NaN block (formats.low_bit_root).
template <int kBits>
void load_root(const LowBit& f, const uint8_t* codes, const void* scales, int64_t off, int64_t n, float* u) {
  for (int64_t q = 0; q < n; q += f.block) {
    const int64_t len = std::min<int64_t>(f.block, n - q);
    const uint8_t* c = kBits == 8 ? codes + off + q : codes + (off + q) / 2;
    const float s = f.scale(scales, (off + q) / f.block);
    decode_block<kBits, false>(f.exp_avg_sq, c, std::fabs(s), len, u + q);  // (the unsigned map, not squared)
    if (overflow_flagged(s)) {
      for (int64_t i = 0; i < len; ++i) {
        const int code = kBits == 8 ? c[i] : (c[i >> 1] >> ((i & 1) * 4)) & 15;
        if (code == 0) u[q + i] = std::numeric_limits<float>::infinity();
      }
    }
  }
}


// Per block, in one pass over the codes of each moment: v and u = sqrt(v) from exp_avg_sq's codes (as
// low_bit_load<kBits, true> and load_root), then m = q * u.
template <int kBits>
void relative_load(const LowBit& f, const uint8_t* codes, const void* scales, const uint8_t* sq_codes,
                   const void* sq_scales, int64_t off, int64_t n, float* m, float* v, float* u) {
  for (int64_t q = 0; q < n; q += f.block) {
    const int64_t len = std::min<int64_t>(f.block, n - q);
    const int64_t byte = kBits == 8 ? off + q : (off + q) / 2;
    const float s = f.scale(sq_scales, (off + q) / f.block);
    decode_block<kBits, true, true>(f.exp_avg_sq, sq_codes + byte, s, len, v + q, u + q);
    if (overflow_flagged(s)) {  // an overflowed v (code 0 in a flagged block) reads as v = u = inf
      for (int64_t i = 0; i < len; ++i) {
        const int code = kBits == 8 ? sq_codes[byte + i] : (sq_codes[byte + (i >> 1)] >> ((i & 1) * 4)) & 15;
        if (code == 0) v[q + i] = u[q + i] = std::numeric_limits<float>::infinity();
      }
    }
    decode_block<kBits, false, false, true>(f.exp_avg, codes + byte, f.scale(scales, (off + q) / f.block), len, m + q,
                                            u + q);
  }
}

}  // namespace

void low_bit_relative_load(const LowBit& f, const uint8_t* codes, const void* scales, const uint8_t* sq_codes,
                           const void* sq_scales, int64_t off, int64_t n, float* m, float* v, float* u) {
  TORCH_CHECK(f.bits == 4, "ort_optim: a relative exp_avg is 4-bit");
  relative_load<4>(f, codes, scales, sq_codes, sq_scales, off, n, m, v, u);
}

void low_bit_relative_store(const LowBit& f, const float* m, const float* u, int64_t off, int64_t n, uint8_t* codes,
                            void* scales, const uint32_t* rnd) {
  TORCH_CHECK(f.bits == 4, "ort_optim: a relative exp_avg is 4-bit");
  low_bit_store<4, false>(f, m, nullptr, off, n, codes, scales, rnd, u);
}

const LowBit& q8() {
  static const LowBit f = make_low_bit(spec::kQ8Bits, spec::kQ8Block, spec::kQ8Bf16Scales, spec::kQ8ExpAvgLevels,
                                       spec::kQ8ExpAvgThresholds, spec::kQ8ExpAvgSqLevels, spec::kQ8ExpAvgSqThresholds,
                                       spec::kQ8ExpAvgRelative, spec::kQ8ExpAvgSqStochastic,
                                       spec::kQ8ExpAvgSqSrThresholds, spec::kQ8ExpAvgSqSquares,
                                       spec::kQ8ExpAvgSqSquareGaps, spec::kQ8MinSqScale);
  return f;
}
const LowBit& q4() {
  static const LowBit f = make_low_bit(spec::kQ4Bits, spec::kQ4Block, spec::kQ4Bf16Scales, spec::kQ4ExpAvgLevels,
                                       spec::kQ4ExpAvgThresholds, spec::kQ4ExpAvgSqLevels, spec::kQ4ExpAvgSqThresholds,
                                       spec::kQ4ExpAvgRelative, spec::kQ4ExpAvgSqStochastic,
                                       spec::kQ4ExpAvgSqSrThresholds, spec::kQ4ExpAvgSqSquares,
                                       spec::kQ4ExpAvgSqSquareGaps, spec::kQ4MinSqScale);
  return f;
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

void low_bit_store(const LowBit& f, bool second_moment, const float* src, const float* root, int64_t off, int64_t n,
                   uint8_t* codes, void* scales, const uint32_t* rnd, float* stored_root) {
  if (f.bits == 8) {
    second_moment ? low_bit_store<8, true>(f, src, root, off, n, codes, scales, rnd, nullptr, stored_root)
                  : low_bit_store<8, false>(f, src, root, off, n, codes, scales, rnd);
  } else {
    second_moment ? low_bit_store<4, true>(f, src, root, off, n, codes, scales, rnd, nullptr, stored_root)
                  : low_bit_store<4, false>(f, src, root, off, n, codes, scales, rnd);
  }
}

}  // namespace ort_optim
