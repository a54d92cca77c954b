// Low-bit states: the 8-bit and 4-bit block-quantised moment formats (ops/README.md, "Low-bit states"). The formats
// (block size, scale dtype, code levels) come from ort_optim/_spec.py through the generated ort_optim_spec.h. This
// header holds the code maps (CodeMap), the two formats (q8, q4) and the loads and stores of a range of elements,
// which the Adam kernel calls per block; low_bit.cpp has the block encoders and decoders.
#pragma once

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "conversions.h"
#include "ort_optim_spec.h"  // generated from ort_optim/_spec.py into the build folder (backends/native.py)
#include "rounding.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define ORT_OPTIM_LOW_BIT_AVX512 1
// AMD Zen 4 and 5 (which compilers without znver4 take for znver3, the same family with AVX-512): the 8-bit step
// codes each block in the loop that updates the next (the Adam kernel's update_q8: 8% faster there, measured only
// there);
#if defined(__znver3__) || defined(__znver4__) || defined(__znver5__)
#define ORT_OPTIM_LOW_BIT_FUSED_Q8 1
// and 8-bit codes decode 64 at a time by byte permutes (CodeMap::levels64), where AVX-512 VBMI has them
#ifdef __AVX512VBMI__
#define ORT_OPTIM_LOW_BIT_BYTE_PLANES 1
#endif
#endif
#endif

#if defined(ORT_OPTIM_LOW_BIT_AVX512) && defined(__AVX512VBMI__)
// 4-bit codes unpack by one multishift and pack by one byte permute (nibbles4, Coder4::store4)
#define ORT_OPTIM_LOW_BIT_VBMI 1
#endif

namespace ort_optim {

#ifdef ORT_OPTIM_LOW_BIT_AVX512
// The 16 4-bit codes of 8 bytes p (element 2j in the low nibble of byte j, 2j + 1 in its high nibble), one per 32-bit
// lane in order, in the lane's low 4 bits (the bits above are not cleared with VBMI: for permutes, which read only
// those 4). VBMI: the 8 bytes broadcast, and each lane's byte taken from bit 4 * lane of them (one multishift) where
// the unpack takes three instructions.
inline __m512i nibbles4(const uint8_t* p) {
#ifdef ORT_OPTIM_LOW_BIT_VBMI
  int64_t bytes;
  std::memcpy(&bytes, p, 8);
  // qword L (lanes 2L, 2L + 1): bytes 0-3 from bit 8L, bytes 4-7 from bit 8L + 4
  const __m512i control = _mm512_set_epi64(0x3C3C3C3C38383838ll, 0x3434343430303030ll, 0x2C2C2C2C28282828ll,
                                           0x2424242420202020ll, 0x1C1C1C1C18181818ll, 0x1414141410101010ll,
                                           0x0C0C0C0C08080808ll, 0x0404040400000000ll);
  return _mm512_multishift_epi64_epi8(control, _mm512_set1_epi64(bytes));
#else
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(bytes, _mm_srli_epi16(bytes, 4)));
#endif
}
#endif

class CodeMap {
 public:
  // thresholds: count - 1 increasing decision thresholds (ort_optim._spec.thresholds); snap: the factor applied to
  // a normalised magnitude before the search (exp_avg rounds toward zero, EXP_AVG_SNAP; 1 for sqrt(v)).
  // sr_from_zero: exp_avg rounds stochastically from magnitude 0 too (the relative 4-bit exp_avg,
  // _spec.EXP_AVG_RELATIVE).
  // squares, square_gaps (a sqrt(v) map rounded stochastically, _spec.EXP_AVG_SQ_STOCHASTIC; thresholds are then the
  // levels above the lowest): the rounding is unbiased in the square, with these tables (_spec.square_tables).
  CodeMap(const float* levels, const float* thresholds, int count, bool is_signed, int bits, float snap,
          bool sr_from_zero = false, const float* squares = nullptr, const float* square_gaps = nullptr)
      : sign_bit_(is_signed ? 1 << (bits - 1) : 0), count_(count), snap_(snap), sr_from_zero_(sr_from_zero),
        in_square_(squares != nullptr) {
    TORCH_CHECK(count == (is_signed ? 1 << (bits - 1) : 1 << bits), "ort_optim: code map has ", count, " levels");
    TORCH_CHECK(!in_square_ || count <= 16, "ort_optim: a map rounded in the square has at most 16 levels");
    mid_.assign(thresholds, thresholds + count - 1);
    mid_.push_back(std::numeric_limits<float>::infinity());
    for (int c = 0; c < (1 << bits); ++c) {
      const int magnitude = is_signed ? c & (sign_bit_ - 1) : c;
      decode_[c] = (c & sign_bit_) ? -levels[magnitude] : levels[magnitude];
    }
    // Stochastic rounding's gap to the next level, hi - lo in float32 (as the rule computes it), per magnitude.
    for (int j = 0; j + 1 < count; ++j) gap_[j] = in_square_ ? square_gaps[j] : levels[j + 1] - levels[j];
    for (int j = 0; j < count && in_square_; ++j) square_[j] = squares[j];
    // The vector encoder's form of it: gap * 2^-17 (exact: a power of two on a normal float), so that one multiply
    // gives ((2 * r16 + 1) * 2^-17) * gap with the same rounding; +inf where the rule never rounds up (magnitude 0,
    // the top level), so that the comparison itself says no (inf is never exceeded).
    for (int j = 0; j < 256; ++j) {
      sr_step_[j] = j >= (sr_from_zero ? 0 : 1) && j + 1 < count ? gap_[j] * 0x1p-17f
                                                                  : std::numeric_limits<float>::infinity();
    }
    // The binary search's table: the thresholds, padded with +inf to 16 (only used for up to 15 thresholds).
    for (int c = 0; c < 256; ++c) {
      for (int j = 0; j < 4; ++j) planes_[j][c] = uint8_t(float_to_bits(decode_[c]) >> (8 * j));
      bf16_levels_ = bf16_levels_ && (float_to_bits(decode_[c]) & 0xFFFFu) == 0;
    }
    for (int j = 0; j < 16; ++j) search_[j] = j < count - 1 ? thresholds[j] : std::numeric_limits<float>::infinity();
    for (int step = 1; step <= 2; ++step) {
      for (int j = 0; j < 16; ++j) step_[step - 1][j] = j + step - 1 < 16 ? search_[j + step - 1] : search_[15];
    }
    if (count <= 16) build_search_buckets(count - 1);
    build_binades(levels, thresholds, count, is_signed ? 1 : 0);
    min_bucket_ = float_to_bits(mid_[0]) >> kShift;
    const uint32_t max_bucket = float_to_bits(1.0f) >> kShift;
    for (uint32_t b = min_bucket_; b <= max_bucket; ++b) {
      const float start = bits_to_float(b << kShift), end = bits_to_float((b + 1) << kShift);
      const int at_or_below = int(std::upper_bound(mid_.begin(), mid_.end(), start) - mid_.begin());
      const int below_end = int(std::lower_bound(mid_.begin(), mid_.end(), end) - mid_.begin());
      TORCH_CHECK(below_end - at_or_below <= 1, "ort_optim: two code thresholds within one search bucket");
      bucket_.push_back(uint8_t(at_or_below));
    }
  }

  // The level index of a normalised magnitude a >= 0: #{j : threshold[j] <= min(a * snap, 1)}.
  inline int magnitude_code(float a) const {
    a = a * snap_;
    a = a < 1.0f ? a : 1.0f;
    const int64_t b = int64_t(float_to_bits(a) >> kShift) - int64_t(min_bucket_);
    if (b < 0) return 0;  // below the first threshold's bucket
    const int c = bucket_[b];
    return c + (a >= mid_[c]);
  }

  // How a map's codes follow from the bits of a normalised magnitude a (a * snap for exp_avg), where its
  // levels are a binade grid (_spec.binade_levels: both 8-bit maps). Binade t (a in [2^-t, 2^-(t-1)); t = 0 for
  // a >= 1) holds 2^mb levels, so the level at or below a has the code (bits(a) >> (23 - mb)) - offset(t), and the
  // level above it is that level's bits plus 1 << (23 - mb): codes by shifts and adds, no search. kFloor: the code
  // is the level at or below (exp_avg: its thresholds are the levels, except the top one, kept in top()); kMidpoint:
  // the nearest level (sqrt(v) nearest in sqrt(v): its thresholds are the arithmetic midpoints), by the same shift
  // one bit short: ((bits(a) >> (22 - mb)) - (2 * offset(t) - 1)) >> 1; kNone: not a binade grid (the 4-bit maps,
  // which search in registers).
  enum class Binades { kNone, kFloor, kMidpoint };
  Binades binades() const { return binades_; }
  float top() const { return top_; }
  // Per binade, at its position (below): the shift and the offset above (kFloor: 23 - mb and offset(t); kMidpoint:
  // 22 - mb and 2 * offset(t) - 1); shift 31 (kMidpoint: 30) where a binade holds no levels, whose code is then
  // -offset: the top code for t = 0, 0 below the grid.
  const int32_t* binade_shift() const { return shift_; }
  const int32_t* binade_offset() const { return offset_; }
  // Per binade, at its position: the unit of its levels times 2^-17 (exp_avg's stochastic rounding: hi - lo), +inf
  // where exp_avg never rounds up (the top level and zero).
  const float* sr_unit() const { return sr_unit_; }

#ifdef ORT_OPTIM_LOW_BIT_AVX512
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

  // The search's tables in registers for a loop (SearchBuckets::codes), where the map has them (buckets_ready).
  struct SearchBuckets {
    __m512 snap, hi, lo;
    __m512i shift, count[2];
    __m512 threshold[2];
    // The same codes as magnitude_codes_by_search, for every a >= 0 and NaN (which takes the top code there, by the
    // clamp to 1, and here by the clamp to hi): a clamped into [lo, hi] (which keeps its count of thresholds at or
    // below it: none lies in (hi, 1] or at or below lo), then its bucket (the low exponent bits and the top mantissa
    // bits of the float, which at most one threshold falls within) gives the count of the thresholds at or below the
    // bucket's start and the threshold inside it (+inf if none): 8 instructions where the search takes 10 (8 levels)
    // or 13 (16 levels). kWide: 32 buckets (two-register permutes), else 16.
    template <bool kWide>
    inline __m512i codes(__m512 a) const {
      a = _mm512_max_ps(_mm512_min_ps(_mm512_mul_ps(a, snap), hi), lo);
      const __m512i index = _mm512_srlv_epi32(_mm512_castps_si512(a), shift);  // (permutes read the low bits)
      __m512i c;
      __m512 t;
      if constexpr (kWide) {
        c = _mm512_permutex2var_epi32(count[0], index, count[1]);
        t = _mm512_permutex2var_ps(threshold[0], index, threshold[1]);
      } else {
        c = _mm512_permutexvar_epi32(index, count[0]);
        t = _mm512_permutexvar_ps(index, threshold[0]);
      }
      return _mm512_mask_add_epi32(c, _mm512_cmp_ps_mask(a, t, _CMP_GE_OQ), c, _mm512_set1_epi32(1));
    }
  };
  // The buckets fit in 16 (kWide: 32) entries.
  bool buckets_ready(bool wide) const { return bucket_shift_ > 0 && bucket_bits_ <= (wide ? 5 : 4); }
  SearchBuckets search_buckets() const {
    return {_mm512_set1_ps(snap_),
            _mm512_set1_ps(bits_to_float(0x3F7FFFFFu)),  // (the largest float below 1)
            _mm512_set1_ps(bucket_lo_),
            _mm512_set1_epi32(bucket_shift_),
            {_mm512_load_si512(bucket_count_), _mm512_load_si512(bucket_count_ + 16)},
            {_mm512_load_ps(bucket_threshold_), _mm512_load_ps(bucket_threshold_ + 16)}};
  }
#endif

#ifdef ORT_OPTIM_LOW_BIT_BYTE_PLANES
  // The levels of 64 8-bit codes c (bytes), as the bits of four vectors of 16 floats (codes 16k to 16k + 15 in
  // out[k]): each byte of the float bits looked up in its own 256-byte table ("plane", 4 registers: two 128-byte
  // permutes and a blend by the code's top bit; kSigned: sign-magnitude codes, one permute of the 128 magnitudes
  // and the code's top bit as the sign), then interleaved into 32-bit lanes. The unpacks interleave within 128-bit
  // lanes, so the codes are first permuted into the order that leaves the values in order. 22 vector instructions
  // per 64 codes where lookup128 takes 9 and the 256-level lookup 18 per 16: on AMD Zen 4 the decodes of the 8-bit
  // step take about 10% of its time less. (Coding exp_avg with it instead of lookup128, 64 at a time, measured no
  // faster.) kTop2: the levels are bfloat16 values (bf16_levels: the binade grids' levels have at most 6 mantissa
  // bits), so the two low bytes are zero and only the top two planes are looked up: 14 instructions (the 8-bit
  // step 2-3% faster in the kernel harness, the same bits).
  // planes: load_planes's registers.
  template <bool kSigned, bool kTop2>
  static inline void levels64(const __m512i (&planes)[4][4], __m512i c, __m512i (&out)[4]) {
    // byte 16L + 4k + r <- code 16k + 4L + r
    const __m512i order = _mm512_set_epi8(63, 62, 61, 60, 47, 46, 45, 44, 31, 30, 29, 28, 15, 14, 13, 12,  //
                                          59, 58, 57, 56, 43, 42, 41, 40, 27, 26, 25, 24, 11, 10, 9, 8,  //
                                          55, 54, 53, 52, 39, 38, 37, 36, 23, 22, 21, 20, 7, 6, 5, 4,  //
                                          51, 50, 49, 48, 35, 34, 33, 32, 19, 18, 17, 16, 3, 2, 1, 0);
    c = _mm512_permutexvar_epi8(order, c);
    __m512i b[4];
    const __mmask64 top = _mm512_movepi8_mask(c);
    for (int j = 0; j < 2 && kTop2; ++j) b[j] = _mm512_setzero_si512();
    for (int j = kTop2 ? 2 : 0; j < 4; ++j) {
      b[j] = _mm512_permutex2var_epi8(planes[j][0], c, planes[j][1]);  // (the index's low 7 bits)
      if constexpr (!kSigned) {
        b[j] = _mm512_mask_blend_epi8(top, b[j], _mm512_permutex2var_epi8(planes[j][2], c, planes[j][3]));
      }
    }
    if constexpr (kSigned) b[3] = _mm512_or_si512(b[3], _mm512_and_si512(c, _mm512_set1_epi8(char(0x80))));
    const __m512i lo01 = kTop2 ? b[0] : _mm512_unpacklo_epi8(b[0], b[1]);
    const __m512i hi01 = kTop2 ? b[0] : _mm512_unpackhi_epi8(b[0], b[1]);
    const __m512i lo23 = _mm512_unpacklo_epi8(b[2], b[3]), hi23 = _mm512_unpackhi_epi8(b[2], b[3]);
    out[0] = _mm512_unpacklo_epi16(lo01, lo23);
    out[1] = _mm512_unpackhi_epi16(lo01, lo23);
    out[2] = _mm512_unpacklo_epi16(hi01, hi23);
    out[3] = _mm512_unpackhi_epi16(hi01, hi23);
  }
  // levels64's tables (kSigned: the first two registers of each plane, the 128 magnitudes' bytes; bf16_levels: the
  // top two planes).
  void load_planes(__m512i (&planes)[4][4]) const {
    for (int j = bf16_levels_ ? 2 : 0; j < 4; ++j) {
      for (int k = 0; k < 4; ++k) planes[j][k] = _mm512_load_si512(planes_[j] + 64 * k);
    }
  }
#endif

  // Every level is a bfloat16 value (its float32 bits' low 16 are zero).
  bool bf16_levels() const { return bf16_levels_; }
  int sign_bit() const { return sign_bit_; }
  float snap() const { return snap_; }
  const float* decode() const { return decode_; }
  const float* sr_step() const { return sr_step_; }
  const float* squares() const { return square_; }
  // The magnitude code rounded stochastically (exp_avg; _spec.EXP_AVG_SR_ULPS has the rule): from the non-zero level
  // at or below (magnitude_code), one level up iff (lowered(a) - lo) > ((2 * r16 + 1) * 2^-17) * (hi - lo). r16: the
  // moment's 16 random bits (_spec.MOMENT_RANDOM_BITS). A map built with squares (sqrt(v),
  // _spec.EXP_AVG_SQ_STOCHASTIC): iff (lowered(a)^2 - lo^2) > ((2 * r16 + 1) * 2^-17) * (hi^2 - lo^2), from the
  // lowest level too.
  inline int stochastic_magnitude_code(float a, uint32_t r16) const {
    const int m = magnitude_code(a);
    // below the lowest non-zero level (toward zero, unless sr_from_zero), or the top one
    if ((m == 0 && !sr_from_zero_) || m + 1 >= count_) return m;
    const uint32_t ab = float_to_bits(a);
    const float lowered = bits_to_float(ab > spec::kExpAvgSrUlps ? ab - spec::kExpAvgSrUlps : 0u);
    const float uniform = float(2 * r16 + 1) * 0x1p-17f;  // (exact)
    if (in_square_) return m + ((lowered * lowered - square_[m]) > uniform * gap_[m]);
    return m + ((lowered - decode_[m]) > uniform * gap_[m]);
  }

 private:
  static constexpr int kShift = 15;  // keeps the exponent and 8 mantissa bits
  int sign_bit_;
  int count_;
  float snap_;
  bool sr_from_zero_;
  bool in_square_;
  alignas(64) float decode_[256] = {0.0f};
  alignas(64) float gap_[256] = {0.0f};  // gap_[j] = levels[j + 1] - levels[j] (or of their squares); 0 past the top
  alignas(64) float square_[16] = {0.0f};  // a sqrt(v) map rounded in the square: levels[j]^2
  alignas(64) float sr_step_[256];       // gap_[j] * 2^-17 where exp_avg may round up from magnitude j, else +inf
  alignas(64) uint8_t planes_[4][256];  // planes_[j][c]: byte j of the bits of decode_[c]
  bool bf16_levels_ = true;
  alignas(64) float search_[16];
  alignas(64) float step_[2][16];  // the search's tables for steps 1 and 2: step_[s - 1][j] = search_[j + s - 1]
  // The bucketed search (SearchBuckets): 32 buckets of the magnitudes in [bucket_lo_, 1), by the low exponent bits and
  // the top mantissa bits (bits >> bucket_shift_, low 5 bits; bucket_bits_ of them tell buckets apart, 4 or 5, and
  // the tables repeat every 2^bucket_bits_ entries); per bucket the count of thresholds at or below its start and the
  // threshold inside it (+inf if none). bucket_shift_ 0: the thresholds do not fit (the search then).
  int bucket_shift_ = 0, bucket_bits_ = 0;
  float bucket_lo_ = 0.0f;
  alignas(64) int32_t bucket_count_[32] = {0};
  alignas(64) float bucket_threshold_[32] = {0.0f};

  // Fills the bucket tables where the k thresholds (search_) lie in (0, 1), increasing, and at most one falls within
  // each bucket.
  void build_search_buckets(int k) {
    if (k < 1 || !(search_[0] > 0.0f) || !(search_[k - 1] < 1.0f)) return;
    for (int j = 1; j < k; ++j) {
      if (!(search_[j - 1] < search_[j])) return;
    }
    // the lowest binade: the one holding the smallest threshold strictly above its start (a magnitude below that
    // start is clamped to it, and keeps its count, 0)
    int low_exponent = int(float_to_bits(search_[0]) >> 23);
    if (float_to_bits(search_[0]) == uint32_t(low_exponent) << 23) --low_exponent;
    if (low_exponent < 1) return;
    const int binades = 127 - low_exponent;  // exponents low_exponent .. 126
    int exponent_bits = 0;
    while ((1 << exponent_bits) < binades) ++exponent_bits;
    for (int index_bits = 4; index_bits <= 5; ++index_bits) {
      const int mantissa_bits = index_bits - exponent_bits;
      if (mantissa_bits < 0) continue;
      const int shift = 23 - mantissa_bits;
      const uint32_t mask = (1u << index_bits) - 1;
      int32_t count[32] = {0};
      float threshold[32];
      bool used[32] = {false}, fits = true;
      for (int j = 0; j < 32; ++j) threshold[j] = std::numeric_limits<float>::infinity();
      for (int e = low_exponent; e <= 126 && fits; ++e) {
        for (int f = 0; f < (1 << mantissa_bits) && fits; ++f) {
          const uint32_t start = (uint32_t(e) << 23) | (uint32_t(f) << shift);
          const float begin = bits_to_float(start), end = bits_to_float(start + (1u << shift));
          const int index = int((start >> shift) & mask);
          int at_or_below = 0, inside = 0;
          float first_inside = std::numeric_limits<float>::infinity();
          for (int j = 0; j < k; ++j) {
            if (search_[j] <= begin) ++at_or_below;
            if (search_[j] > begin && search_[j] < end && inside++ == 0) first_inside = search_[j];
          }
          fits = !used[index] && inside <= 1;
          used[index] = true;
          count[index] = at_or_below;
          threshold[index] = first_inside;
        }
      }
      if (!fits) continue;
      for (int j = 0; j < 32; ++j) {
        bucket_count_[j] = count[j & mask];
        bucket_threshold_[j] = threshold[j & mask];
      }
      bucket_lo_ = bits_to_float(uint32_t(low_exponent) << 23);
      bucket_shift_ = shift;
      bucket_bits_ = index_bits;
      return;
    }
  }
  std::vector<float> mid_;
  uint32_t min_bucket_ = 0;
  std::vector<uint8_t> bucket_;
  // The binade tables are indexed by the position of binade t, the low 5 bits of its float32 exponent 127 - t: t = 0
  // (a = 1) at 31, t = 1..31 at 30..0; the coder clamps magnitudes to 2^-30 from below, so the exponent of any
  // magnitude it codes finds its binade's entry without a range check (which needs every level above 2^-30).
  static int position(int t) { return (127 - t) & 31; }
  Binades binades_ = Binades::kNone;
  float top_ = 1.0f;
  alignas(64) int32_t shift_[32] = {0};
  alignas(64) int32_t offset_[32] = {0};
  alignas(64) float sr_unit_[32] = {0.0f};

  // Fills the binade tables where levels[first, count) (ascending, levels[count - 1] == 1) are a binade grid down to
  // 2^-29 at most and the thresholds fit kFloor or kMidpoint; leaves binades_ kNone otherwise.
  void build_binades(const float* levels, const float* thresholds, int count, int first) {
    if (levels[count - 1] != 1.0f) return;
    int width[32] = {0}, base[32] = {0}, t = 0;
    for (int end = count - 1; end > first;) {  // binade t = 1, 2, ..: levels[start, end)
      if (++t > 29) return;
      const float low = std::ldexp(1.0f, -t);
      int start = end;
      while (start > first && levels[start - 1] >= low) --start;
      const int n = end - start;
      if (n == 0 || (n & (n - 1)) != 0 || n > (1 << 22)) return;
      for (int f = 0; f < n; ++f) {
        if (levels[start + f] != low * (1.0f + float(f) / float(n))) return;
      }
      width[t] = __builtin_ctz(unsigned(n));
      base[t] = start;
      end = start;
    }
    const int lowest = t;
    bool floor = true, midpoint = first == 0;
    for (int k = 0; k + 2 < count; ++k) floor = floor && thresholds[k] == levels[k + 1];
    for (int k = 0; k + 1 < count; ++k) midpoint = midpoint && thresholds[k] == (levels[k] + levels[k + 1]) / 2;
    if (floor && thresholds[count - 2] > levels[count - 2] && thresholds[count - 2] <= 1.0f) {
      top_ = thresholds[count - 2];
      binades_ = Binades::kFloor;
    } else if (midpoint) {
      binades_ = Binades::kMidpoint;
    } else {
      return;
    }
    const bool nearest = binades_ == Binades::kMidpoint;
    for (int b = 0; b < 32; ++b) {  // (shift 31 keeps nothing of a magnitude: the code is -offset)
      const bool levels_in_b = b >= 1 && b <= lowest;
      // the floor code's shift and offset; 0 below the grid (exp_avg's zero, sqrt(v)'s lowest level)
      const int shift = levels_in_b ? 23 - width[b] : 31;
      const int offset = b == 0 ? -(count - 1) : levels_in_b ? ((127 - b) << width[b]) - base[b] : 0;
      shift_[position(b)] = nearest ? shift - 1 : shift;
      offset_[position(b)] = nearest ? 2 * offset - (levels_in_b ? 1 : 0) : offset;
      sr_unit_[position(b)] =
          levels_in_b ? std::ldexp(1.0f, -b - width[b] - 17) : std::numeric_limits<float>::infinity();
    }
  }
};

struct LowBit {
  int bits, block;
  bool bf16_scales;
  CodeMap exp_avg, exp_avg_sq;  // exp_avg_sq's codes hold sqrt(v)
  // exp_avg's codes hold r = m / u, u the decoded sqrt(v) of exp_avg_sq in this format (_spec.EXP_AVG_RELATIVE)
  bool relative;
  // sqrt(v) rounds stochastically in a step, unbiased in v, with this map (_spec.EXP_AVG_SQ_STOCHASTIC); conversions
  // (step 0) keep exp_avg_sq's nearest rule
  bool sq_stochastic;
  CodeMap exp_avg_sq_sr;
  uint32_t min_sq_scale;  // the bits of a non-zero second-moment block's smallest scale (_spec.MIN_SQRT_V)

  const CodeMap& map(bool second_moment) const { return second_moment ? exp_avg_sq : exp_avg; }

  // a (bits; finite) rounded to one of the bfloat16 values lo <= a < hi next to it, hi iff (a^2 - lo^2) >
  // ((2 * r16 + 1) * 2^-17) * (hi^2 - lo^2) (squares: unbiased in v, for sqrt(v)), else iff (a - lo) > ... * (hi - lo)
  // (unbiased), in float32 (_spec.BF16_SCALE_STOCHASTIC); a itself where it is a bfloat16 value.
  static uint32_t bf16_stochastic(uint32_t a_bits, uint32_t r16, bool squares) {
    if ((a_bits & 0xFFFFu) == 0) return a_bits;
    const uint32_t lo_bits = a_bits & 0xFFFF0000u;
    const float a = bits_to_float(a_bits), lo = bits_to_float(lo_bits), hi = bits_to_float(lo_bits + 0x10000u);
    const float uniform = float(2 * r16 + 1) * 0x1p-17f;  // (exact)
    const bool up = squares ? (a * a - lo * lo) > uniform * (hi * hi - lo * lo) : (a - lo) > uniform * (hi - lo);
    return up ? lo_bits + 0x10000u : lo_bits;
  }
  // The bits of the scale of a block whose largest magnitude has the bits amax (finite, or a block holding inf or
  // NaN): where the format stores bfloat16 scales, amax rounded to bfloat16, in a step stochastically with the random
  // bits of the block's first element rnd[0] (moment_random_bits; _spec.BF16_SCALE_STOCHASTIC), else (rnd null) to
  // nearest even (which may overflow to inf: then the block is non-finite, like one holding inf); 0 below float32's
  // smallest normal (a zero block, _spec.MIN_SCALE), and for a second moment at least min_sq_scale (_spec.MIN_SQRT_V).
  uint32_t scale_bits(uint32_t amax, bool second_moment, const uint32_t* rnd = nullptr) const {
    if (bf16_scales && amax < 0x7F800000u) {
      amax = rnd != nullptr ? bf16_stochastic(amax, second_moment ? rnd[0] & 0xFFFFu : rnd[0] >> 16, second_moment)
                            : (amax + 0x7FFFu + ((amax >> 16) & 1u)) & 0xFFFF0000u;
    }
    if (amax < 0x00800000u) return 0;
    return second_moment ? std::max(amax, min_sq_scale) : amax;
  }
  void store_scale(void* scales, int64_t block_index, float s) const {
    if (bf16_scales) {
      static_cast<uint16_t*>(scales)[block_index] = uint16_t(float_to_bits(s) >> 16);
    } else {
      static_cast<float*>(scales)[block_index] = s;
    }
  }
  float scale(const void* scales, int64_t block_index) const {
    return bf16_scales ? bits_to_float(uint32_t(static_cast<const uint16_t*>(scales)[block_index]) << 16)
                       : static_cast<const float*>(scales)[block_index];
  }
};

#ifdef ORT_OPTIM_LOW_BIT_AVX512
// t[idx] for 16 indices in [0, 128), t in 8 registers: four 2-register permutes on the low 5 bits, bits 5 and 6 pick.
inline __m512 lookup128(const __m512* t, __m512i idx) {
  __m512 r[4];
  for (int k = 0; k < 4; ++k) r[k] = _mm512_permutex2var_ps(t[2 * k], idx, t[2 * k + 1]);
  const __mmask16 b5 = _mm512_test_epi32_mask(idx, _mm512_set1_epi32(32));
  const __mmask16 b6 = _mm512_test_epi32_mask(idx, _mm512_set1_epi32(64));
  return _mm512_mask_blend_ps(b6, _mm512_mask_blend_ps(b5, r[0], r[1]), _mm512_mask_blend_ps(b5, r[2], r[3]));
}

// The 4-bit codes of one block, 16 values at a time and in order (encode_block's vector loop; the Adam kernel's
// fused 4-bit step codes with it too): the values' magnitudes times 1 / scale inv, rounded to a level of map;
// kSigned: exp_avg's map (sign-magnitude codes); kSquare: sqrt(v) rounded stochastically in the square. The
// stochastic rounding (CodeMap::stochastic_magnitude_code, 16 lanes) takes its level and the gap to the next one from
// one register each (a permute, not a gather: a 16-lane gather costs about as much as the rest of this loop on Zen
// 4), and its random numbers from the step's hashes (moment_random_bits, taken once per element for both moments).
// kBuckets: the level by the map's bucketed search (CodeMap::SearchBuckets; where buckets_ready(kWide)), else by its
// binary search: the same codes.
template <bool kSigned, bool kSquare = false, bool kBuckets = false>
struct Coder4 {
  static constexpr bool kStochastic = kSigned || kSquare;
  static constexpr bool kWide = !kSigned;  // (16 levels: 32 buckets)
  const CodeMap& map;
  __m512 inv;
  __m512 level_table, gap_table;
  CodeMap::SearchBuckets buckets;

  Coder4(const CodeMap& code_map, float inverse) : map(code_map), inv(_mm512_set1_ps(inverse)) {
    if constexpr (kBuckets) {
      TORCH_CHECK(map.buckets_ready(kWide), "ort_optim: the 4-bit coder's map has no bucketed search");
      buckets = map.search_buckets();
    }
    if constexpr (kStochastic) {
      level_table = _mm512_load_ps(kSquare ? map.squares() : map.decode());
      gap_table = _mm512_load_ps(map.sr_step());
    }
  }

  void set_inverse(float inverse) { inv = _mm512_set1_ps(inverse); }

  // |x| / scale
  inline __m512 magnitude(__m512 x) const {
    return _mm512_mul_ps(_mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x7FFFFFFF))),
                         inv);
  }

  // The stochastic rounding's random numbers of 16 elements, float(2 * r16 + 1) (sr_step holds the gaps times
  // 2^-17), from their 32 random bits rnd[0, 16) (moment_random_bits): r16 = the top 16 for exp_avg, the low 16 for
  // sqrt(v). Shifts and a conversion, no multiply.
  static inline __m512 random16(const uint32_t* rnd) {
    const __m512i r = _mm512_loadu_si512(rnd);
    const __m512i twice = kSquare ? _mm512_and_si512(_mm512_slli_epi32(r, 1), _mm512_set1_epi32(0x1FFFE))
                                  : _mm512_srli_epi32(r, 15);  // (bit 0 is then set by the or)
    return _mm512_cvtepi32_ps(_mm512_or_si512(twice, _mm512_set1_epi32(1)));
  }
  // The codes of 16 values x whose magnitudes a (magnitude(x)) have the level codes code (round to nearest, or the
  // level at or below for a stochastic map): rounded one level up stochastically, and the sign. random:
  // random16 of the values' random bits (unused for a map that rounds to nearest).
  inline __m512i finish(__m512 x, __m512 a, __m512i code, __m512 random) {
    if constexpr (kStochastic) {
      // (not clamped at 0, as the scalar rule is: below 8 ulps lowered(a) is then negative or NaN, where the clamped
      // value, 0, never rounds up either: lo and the threshold are >= 0, and 0 - lo > threshold is false, as are the
      // comparisons of a NaN or a negative value; the same codes, one instruction fewer)
      __m512 lowered = _mm512_castsi512_ps(
          _mm512_sub_epi32(_mm512_castps_si512(a), _mm512_set1_epi32(int(spec::kExpAvgSrUlps))));
      if constexpr (kSquare) lowered = _mm512_mul_ps(lowered, lowered);  // (lo is then the level's square)
      const __m512 lo = _mm512_permutexvar_ps(code, level_table);
      const __m512 gap = _mm512_permutexvar_ps(code, gap_table);
      const __m512 threshold = _mm512_mul_ps(random, gap);
      const __mmask16 up = _mm512_cmp_ps_mask(_mm512_sub_ps(lowered, lo), threshold, _CMP_GT_OQ);
      code = _mm512_mask_add_epi32(code, up, code, _mm512_set1_epi32(1));
    }
    if constexpr (kSigned) {  // the sign, for a non-zero magnitude of a negative value
      // (x's sign bit: x < 0 but for -0.0, whose magnitude code is 0; the values are finite)
      const __mmask16 negative = _mm512_movepi32_mask(_mm512_castps_si512(x)) & _mm512_test_epi32_mask(code, code);
      code = _mm512_mask_or_epi32(code, negative, code, _mm512_set1_epi32(map.sign_bit()));
    }
    return code;
  }

  // The codes of 16 values, by the binary search over the thresholds in registers. random: as finish's.
  // kNonNegative: every x is +0 or above (sqrt(v)), its own magnitude.
  template <bool kNonNegative = false>
  inline __m512i codes4(__m512 x, __m512 random) {
    const __m512 a = kNonNegative ? _mm512_mul_ps(x, inv) : magnitude(x);
    if constexpr (kBuckets) return finish(x, a, buckets.template codes<kWide>(a), random);
    return finish(x, a, map.template magnitude_codes_by_search<kSigned ? 8 : 16>(a), random);
  }

  // 16 4-bit codes written as the format stores them: element 2j's code in the low nibble of byte j, 2j + 1's in the
  // high one (c[2j] + 16 * c[2j + 1]), 8 bytes.
  // (VBMI: each 64-bit lane's two codes into its low byte, c[2j] | c[2j + 1] << 4, by a shift of the lane and an or;
  // then one byte permute gathers the 8 bytes: 3 instructions where the narrowing and packing take 4)
  static inline void store4(__m512i code, uint8_t* out) {
#ifdef ORT_OPTIM_LOW_BIT_VBMI
    const __m512i pairs = _mm512_or_si512(code, _mm512_srli_epi64(code, 28));
    const __m512i gather = _mm512_set_epi64(0, 0, 0, 0, 0, 0, 0, 0x3830282018100800ll);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out),
                     _mm512_castsi512_si128(_mm512_permutexvar_epi8(gather, pairs)));
#else
    const __m128i pairs = _mm_maddubs_epi16(_mm512_cvtepi32_epi8(code), _mm_set1_epi16(0x1001));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out), _mm_packus_epi16(pairs, pairs));
#endif
  }
};

// The 8-bit codes of (finite) values, 16 at a time, by bit arithmetic on the binade grid of the map
// (CodeMap::Binades): per value, its binade's shift and offset (one permute each of a 32-entry table held in two
// registers, indexed by the exponent's low 5 bits), then kSigned (exp_avg, kFloor): the level at or below (its bits
// are the magnitude's with the mantissa cut to the binade's width), rounded stochastically one unit of the binade
// up; sqrt(v) (kMidpoint): the nearest level, by the shift one bit short plus one, halved (a carry out of the
// binade lands on the next binade's first level, whose code is next). No table of levels, gaps or thresholds: the
// same codes as the scalar CodeMap::stochastic_magnitude_code and magnitude_code, which search the thresholds.
// encode_block codes with it, and the Adam kernel's fused 8-bit step, which codes a block while it updates the next.
template <bool kSigned>
struct Coder8 {
  const CodeMap& map;
  __m512 inv = _mm512_setzero_ps();
  // (the map's constants, in registers: read through the map in the loop, they would be reloaded after every store)
  const __m512 snap, top;
  const __m512i sign_bit;
  __m512i shifts[2], offsets[2];
  __m512 sr_unit[2];

  explicit Coder8(const CodeMap& code_map)
      : map(code_map), snap(_mm512_set1_ps(map.snap())), top(_mm512_set1_ps(map.top())),
        sign_bit(_mm512_set1_epi32(map.sign_bit())) {
    TORCH_CHECK(map.binades() == (kSigned ? CodeMap::Binades::kFloor : CodeMap::Binades::kMidpoint),
                "ort_optim: the 8-bit vector coder needs levels on a binade grid (_spec.binade_levels), exp_avg's "
                "rounded from the level at or below, sqrt(v)'s to the nearest in sqrt(v)");
    for (int k = 0; k < 2; ++k) {
      shifts[k] = _mm512_load_si512(map.binade_shift() + 16 * k);
      offsets[k] = _mm512_load_si512(map.binade_offset() + 16 * k);
      sr_unit[k] = _mm512_load_ps(map.sr_unit() + 16 * k);
    }
  }

  // The values to code next are divided by scale (1 / scale = inverse; 0 for a zero block).
  void set_inverse(float inverse) { inv = _mm512_set1_ps(inverse); }

  // The codes of u[i, i + 16); rnd: the random bits of the block's elements (moment_random_bits) for exp_avg, else
  // unused.
  inline __m512i code16(const float* u, int64_t i, const uint32_t* rnd) const {
    const __m512 x = _mm512_loadu_ps(u + i);
    const __m512i abs_bits = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x7FFFFFFF));
    const __m512 a = _mm512_mul_ps(_mm512_castsi512_ps(abs_bits), inv);
    // (clamped to 2^-30 from below, where every value codes as exp_avg's 0 or sqrt(v)'s lowest level: its exponent's
    // low 5 bits then index the tables without a range check; not clamped to 1: a value a few ulps above it, from
    // the rounding of |x| / scale, has t = 0 all the same, the top code; sqrt(v)'s snap is 1)
    __m512 c = _mm512_max_ps(kSigned ? _mm512_mul_ps(a, snap) : a, _mm512_set1_ps(0x1p-30f));
    if constexpr (kSigned) {  // the top threshold (below 1): the top level from there
      c = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(c, top, _CMP_GE_OQ), c, _mm512_set1_ps(1.0f));
    }
    const __m512i bits = _mm512_castps_si512(c);
    const __m512i position = _mm512_srli_epi32(bits, 23);  // (permutes read its low 5 bits)
    const __m512i shift = _mm512_permutex2var_epi32(shifts[0], position, shifts[1]);
    const __m512i offset = _mm512_permutex2var_epi32(offsets[0], position, offsets[1]);
    if constexpr (!kSigned) {  // (half units of the binade, less the doubled offset and one, halved)
      return _mm512_srai_epi32(_mm512_sub_epi32(_mm512_srlv_epi32(bits, shift), offset), 1);
    } else {
      // (CodeMap::stochastic_magnitude_code) up iff (lowered(a) - lo) > ((2 * r16 + 1) * 2^-17) * (hi - lo), from a
      // non-zero level below the top one. hi - lo is the binade's unit, +inf at zero and the top level, so that no
      // lane there rounds up; lowered(a) is not clamped at 0: below 8 ulps it is negative or NaN, and never rounds up.
      __m512i code = _mm512_sub_epi32(_mm512_srlv_epi32(bits, shift), offset);
      const __m512i lo = _mm512_and_si512(bits, _mm512_sllv_epi32(_mm512_set1_epi32(-1), shift));
      const __m512 lowered = _mm512_castsi512_ps(
          _mm512_sub_epi32(_mm512_castps_si512(a), _mm512_set1_epi32(int(spec::kExpAvgSrUlps))));
      const __m512i r = _mm512_srli_epi32(_mm512_loadu_si512(rnd + i), 15);  // 2 * r16 (bit 0 set by the or)
      const __m512 random = _mm512_cvtepi32_ps(_mm512_or_si512(r, _mm512_set1_epi32(1)));
      const __m512 unit = _mm512_permutex2var_ps(sr_unit[0], position, sr_unit[1]);
      const __mmask16 up = _mm512_cmp_ps_mask(_mm512_sub_ps(lowered, _mm512_castsi512_ps(lo)),
                                              _mm512_mul_ps(random, unit), _CMP_GT_OQ);
      code = _mm512_mask_add_epi32(code, up, code, _mm512_set1_epi32(1));
      const __mmask16 negative = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ) &
                                 _mm512_test_epi32_mask(code, code);
      return _mm512_mask_or_epi32(code, negative, code, sign_bit);
    }
  }
};
#endif

// The two formats, built once from ort_optim_spec.h: 8-bit codes with float32 scales, 4-bit codes (two per byte)
// with bfloat16 scales.
const LowBit& q8();
const LowBit& q4();

// dst[0, n) = the values of elements [off, off + n) (off a multiple of the format's block); v = u * u for a second
// moment.
void low_bit_load(const LowBit& f, bool second_moment, const uint8_t* codes, const void* scales, int64_t off,
                  int64_t n, float* dst);

// Writes src[0, n) as the codes and scales of elements [off, off + n). root: sqrt(src) when the caller has it (a
// second moment's codes hold sqrt(v)), else nullptr. rnd: the step's random bits of elements [off, off + n)
// (moment_random_bits of the step's new exp_avg), which an exp_avg and a 4-bit sqrt(v) round stochastically with.
// stored_root (a second moment), where given: receives the decoded sqrt(v) of the codes written, u = level * |s|
// (inf for an overflowed v, NaN in a NaN block), which a relative exp_avg is coded against.
void low_bit_store(const LowBit& f, bool second_moment, const float* src, const float* root, int64_t off, int64_t n,
                   uint8_t* codes, void* scales, const uint32_t* rnd, float* stored_root = nullptr);

// A relative exp_avg (f.relative; _spec.EXP_AVG_RELATIVE), elements [off, off + n) with off a multiple of the block,
// against the exp_avg_sq codes sq_codes / sq_scales of the same format.
// Load: v = exp_avg_sq's values (as low_bit_load), u = its decoded sqrt(v), m = q * u (0 where q = 0), from the
// exp_avg_sq codes as they were stored with this exp_avg; one pass over each moment's codes.
void low_bit_relative_load(const LowBit& f, const uint8_t* codes, const void* scales, const uint8_t* sq_codes,
                           const void* sq_scales, int64_t off, int64_t n, float* m, float* v, float* u);
// Store, after exp_avg_sq's new codes are written: m becomes r = m / u (0 where u = 0), coded as exp_avg, with u the
// decoded sqrt(v) of those codes (low_bit_store's stored_root).
void low_bit_relative_store(const LowBit& f, const float* m, const float* u, int64_t off, int64_t n, uint8_t* codes,
                            void* scales, const uint32_t* rnd);

}  // namespace ort_optim
