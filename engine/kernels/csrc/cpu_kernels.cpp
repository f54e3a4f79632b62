// The CPU path's kernels, compiled at first use by engine/kernels/cpu_kernels.py (torch.utils.cpp_extension.load, -O3
// -march=native):
// - paged decode attention: one query token per request against its cached keys and values, read in place
//   through the block table (no gather copy). Layout and contract: engine/layers/attention.py.
// - the decoder's elementwise work fused into one pass over each row (as vLLM's fused_add_rms_norm,
//   rotary_embedding + reshape_and_cache, silu_and_mul): RMSNorm with the residual add, RoPE of Q and K with the
//   K/V cache write, SiLU(gate) * up. Each computes in fp32 and rounds once to the storage dtype.
//
// Work is split over (request, KV head) pairs; each pair serves its `group` query heads (grouped-query attention,
// Ainslie et al. 2023) so every key and value row is read once per pair. Scores, softmax and the weighted sum of
// values are computed in fp32 whatever the storage dtype (fp32, bf16, fp16), as the reference's fp32 softmax.
// Source: Kwon et al., "Efficient Memory Management for Large Language Model Serving with PagedAttention" (SOSP
// 2023); two-pass softmax with the row maximum subtracted (Milakov & Gimelshein, 2018, for the online form).

// Only the headers the kernels use (tensors, parallel_for, at::empty, the pybind11 tensor caster), not
// <torch/extension.h> (all of libtorch's C++ API): the first build on a machine parses 3x less.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <limits>
#include <vector>

#include <immintrin.h>

#include "simd_avx2.h"

namespace {

// Widen a row to fp32. bf16 is the high half of an fp32: a 16-bit shift, which vectorizes (c10::BFloat16's
// conversion operator does not).
template <typename T>
inline void load_row(const T* __restrict__ src, float* __restrict__ dst, int64_t d) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
    uint32_t* o = reinterpret_cast<uint32_t*>(dst);
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) o[i] = static_cast<uint32_t>(s[i]) << 16;
  } else {
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<float>(src[i]);
  }
}

template <typename T>
inline void store_row(const float* __restrict__ src, T* __restrict__ dst, int64_t d) {
  for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<T>(src[i]);  // round to nearest even, as torch's casts
}

// The value a float takes once stored as T (torch rounds every op's result to the tensor's dtype).
template <typename T>
inline float round_to(float x) { return static_cast<float>(static_cast<T>(x)); }

// 16 fp32 lanes as one value: the compiler maps it to one AVX-512 register or two AVX2 ones.
typedef float v16 __attribute__((vector_size(64)));

// How many v16 accumulators a register-blocked loop may keep live: AVX-512 has 32 registers of 16 lanes, AVX2 16
// of 8 (a v16 takes two). Past the register file the accumulators spill to the stack on every FMA (on AVX2 the
// AVX-512 blocking made the attention kernel 5-10x slower than torch's SDPA; bench/README.md "AVX2").
#ifdef __AVX512F__
constexpr int kMaxAccV16 = 16;
#else
constexpr int kMaxAccV16 = 4;
#endif

// Horizontal sums of 16 vectors at once: lane j of the result is the sum of the lanes of a[bitreverse4(j)], so a
// caller that puts token t in a[bitreverse4(t)] gets the 16 dot products in order. Four levels of shuffle + add
// (15 of each in all) instead of 16 separate reductions of 4 steps each.
inline v16 transpose_reduce16(v16* a) {
  v16 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)
    b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30,
                                   31);
  for (int i = 0; i < 4; ++i)
    c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
           __builtin_shufflevector(b[2 * i], b[2 * i + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)
    d[i] = __builtin_shufflevector(c[2 * i], c[2 * i + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
           __builtin_shufflevector(c[2 * i], c[2 * i + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  return __builtin_shufflevector(d[0], d[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
         __builtin_shufflevector(d[0], d[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
}

constexpr int kBitrev4[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};

inline v16 load16(const float* p) {
  v16 v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

template <typename T>
inline void prefetch_row(const T* p, int64_t head_dim) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < head_dim * static_cast<int64_t>(sizeof(T)); off += 64) __builtin_prefetch(c + off);
}

typedef int32_t vi16 __attribute__((vector_size(64)));

// Lane-wise selections on v16 with the meaning of the ternaries they stand for. GCC lowers `a > b ? a : b` on a
// 16-lane vector lane by lane where the machine's registers hold 8 lanes (AVX2): 16 scalar compares and blends per
// vector, which made silu_and_mul 2x slower than torch's and argmax_rows slower than torch.argmax there
// (bench/cpu_kernels.py --elementwise). On AVX2 each half is one instruction; AVX-512 keeps the ternaries (native).
#if defined(__AVX2__) && !defined(__AVX512F__)
inline __m256 half8(const v16& v, int h) {
  __m256 r;
  __builtin_memcpy(&r, reinterpret_cast<const char*>(&v) + 32 * h, sizeof(r));
  return r;
}
inline v16 join8(__m256 lo, __m256 hi) {
  v16 r;
  __builtin_memcpy(&r, &lo, sizeof(lo));
  __builtin_memcpy(reinterpret_cast<char*>(&r) + 32, &hi, sizeof(hi));
  return r;
}
// a > b ? a : b (b where either is NaN: vmaxps' rule).
inline v16 vmax16(v16 a, v16 b) {
  return join8(_mm256_max_ps(half8(a, 0), half8(b, 0)), _mm256_max_ps(half8(a, 1), half8(b, 1)));
}
// a < b ? a : b (b where either is NaN: vminps' rule).
inline v16 vmin16(v16 a, v16 b) {
  return join8(_mm256_min_ps(half8(a, 0), half8(b, 0)), _mm256_min_ps(half8(a, 1), half8(b, 1)));
}
// True (all ones) in the lanes that hold a NaN.
inline vi16 vnan16(v16 v) {
  const __m256 lo = half8(v, 0), hi = half8(v, 1);
  const v16 m = join8(_mm256_cmp_ps(lo, lo, _CMP_UNORD_Q), _mm256_cmp_ps(hi, hi, _CMP_UNORD_Q));
  vi16 r;
  __builtin_memcpy(&r, &m, sizeof(r));
  return r;
}
// Round to the nearest integer, ties to even (std::nearbyint in the default rounding mode).
inline v16 vrint16(v16 v) {
  constexpr int kMode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return join8(_mm256_round_ps(half8(v, 0), kMode), _mm256_round_ps(half8(v, 1), kMode));
}
#else
inline v16 vmax16(v16 a, v16 b) { return a > b ? a : b; }
inline v16 vmin16(v16 a, v16 b) { return a < b ? a : b; }
inline vi16 vnan16(v16 v) { return v != v; }
inline v16 vrint16(v16 v) {
  float r[16];
  __builtin_memcpy(r, &v, sizeof(r));
  for (int i = 0; i < 16; ++i) r[i] = std::nearbyint(r[i]);
  return load16(r);
}
#endif

// 16 elements of T widened to fp32 lanes (bf16: the 16-bit shift of load_row, in registers).
template <typename T>
inline v16 load16_as_f32(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return load16(p);
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    typedef uint16_t u16x16 __attribute__((vector_size(32)));
    u16x16 h;
    __builtin_memcpy(&h, p, sizeof(h));
    const vi16 w = __builtin_convertvector(h, vi16) << 16;
    v16 f;
    __builtin_memcpy(&f, &w, sizeof(f));
    return f;
  } else {
    float tmp[16];
    for (int i = 0; i < 16; ++i) tmp[i] = static_cast<float>(p[i]);
    return load16(tmp);
  }
}

// out_i[0:16*CH] = sum over start <= t < n of p_i[t - start] * V[t], i < P, for P query heads that read the same KV
// head (its slice at `off` in each cache row) of one request, whose values are read in place block by block through
// its block table. `start` is a multiple of block_size (0, or the first block of a sliding window).
// The P*CH accumulators stay in registers for the whole sum and each value vector is widened once for all P heads,
// so a value element costs one load and P FMAs (head_dim 64: CH = 4, P <= 4; 128: CH = 8, P <= 2).
template <typename T, int CH, int P>
inline void weighted_values(const T* v_cache, const int32_t* table, int64_t block_size, int64_t row, int64_t off,
                            const float* const* p, int64_t start, int64_t n, float* const* out) {
  v16 a[P][CH] = {};
  for (int64_t t0 = start; t0 < n; t0 += block_size) {
    const T* base = v_cache + static_cast<int64_t>(table[t0 / block_size]) * block_size * row + off;
    if (t0 + block_size < n) {  // the next block's rows of this head, while this block's FMAs run
      const T* next = v_cache + static_cast<int64_t>(table[t0 / block_size + 1]) * block_size * row + off;
      for (int64_t tt = 0; tt < block_size; ++tt) prefetch_row(next + tt * row, 16 * CH);
    }
    const int64_t m = std::min<int64_t>(block_size, n - t0);
    for (int64_t tt = 0; tt < m; ++tt) {
      const T* vr = base + tt * row;
      v16 pt[P];
      for (int i = 0; i < P; ++i) pt[i] = p[i][t0 - start + tt] - v16{};
      // One value vector live at a time: the registers hold the P * CH accumulators, P broadcasts and one value.
      for (int c = 0; c < CH; ++c) {
        const v16 v = load16_as_f32(vr + 16 * c);
        for (int i = 0; i < P; ++i) a[i][c] += pt[i] * v;
      }
    }
  }
  for (int i = 0; i < P; ++i)
    for (int c = 0; c < CH; ++c) __builtin_memcpy(out[i] + 16 * c, &a[i][c], sizeof(v16));
}

// weighted_values for `count` heads (1..4 with CH = 4, 1..2 with CH = 8) sharing one KV head and one key range.
template <typename T, int CH>
inline void weighted_values_n(int count, const T* v_cache, const int32_t* table, int64_t block_size, int64_t row,
                              int64_t off, const float* const* p, int64_t start, int64_t n, float* const* out) {
  switch (count) {
    case 1: weighted_values<T, CH, 1>(v_cache, table, block_size, row, off, p, start, n, out); break;
    case 2: weighted_values<T, CH, 2>(v_cache, table, block_size, row, off, p, start, n, out); break;
    case 3:
      if constexpr (CH == 4) weighted_values<T, CH, 3>(v_cache, table, block_size, row, off, p, start, n, out);
      break;
    default:
      if constexpr (CH == 4) weighted_values<T, CH, 4>(v_cache, table, block_size, row, off, p, start, n, out);
  }
}

// exp of 16 lanes: Cody-Waite range reduction x = n ln2 + r, |r| <= ln2 / 2, and Cephes' degree-6 polynomial
// for expf (Moshier, "Cephes Math Library", expf.c; relative error about 1e-7), scaled by 2^n through the exponent
// bits. Inputs are clamped to [-87.3, 88.7]: exp(-87.3) ~ 1e-38 stands in for exp(-inf) = 0.
inline v16 exp16(v16 x) {
  x = vmax16(v16{} - 87.3f, x);  // x < lo ? lo : x
  x = vmin16(v16{} + 88.7f, x);  // x > hi ? hi : x
  const v16 y = x * 1.44269504088896341f;
  // n = round half away from zero: y + copysign(0.5, y), truncated.
  vi16 half_bits;
  __builtin_memcpy(&half_bits, &y, sizeof(half_bits));
  half_bits = (half_bits & static_cast<int32_t>(0x80000000u)) | 0x3f000000;  // +-0.5f
  v16 half;
  __builtin_memcpy(&half, &half_bits, sizeof(half));
  const vi16 n = __builtin_convertvector(y + half, vi16);
  const v16 fn = __builtin_convertvector(n, v16);
  v16 r = x - fn * 0.693359375f;
  r = r - fn * -2.12194440e-4f;
  v16 p = v16{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  const vi16 bits = (n + 127) << 23;
  v16 scale;
  __builtin_memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

inline float hmax16(v16 v) {
  float r[16];
  __builtin_memcpy(r, &v, sizeof(r));
  float m = r[0];
  for (int i = 1; i < 16; ++i) m = r[i] > m ? r[i] : m;
  return m;
}

inline float hsum16(v16 v) {
  float r[16];
  __builtin_memcpy(r, &v, sizeof(r));
  float s = 0.f;
  for (int i = 0; i < 16; ++i) s += r[i];
  return s;
}

// Softmax numerators in place: sh[t] = exp(sh[t] - max) over padded (a multiple of 16) scores whose masked entries
// hold -inf; returns their sum (the denominator). The row maximum is subtracted first (Milakov & Gimelshein, 2018).
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define TM_AVX2_ELEMENTWISE 1
// AVX2 forms of the elementwise kernels below. A v16 is not a register type there: GCC keeps it on the stack and
// moves it through general registers on every operation (`objdump -d`: silu_and_mul ran 2x slower than torch's and
// argmax_rows no faster than torch.argmax), so these work on 8-lane __m256 values. Same arithmetic as exp16 and
// the v16 loops (Cephes expf, round half away from zero), so results agree to the last bit with the AVX-512 path
// except where FMA contraction orders a sum differently.
using tm_avx2::exp8;
using tm_avx2::hmax8;
using tm_avx2::hsum8;

using tm_avx2::exp_scores16;  // exp_scores16 below, 8 lanes at a time

// silu(g) * u over n fp32 lanes (the tail, n % 8, in scalar code).
inline void silu_mul_row_avx2(const float* g, const float* u, float* out, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(g + i);
    const __m256 s = _mm256_div_ps(x, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
  }
  for (; i < n; ++i) out[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
}

// Largest value of an fp32 row and whether it holds a NaN (max as `v > m ? v : m`, vmaxps' rule).
inline float row_max_avx2(const float* row, int64_t cols, bool* nan) {
  const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 m0 = ninf, m1 = ninf, n0 = _mm256_setzero_ps(), n1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= cols; i += 16) {  // two chains, so consecutive maxes do not wait on each other
    const __m256 a = _mm256_loadu_ps(row + i), b = _mm256_loadu_ps(row + i + 8);
    n0 = _mm256_or_ps(n0, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
    n1 = _mm256_or_ps(n1, _mm256_cmp_ps(b, b, _CMP_UNORD_Q));
    m0 = _mm256_max_ps(a, m0);
    m1 = _mm256_max_ps(b, m1);
  }
  float best = hmax8(_mm256_max_ps(m0, m1));
  bool has_nan = _mm256_movemask_ps(_mm256_or_ps(n0, n1)) != 0;
  for (; i < cols; ++i) {
    has_nan |= row[i] != row[i];
    best = row[i] > best ? row[i] : best;
  }
  *nan = has_nan;
  return best;
}

// Index of the first lane of an fp32 row equal to `value` (the first NaN when `nan`); cols when there is none.
inline int64_t row_find_avx2(const float* row, int64_t cols, float value, bool nan) {
  const __m256 v = _mm256_set1_ps(value);
  int64_t i = 0;
  for (; i + 8 <= cols; i += 8) {
    const __m256 x = _mm256_loadu_ps(row + i);
    const int mask = _mm256_movemask_ps(nan ? _mm256_cmp_ps(x, x, _CMP_UNORD_Q) : _mm256_cmp_ps(x, v, _CMP_EQ_OQ));
    if (mask) return i + __builtin_ctz(mask);
  }
  for (; i < cols; ++i)
    if (nan ? row[i] != row[i] : row[i] == value) return i;
  return cols;
}

// Per-row symmetric int8 of an fp32 row as uint8 + 128 (quantize_rows_kernel's arithmetic: x / scale, round half to
// even). Returns the scale.
inline float quantize_row_avx2(const float* x, uint8_t* q, int64_t cols) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 mv = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= cols; i += 8) mv = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(x + i), abs_mask), mv);
  float m = hmax8(mv);
  for (; i < cols; ++i) m = std::max(m, std::fabs(x[i]));
  const float scale = std::max(m, 1e-12f) / 127.f;
  const __m256 sv = _mm256_set1_ps(scale), zp = _mm256_set1_ps(128.f);
  constexpr int kMode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  i = 0;
  for (; i + 16 <= cols; i += 16) {
    const __m256i a = _mm256_cvtps_epi32(
        _mm256_add_ps(_mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(x + i), sv), kMode), zp));
    const __m256i b = _mm256_cvtps_epi32(
        _mm256_add_ps(_mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(x + i + 8), sv), kMode), zp));
    // int32 -> uint16 -> uint8 (values are in [1, 255]): packs work within 128-bit lanes, so fix the order after.
    const __m256i w = _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xd8);
    const __m128i bytes = _mm_packus_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), bytes);
  }
  for (; i < cols; ++i) q[i] = static_cast<uint8_t>(std::nearbyint(x[i] / scale) + 128.f);
  return scale;
}
#else
// With a sink (gpt-oss's attention sinks; -inf = none) the maximum and the sum take exp(sink) as one more score.
inline float exp_scores16(float* sh, int64_t padded, float sink = -std::numeric_limits<float>::infinity()) {
  v16 mv = load16(sh);
  for (int64_t t = 16; t < padded; t += 16) {
    mv = vmax16(load16(sh + t), mv);
  }
  const float mx = std::max(hmax16(mv), sink);
  v16 sum = {};
  for (int64_t t = 0; t < padded; t += 16) {
    const v16 e = exp16(load16(sh + t) - mx);
    __builtin_memcpy(sh + t, &e, sizeof(e));
    sum += e;
  }
  return sink == -std::numeric_limits<float>::infinity() ? hsum16(sum) : hsum16(sum) + std::exp(sink - mx);
}
#endif

// Gemma 2's soft-capping of n scores in place: s -> cap * tanh(s / cap) (cap > 0; 0 = none, nothing done).
inline void softcap_scores(float* s, int64_t n, float cap) {
  if (cap <= 0.f) return;
  const float inv = 1.f / cap;
  for (int64_t t = 0; t < n; ++t) s[t] = cap * std::tanh(s[t] * inv);
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512F__)
// AVX2 (8 fp32 lanes, 16 registers): attention one query row at a time, written for the register file it runs on.
// The 16-lane path above keeps 16 dot products (32 ymm) or 16 value accumulators live, which AVX2 cannot hold; here
// a score run is 8 dot products (8 accumulators + the query chunk) and a value pass P <= 4 heads x 16 channels (8
// accumulators, P broadcasts, one value vector). Every key and value cache line of the row's context is read once
// per KV head group pass; fp32 keys and values are read in place (bf16/fp16 ones widened 8 rows at a time).
constexpr bool kAvx2Rows = true;

template <typename T>
inline __m256 load8_f32(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm256_loadu_ps(p);
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
}

// Lane i of the result: the sum of the 8 lanes of a[i] (8 dot products finished at once: 6 hadds, 2 permutes).
inline __m256 hsum8x8(const __m256* a) {
  const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

// acc_i[0:16] += sum over keys lo <= t < lim of p_i[t - lo] * V[t] for P heads of one KV head (its 16 channels at
// `off` of each cache row), values read in place block by block through the block table.
template <typename T, int P>
inline void pv_slice_avx2(const T* v_cache, const int32_t* table, int64_t block_size, int64_t row, int64_t off,
                          const float* const* p, int64_t lo, int64_t lim, float* const* acc) {
  __m256 a[P][2];
  for (int i = 0; i < P; ++i) a[i][0] = a[i][1] = _mm256_setzero_ps();
  for (int64_t t0 = lo; t0 < lim;) {
    const int64_t in_block = t0 % block_size, m = std::min<int64_t>(block_size - in_block, lim - t0);
    const T* vr = v_cache + (static_cast<int64_t>(table[t0 / block_size]) * block_size + in_block) * row + off;
    const int64_t base = t0 - lo;
    for (int64_t t = 0; t < m; ++t, vr += row) {
      const __m256 v0 = load8_f32(vr), v1 = load8_f32(vr + 8);
#pragma GCC unroll 4
      for (int i = 0; i < P; ++i) {
        const __m256 pt = _mm256_broadcast_ss(p[i] + base + t);
        a[i][0] = _mm256_fmadd_ps(pt, v0, a[i][0]);
        a[i][1] = _mm256_fmadd_ps(pt, v1, a[i][1]);
      }
    }
    t0 += m;
  }
  for (int i = 0; i < P; ++i) {
    _mm256_storeu_ps(acc[i], a[i][0]);
    _mm256_storeu_ps(acc[i] + 8, a[i][1]);
  }
}

// One query row (num_heads x head_dim at q, head stride q_stride_h) against keys lo <= t < lim of its request:
// scores in fp32, softmax with the row maximum subtracted, the weighted sum of values, out rounded to T once.
// Scratch: qf [num_heads * head_dim], scores [num_heads * padded] (padded = n rounded up to 16), kbuf
// [8 * head_dim] (non-fp32 caches), acc [num_heads * head_dim]. head_dim % 16 == 0.
template <typename T>
void attend_row_avx2(const T* q, int64_t q_stride_h, const T* k_cache, const T* v_cache, const int32_t* table,
                     int64_t block_size, int64_t num_kv_heads, int64_t head_dim, int64_t group, float scale,
                     float softcap, int64_t lo, int64_t lim, float* qf, std::vector<float>& scores, float* kbuf,
                     float* acc, T* out, const float* sinks) {
  const int64_t num_heads = num_kv_heads * group, row = num_kv_heads * head_dim;
  const int64_t n = lim - lo, padded = (n + 15) / 16 * 16;
  if (static_cast<int64_t>(scores.size()) < num_heads * padded) scores.resize(num_heads * padded);
  for (int64_t h = 0; h < num_heads; ++h) {
    load_row(q + h * q_stride_h, qf + h * head_dim, head_dim);
    for (int64_t i = 0; i < head_dim; ++i) qf[h * head_dim + i] *= scale;
  }
  auto key = [&](int64_t t) {
    return k_cache + (static_cast<int64_t>(table[t / block_size]) * block_size + t % block_size) * row;
  };
  for (int64_t t0 = lo; t0 < lim; t0 += 8) {
    const int64_t m = std::min<int64_t>(8, lim - t0);
    const T* kr[8];
    for (int i = 0; i < 8; ++i) kr[i] = key(t0 + std::min<int64_t>(i, m - 1));  // a short run repeats its last key
    for (int64_t g = 0; g < num_kv_heads; ++g) {
      const float* kf[8];
      for (int i = 0; i < 8; ++i) {
        if constexpr (std::is_same_v<T, float>) {
          kf[i] = kr[i] + g * head_dim;
        } else {
          load_row(kr[i] + g * head_dim, kbuf + i * head_dim, head_dim);
          kf[i] = kbuf + i * head_dim;
        }
      }
      for (int64_t h = g * group; h < (g + 1) * group; ++h) {
        const float* qh = qf + h * head_dim;
        __m256 a[8];
        for (int i = 0; i < 8; ++i) a[i] = _mm256_setzero_ps();
        for (int64_t c = 0; c < head_dim; c += 8) {
          const __m256 qv = _mm256_loadu_ps(qh + c);
#pragma GCC unroll 8
          for (int i = 0; i < 8; ++i) a[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kf[i] + c), a[i]);
        }
        _mm256_storeu_ps(scores.data() + h * padded + (t0 - lo), hsum8x8(a));
      }
    }
  }
  float inv[256];  // 1 / softmax denominator per head (num_heads <= 256, checked by the caller)
  for (int64_t h = 0; h < num_heads; ++h) {
    float* sh = scores.data() + h * padded;
    softcap_scores(sh, n, softcap);
    for (int64_t t = n; t < padded; ++t) sh[t] = -std::numeric_limits<float>::infinity();
    inv[h] = 1.f / exp_scores16(sh, padded, sinks ? sinks[h] : -std::numeric_limits<float>::infinity());
  }
  for (int64_t g = 0; g < num_kv_heads; ++g)
    for (int64_t h0 = g * group; h0 < (g + 1) * group; h0 += 4) {
      const int count = static_cast<int>(std::min<int64_t>(4, (g + 1) * group - h0));
      for (int64_t c0 = 0; c0 < head_dim; c0 += 16) {
        const float* ph[4];
        float* ah[4];
        for (int i = 0; i < count; ++i) {
          ph[i] = scores.data() + (h0 + i) * padded;
          ah[i] = acc + (h0 + i) * head_dim + c0;
        }
        const int64_t off = g * head_dim + c0;
        switch (count) {
          case 1: pv_slice_avx2<T, 1>(v_cache, table, block_size, row, off, ph, lo, lim, ah); break;
          case 2: pv_slice_avx2<T, 2>(v_cache, table, block_size, row, off, ph, lo, lim, ah); break;
          case 3: pv_slice_avx2<T, 3>(v_cache, table, block_size, row, off, ph, lo, lim, ah); break;
          default: pv_slice_avx2<T, 4>(v_cache, table, block_size, row, off, ph, lo, lim, ah);
        }
      }
    }
  for (int64_t h = 0; h < num_heads; ++h)
    for (int64_t i = 0; i < head_dim; ++i) acc[h * head_dim + i] *= inv[h];
  store_row(acc, out, num_heads * head_dim);
}
#else
constexpr bool kAvx2Rows = false;
template <typename T>
void attend_row_avx2(const T*, int64_t, const T*, const T*, const int32_t*, int64_t, int64_t, int64_t, int64_t, float,
                     float, int64_t, int64_t, float*, std::vector<float>&, float*, float*, T*, const float*) {}
#endif

// One work item: query rows [row_begin, row_end) of request `seq`, at most kRowsPerItem of them.
struct AttnItem {
  int64_t seq, row_begin, row_end;
};
constexpr int64_t kRowsPerItem = 8;

// Causal attention of every query row of a step over its request's cached keys and values (the step's own K/V
// already written). Row j of request b (query_start_loc[b] <= j < query_start_loc[b + 1]) sits at position
// seq_lens[b] - q_len_b + (j - query_start_loc[b]) and sees keys 0..that position. A decode is a request with one
// row. The rows of an item share each key/value block read: the block streams in once per item, in address order,
// as whole cache rows (all KV heads). With a sliding window (window > 0; 0 = none) the row at position i sees keys
// i - window < t <= i only (Mistral; HF transformers' sliding_window_overlay): the item starts at the KV block that
// holds its first row's first key, so whole blocks before every row's window are never read, and the keys of that
// block before a row's window are masked (probability exactly 0). With softcap > 0 (Gemma 2) each scaled score s
// becomes softcap * tanh(s / softcap) before the softmax. With sinks (gpt-oss; nullptr = none) head h's softmax
// denominator also holds exp(sinks[h]), a key of value zero.
template <typename T>
void attention_kernel(const T* q, int64_t q_stride_t, int64_t q_stride_h, const T* k_cache, const T* v_cache,
                      int64_t block_size, int64_t num_kv_heads, int64_t head_dim, const int32_t* block_tables,
                      int64_t table_stride, const int32_t* seq_lens, const int32_t* query_start_loc,
                      int64_t num_seqs, int64_t group, float scale, int64_t window, float softcap, T* out,
                      const float* sinks = nullptr) {
  const int64_t num_heads = num_kv_heads * group;
  const int64_t row = num_kv_heads * head_dim;  // elements per token slot in the cache: every KV head's columns
  const bool vectorized = head_dim % 16 == 0;
  const int64_t chunks = head_dim / 16;
  std::vector<AttnItem> items;
  for (int64_t b = 0; b < num_seqs; ++b)
    for (int64_t r = query_start_loc[b]; r < query_start_loc[b + 1]; r += kRowsPerItem)
      items.push_back({b, r, std::min<int64_t>(r + kRowsPerItem, query_start_loc[b + 1])});
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(kRowsPerItem * num_heads * head_dim), acc(kRowsPerItem * num_heads * head_dim),
        kf(16 * row), scores;
    int64_t lim[kRowsPerItem], lo[kRowsPerItem];
    for (int64_t it = begin; it < end; ++it) {
      const AttnItem item = items[it];
      const int64_t b = item.seq, nr = item.row_end - item.row_begin;
      const int64_t first_pos = seq_lens[b] - (query_start_loc[b + 1] - query_start_loc[b]);
      for (int64_t j = 0; j < nr; ++j) {
        lim[j] = first_pos + (item.row_begin - query_start_loc[b]) + j + 1;
        lo[j] = window > 0 ? std::max<int64_t>(0, lim[j] - window) : 0;
      }
      if constexpr (kAvx2Rows && !std::is_same_v<T, double>) {
        if (head_dim % 16 == 0 && num_heads <= 256) {
          for (int64_t j = 0; j < nr; ++j)
            attend_row_avx2(q + (item.row_begin + j) * q_stride_t, q_stride_h, k_cache, v_cache,
                            block_tables + b * table_stride, block_size, num_kv_heads, head_dim, group, scale,
                            softcap, lo[j], lim[j], qf.data(), scores, kf.data(), acc.data(),
                            out + (item.row_begin + j) * num_heads * head_dim, sinks);
          continue;
        }
      }
      const int64_t len = lim[nr - 1];  // the last row sees the most keys
      // The first key read: the start of the KV block of the first row's first key. Scores are indexed from k0.
      const int64_t k0 = lo[0] / block_size * block_size;
      const int32_t* table = block_tables + b * table_stride;
      auto slot = [&](const T* cache, int64_t t) {
        return cache + (static_cast<int64_t>(table[t / block_size]) * block_size + t % block_size) * row;
      };
      for (int64_t j = 0; j < nr; ++j)
        for (int64_t h = 0; h < num_heads; ++h) {
          float* dst = qf.data() + (j * num_heads + h) * head_dim;
          load_row(q + (item.row_begin + j) * q_stride_t + h * q_stride_h, dst, head_dim);
          for (int64_t i = 0; i < head_dim; ++i) dst[i] *= scale;
        }
      const int64_t padded = (len - k0 + 15) / 16 * 16;
      scores.resize(nr * num_heads * padded);
      for (int64_t t = k0; t < std::min<int64_t>(k0 + 16, len); ++t) prefetch_row(slot(k_cache, t), row);
      // Scores, 16 keys at a time: the keys widened to fp32 once, then each (row, head)'s 16 dot products reduced
      // together (transpose_reduce16). Keys past a row's limit are computed and then masked by the softmax.
      for (int64_t t0 = k0; t0 < len; t0 += 16) {
        const int64_t n = std::min<int64_t>(16, len - t0);
        for (int64_t t = t0 + 16; t < std::min<int64_t>(t0 + 32, len); ++t) prefetch_row(slot(k_cache, t), row);
        if (t0 + 16 >= len)
          for (int64_t t = k0; t < std::min<int64_t>(k0 + 16, len); ++t) prefetch_row(slot(v_cache, t), row);
        for (int64_t t = 0; t < n; ++t) load_row(slot(k_cache, t0 + t), kf.data() + t * row, row);
        for (int64_t j = 0; j < nr; ++j) {
          if (lim[j] <= t0 || lo[j] >= t0 + n) continue;  // no key of this run is in row j's window
          for (int64_t h = 0; h < num_heads; ++h) {
            const float* qh = qf.data() + (j * num_heads + h) * head_dim;
            const float* kh = kf.data() + (h / group) * head_dim;  // query head h reads KV head h / group
            float* sh = scores.data() + (j * num_heads + h) * padded + (t0 - k0);
            if (vectorized) {
              // All 16 keys whatever n (kf's rows past n hold finite stale values, never stored below): a fixed
              // trip count lets the compiler interleave the 16 independent dot products instead of waiting on one
              // chain of dependent FMAs at a time.
              v16 a[16];
#pragma GCC unroll 16
              for (int t = 0; t < 16; ++t) {
                v16 acc16 = {};
                for (int64_t c = 0; c < chunks; ++c)
                  acc16 += load16(qh + 16 * c) * load16(kh + t * row + 16 * c);
                a[kBitrev4[t]] = acc16;
              }
              float r[16];
              const v16 sums = transpose_reduce16(a);
              __builtin_memcpy(r, &sums, sizeof(r));
              for (int64_t t = 0; t < n; ++t) sh[t] = r[t];
            } else {
              for (int64_t t = 0; t < n; ++t) {
                const float* kt = kh + t * row;
                float dot = 0.f;
                for (int64_t i = 0; i < head_dim; ++i) dot += qh[i] * kt[i];
                sh[t] = dot;
              }
            }
          }
        }
      }
      // Softmax per (row, head), 16 scores at a time; everything past the row's limit holds -inf (exp -> ~0 in
      // the sum, and never read below), and so does everything before its window (set to exactly 0 after the exp:
      // the value sums below do read those keys of the first block).
      for (int64_t j = 0; j < nr; ++j) {
        const int64_t pj = (lim[j] - k0 + 15) / 16 * 16, lj = lim[j] - k0, wj = lo[j] - k0;
        for (int64_t h = 0; h < num_heads; ++h) {
          float* sh = scores.data() + (j * num_heads + h) * padded;
          softcap_scores(sh + wj, lj - wj, softcap);
          for (int64_t t = 0; t < wj; ++t) sh[t] = -std::numeric_limits<float>::infinity();
          for (int64_t t = lj; t < pj; ++t) sh[t] = -std::numeric_limits<float>::infinity();
          const float inv =
              1.f / exp_scores16(sh, pj, sinks ? sinks[h] : -std::numeric_limits<float>::infinity());
          for (int64_t t = 0; t < wj; ++t) sh[t] = 0.f;
          for (int64_t t = wj; t < lj; ++t) sh[t] *= inv;
        }
      }
      if (vectorized && (chunks == 4 || chunks == 8)) {
        // Heads per call and channels per call such that the heads x channels accumulators stay in registers
        // (kMaxAccV16): AVX-512 takes up to 4 heads of 64 or 2 of 128 at once; AVX2 one head, 64 channels a call.
        const int slice = std::min<int>(static_cast<int>(chunks), kMaxAccV16);
        const int max_heads = std::min(slice == 4 ? 4 : 2, std::max(1, kMaxAccV16 / slice));
        for (int64_t j = 0; j < nr; ++j)
          for (int64_t g = 0; g < num_kv_heads; ++g)
            for (int64_t h0 = 0; h0 < group; h0 += max_heads) {
              const int count = static_cast<int>(std::min<int64_t>(max_heads, group - h0));
              for (int64_t c0 = 0; c0 < chunks; c0 += slice) {
                const float* ph[4];
                float* ah[4];
                for (int i = 0; i < count; ++i) {
                  const int64_t h = g * group + h0 + i;
                  ph[i] = scores.data() + (j * num_heads + h) * padded;
                  ah[i] = acc.data() + (j * num_heads + h) * head_dim + 16 * c0;
                }
                const int64_t off = g * head_dim + 16 * c0;
                if (slice == 4)
                  weighted_values_n<T, 4>(count, v_cache, table, block_size, row, off, ph, k0, lim[j], ah);
                else
                  weighted_values_n<T, 8>(count, v_cache, table, block_size, row, off, ph, k0, lim[j], ah);
              }
            }
        for (int64_t j = 0; j < nr; ++j)
          store_row(acc.data() + j * num_heads * head_dim, out + (item.row_begin + j) * num_heads * head_dim,
                    num_heads * head_dim);
        continue;
      }
      std::fill(acc.begin(), acc.begin() + nr * num_heads * head_dim, 0.f);
      for (int64_t t = k0; t < len; ++t) {
        if (t + 8 < len) prefetch_row(slot(v_cache, t + 8), row);
        load_row(slot(v_cache, t), kf.data(), row);
        for (int64_t j = 0; j < nr; ++j) {
          if (lim[j] <= t || t < lo[j]) continue;
          for (int64_t h = 0; h < num_heads; ++h) {
            const float p = scores[(j * num_heads + h) * padded + (t - k0)];
            const float* vh = kf.data() + (h / group) * head_dim;
            float* ah = acc.data() + (j * num_heads + h) * head_dim;
#pragma omp simd
            for (int64_t i = 0; i < head_dim; ++i) ah[i] += p * vh[i];
          }
        }
      }
      for (int64_t j = 0; j < nr; ++j)
        store_row(acc.data() + j * num_heads * head_dim, out + (item.row_begin + j) * num_heads * head_dim,
                  num_heads * head_dim);
    }
  });
}

// RMSNorm (Zhang & Sennrich, 2019) as HF transformers' LlamaRMSNorm computes it: x in fp32, x * rsqrt(mean(x^2)
// + eps), rounded to T, times the weight, rounded to T. With a residual: sum = round_T(residual + x) first (the
// decoder's skip connection, stored to `sum_out`), and that sum is what gets normalized.
template <typename T>
void rms_norm_kernel(const T* x, int64_t x_stride, const T* residual, T* sum_out, const T* weight, T* out,
                     int64_t rows, int64_t hidden, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> xf(hidden), wf(hidden);
    load_row(weight, wf.data(), hidden);
    for (int64_t r = begin; r < end; ++r) {
      load_row(x + r * x_stride, xf.data(), hidden);
      if (residual != nullptr) {
        const T* res = residual + r * hidden;
        T* sum = sum_out + r * hidden;
        for (int64_t i = 0; i < hidden; ++i) {
          sum[i] = static_cast<T>(xf[i] + static_cast<float>(res[i]));
          xf[i] = static_cast<float>(sum[i]);
        }
      }
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < hidden; ++i) ss += xf[i] * xf[i];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(hidden) + eps);
      T* o = out + r * hidden;
      for (int64_t i = 0; i < hidden; ++i) o[i] = static_cast<T>(wf[i] * round_to<T>(xf[i] * inv));
    }
  });
}

// RoPE (Su et al., RoFormer, 2021; HF's rotate-half form) of the Q and K heads of a fused QKV row, Q into `q_out`,
// K and V into the paged cache at the token's slot (engine.layers.attention.write_kv's layout).
template <typename T>
void rope_cache_kernel(const T* qkv, int64_t qkv_stride, const T* cos, const T* sin, const int64_t* slots,
                       T* q_out, T* k_cache, T* v_cache, int64_t tokens, int64_t num_heads, int64_t num_kv_heads,
                       int64_t head_dim, int64_t rotary_dim) {
  const int64_t half = rotary_dim / 2;
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> c(rotary_dim), s(rotary_dim), x(head_dim), y(head_dim);
    for (int64_t t = begin; t < end; ++t) {
      load_row(cos + t * rotary_dim, c.data(), rotary_dim);
      load_row(sin + t * rotary_dim, s.data(), rotary_dim);
      const T* row = qkv + t * qkv_stride;
      for (int64_t h = 0; h < num_heads + num_kv_heads; ++h) {
        load_row(row + h * head_dim, x.data(), head_dim);
        for (int64_t i = 0; i < half; ++i) {
          y[i] = x[i] * c[i] - x[i + half] * s[i];
          y[i + half] = x[i + half] * c[i + half] + x[i] * s[i + half];
        }
        std::copy(x.begin() + rotary_dim, x.end(), y.begin() + rotary_dim);  // partial rotary: the rest pass through
        T* dst = h < num_heads ? q_out + (t * num_heads + h) * head_dim
                               : k_cache + (slots[t] * num_kv_heads + (h - num_heads)) * head_dim;
        store_row(y.data(), dst, head_dim);
      }
      std::copy(row + (num_heads + num_kv_heads) * head_dim, row + (num_heads + 2 * num_kv_heads) * head_dim,
                v_cache + slots[t] * num_kv_heads * head_dim);
    }
  });
}

// SwiGLU's gate (Shazeer, 2020): out = silu(gate) * up, gate and up the two halves of a fused gate_up row.
template <typename T>
void silu_mul_kernel(const T* gate_up, T* out, int64_t rows, int64_t inter) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> g(inter), u(inter);
    for (int64_t r = begin; r < end; ++r) {
#ifdef TM_AVX2_ELEMENTWISE
      if constexpr (std::is_same_v<T, float>) {
        silu_mul_row_avx2(gate_up + r * 2 * inter, gate_up + r * 2 * inter + inter, out + r * inter, inter);
      } else {
        load_row(gate_up + r * 2 * inter, g.data(), inter);
        load_row(gate_up + r * 2 * inter + inter, u.data(), inter);
        silu_mul_row_avx2(g.data(), u.data(), g.data(), inter);
        store_row(g.data(), out + r * inter, inter);
      }
      continue;
#endif
      load_row(gate_up + r * 2 * inter, g.data(), inter);
      load_row(gate_up + r * 2 * inter + inter, u.data(), inter);
      for (int64_t i = 0; i < inter; i += 16) {
        const int64_t n = std::min<int64_t>(16, inter - i);
        if (n == 16) {
          const v16 x = load16(g.data() + i);
          const v16 y = x / (1.f + exp16(v16{} - x)) * load16(u.data() + i);
          __builtin_memcpy(g.data() + i, &y, sizeof(y));
        } else {
          for (int64_t j = i; j < i + n; ++j) g[j] = g[j] / (1.f + std::exp(-g[j])) * u[j];
        }
      }
      store_row(g.data(), out + r * inter, inter);
    }
  });
}

// Symmetric per-row INT8 quantization of activations (W8A8's dynamic per-token scheme; Xiao et al., SmoothQuant,
// 2023): scale = max|x| / 127 (1e-12 at least), q = round_half_even(x / scale) + 128 as uint8, the u8 x s8 form of
// VNNI's int8 dot products.
template <typename T>
void quantize_rows_kernel(const T* x, int64_t x_stride, uint8_t* q, float* scales, int64_t rows, int64_t cols) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> xf(cols);
    for (int64_t r = begin; r < end; ++r) {
#ifdef TM_AVX2_ELEMENTWISE
      const float* xr = xf.data();
      if constexpr (std::is_same_v<T, float>) {
        xr = x + r * x_stride;
      } else {
        load_row(x + r * x_stride, xf.data(), cols);
      }
      scales[r] = quantize_row_avx2(xr, q + r * cols, cols);
      continue;
#endif
      load_row(x + r * x_stride, xf.data(), cols);
      const int64_t vec_end = cols - cols % 16;
      v16 mv = {};
      for (int64_t i = 0; i < vec_end; i += 16) {
        vi16 bits;  // |x|: the sign bit cleared
        __builtin_memcpy(&bits, xf.data() + i, sizeof(bits));
        bits &= 0x7fffffff;
        v16 a;
        __builtin_memcpy(&a, &bits, sizeof(a));
        mv = vmax16(a, mv);  // std::max(m, |x|): m where |x| is NaN
      }
      float m = hmax16(mv);
      for (int64_t i = vec_end; i < cols; ++i) m = std::max(m, std::fabs(xf[i]));
      const float scale = std::max(m, 1e-12f) / 127.f;
      scales[r] = scale;
      uint8_t* qr = q + r * cols;
      for (int64_t i = 0; i < vec_end; i += 16) {
        float y[16];
        const v16 v = vrint16(load16(xf.data() + i) / scale) + 128.f;
        __builtin_memcpy(y, &v, sizeof(y));
        for (int j = 0; j < 16; ++j) qr[i + j] = static_cast<uint8_t>(y[j]);
      }
      for (int64_t i = vec_end; i < cols; ++i) qr[i] = static_cast<uint8_t>(std::nearbyint(xf[i] / scale) + 128.f);
    }
  });
}

// Index of each row's largest value, the first one on ties, as torch.argmax (a NaN counts as the largest, the
// first NaN wins). One vectorized pass finds the maximum (and whether a NaN is there), a second finds its first
// index. torch's own CPU argmax of bf16 rows reduces one element at a time (5.6 ms for 64 x 49,152 here).
template <typename T>
void argmax_rows_kernel(const T* x, int64_t x_stride, int64_t rows, int64_t cols, int64_t* out) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = x + r * x_stride;
#ifdef TM_AVX2_ELEMENTWISE
      if constexpr (std::is_same_v<T, float>) {
        bool nan = false;
        const float best = row_max_avx2(row, cols, &nan);
        const int64_t idx = row_find_avx2(row, cols, best, nan);
        out[r] = idx < cols ? idx : 0;
        continue;
      }
#endif
      const int64_t vec_end = cols - cols % 16;
      v16 m;
      for (int j = 0; j < 16; ++j) m[j] = -std::numeric_limits<float>::infinity();
      vi16 nan_lanes = {};
      for (int64_t i = 0; i < vec_end; i += 16) {
        const v16 v = load16_as_f32(row + i);
        nan_lanes |= vnan16(v);
        m = vmax16(v, m);
      }
      bool nan = false;
      for (int j = 0; j < 16; ++j) nan |= nan_lanes[j] != 0;
      float best = hmax16(m);
      for (int64_t i = vec_end; i < cols; ++i) {
        const float v = static_cast<float>(row[i]);
        nan |= v != v;
        best = v > best ? v : best;
      }
      int64_t idx = 0;
      for (int64_t i = 0; i < cols; ++i) {
        const float v = static_cast<float>(row[i]);
        if (nan ? v != v : v == best) {
          idx = i;
          break;
        }
      }
      out[r] = idx;
    }
  });
}

// Sampling of [S, V] logit rows by the inverse CDF (engine.sample.sampler: the same draws as its torch path, up to the
// rounding of exp): each row is divided by its temperature and turned into unnormalized probabilities exp(x - max)
// (exp16, one vectorized pass), cut to its top_k and then its top_p nucleus (tokens ranked by probability, ties by
// lower id), and one uniform u in [0, 1) picks, walking the kept tokens in token-id order, the first whose
// cumulative probability exceeds u * (the kept mass). Top-k: a partial sort of the k best. Top-p alone: a histogram
// of the probability mass over the top 11 bits of the fp32 probabilities (exponent and 3 mantissa bits, which order
// as the values do) finds the bucket where the nucleus closes, and only that bucket is sorted: no sort of the
// vocabulary. Sums in double. Top-p: Holtzman et al., ICLR 2020; top-k: Fan et al., ACL 2018.
constexpr int kBucketShift = 20;  // fp32 bits >> 20: sign (0), 8 exponent bits, 3 mantissa bits
constexpr int kBuckets = 1 << 11;

inline uint32_t float_bits(float v) {
  uint32_t b;
  __builtin_memcpy(&b, &v, sizeof(b));
  return b;
}

// Token of the row whose cumulative weight, over the tokens `keep(i)` admits in id order, first exceeds u * their
// total `mass`; the last admitted token when rounding leaves none.
template <typename Keep>
inline int64_t pick_in_order(const float* p, int64_t cols, double mass, double u, Keep keep) {
  const double target = u * mass;
  double acc = 0.0;
  int64_t last = 0;
  for (int64_t i = 0; i < cols; ++i) {
    if (!keep(i)) continue;
    acc += p[i];
    last = i;
    if (acc > target) return i;
  }
  return last;
}

template <typename T>
void sample_rows_kernel(const T* x, int64_t x_stride, int64_t cols, int64_t n, const int64_t* rows,
                        const float* temperature, const int64_t* top_k, const float* top_p, const double* u,
                        int64_t* out) {
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> p(cols);
    std::vector<int32_t> order;
    std::vector<double> bucket_mass(kBuckets);
    for (int64_t r = begin; r < end; ++r) {
      float* pr = p.data();
      load_row(x + rows[r] * x_stride, pr, cols);
      const float t = temperature[r];
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t i = 0; i < cols; ++i) {
        pr[i] = pr[i] / t;
        m = pr[i] > m ? pr[i] : m;
      }
      const int64_t k = top_k[r];
      const bool use_k = k > 0 && k < cols;
      const bool use_p = top_p[r] < 1.f;
      const auto ranked_above = [pr](int32_t a, int32_t b) { return pr[a] > pr[b] || (pr[a] == pr[b] && a < b); };
      if (use_k) {
        // Rank by x (the order of the probabilities) and exponentiate only the k best.
        order.resize(cols);
        for (int64_t i = 0; i < cols; ++i) order[i] = static_cast<int32_t>(i);
        std::partial_sort(order.begin(), order.begin() + k, order.end(), ranked_above);
        double total = 0.0;
        for (int64_t j = 0; j < k; ++j) {
          pr[order[j]] = std::exp(pr[order[j]] - m);
          total += pr[order[j]];
        }
        int64_t kept = k;
        double mass = total;
        if (use_p) {  // keep a token while the tokens ranked above it hold less than top_p of the mass
          const double threshold = static_cast<double>(top_p[r]) * total;
          mass = 0.0;
          kept = 0;
          while (kept < k && mass < threshold) mass += pr[order[kept++]];
        }
        std::sort(order.begin(), order.begin() + kept);  // walk in token-id order
        const double target = u[r] * mass;
        double acc = 0.0;
        int64_t tok = order[kept - 1];
        for (int64_t j = 0; j < kept; ++j) {
          acc += pr[order[j]];
          if (acc > target) {
            tok = order[j];
            break;
          }
        }
        out[r] = tok;
        continue;
      }
      double z = 0.0;
      const int64_t vec_end = cols - cols % 16;
      for (int64_t i = 0; i < vec_end; i += 16) {
        const v16 e = exp16(load16(pr + i) - m);
        __builtin_memcpy(pr + i, &e, sizeof(e));
        z += hsum16(e);
      }
      for (int64_t i = vec_end; i < cols; ++i) {
        pr[i] = std::exp(pr[i] - m);
        z += pr[i];
      }
      if (!use_p) {
        out[r] = pick_in_order(pr, cols, z, u[r], [](int64_t) { return true; });
        continue;
      }
      // Top-p alone. Mass per bucket; from the top bucket down, the first whose mass reaches the threshold is
      // where the nucleus closes: every token above it is kept, and its own tokens are ranked to find the cut.
      const double threshold = static_cast<double>(top_p[r]) * z;
      std::fill(bucket_mass.begin(), bucket_mass.end(), 0.0);
      for (int64_t i = 0; i < cols; ++i) bucket_mass[float_bits(pr[i]) >> kBucketShift] += pr[i];
      double above = 0.0;
      int b = kBuckets - 1;
      for (; b > 0; --b) {
        if (above + bucket_mass[b] >= threshold) break;
        above += bucket_mass[b];
      }
      order.clear();
      for (int64_t i = 0; i < cols; ++i)
        if (static_cast<int>(float_bits(pr[i]) >> kBucketShift) == b) order.push_back(static_cast<int32_t>(i));
      if (order.empty()) {  // rounding left the threshold above the whole mass: the nucleus is the whole row
        out[r] = pick_in_order(pr, cols, z, u[r], [](int64_t) { return true; });
        continue;
      }
      std::sort(order.begin(), order.end(), ranked_above);
      double mass = above;
      size_t kept = 0;
      while (kept < order.size() && mass < threshold) mass += pr[order[kept++]];
      if (kept == 0) kept = 1;  // rounding: the bucket's first token closes the nucleus
      mass = above;
      for (size_t j = 0; j < kept; ++j) mass += pr[order[j]];
      const float p_cut = pr[order[kept - 1]];
      const int64_t id_cut = order[kept - 1];
      out[r] = pick_in_order(pr, cols, mass, u[r],
                             [pr, p_cut, id_cut](int64_t i) { return pr[i] > p_cut || (pr[i] == p_cut && i <= id_cut); });
    }
  });
}

// ---- GGUF block GEMM (gguf_linear): y = x W^T with W read from its GGUF Q4_0 / Q4_1 / Q8_0 blocks ----
// Layout (engine/kernels/gguf_blocks.py GGUFBlocks): qs uint8 [N, K/32, 16] (Q4: element j < 16 in the low nibble of byte j,
// j + 16 in its high nibble) or int8 [N, K/32, 32] (Q8_0); scales, mins fp32 [N, K/32]. Weight = fma(d, q, min)
// (Q8_0: d * q); d * q is exact in fp32 (11 + 8 significant bits), so every weight is the value gguf-py's
// dequantize gives. Each block is dequantized once into registers and used for up to kGgufRowTile rows of x, with
// fp32 accumulation: at a few rows per step the GEMM reads 0.75 (Q4: 16 B of nibbles + fp32 scale and min per 32
// weights) / 1.125 (Q8_0) bytes per weight instead of fp32's 4 (a decode step is bandwidth-bound; llama.cpp's
// ggml_vec_dot kernels work on the same blocks). Measured at SmolLM2-135M's shapes: bench/cpu_kernels.py --gguf.
constexpr int kGgufQ4_0 = 2, kGgufQ4_1 = 3, kGgufQ8_0 = 8;  // ggml_type ids

// Portable form (any CPU; GCC vector extensions, FMA where -march=native has it): dequantize into a float[32], then
// 8-lane multiply-adds per row of x.
typedef float v8 __attribute__((vector_size(32)));

inline v8 load8(const float* p) {
  v8 v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

template <int MT, int TYPE>
void gguf_row_portable(const float* x, int64_t K, const uint8_t* qs, const float* sc, const float* mn, int64_t nb,
                       float* y, int64_t ldy) {
  v8 acc[MT] = {};
  alignas(32) float w[32];
  for (int64_t b = 0; b < nb; ++b) {
    const float d = sc[b];
    if constexpr (TYPE == kGgufQ8_0) {
      const int8_t* q = reinterpret_cast<const int8_t*>(qs) + b * 32;
      for (int j = 0; j < 32; ++j) w[j] = d * static_cast<float>(q[j]);
    } else {
      const uint8_t* q = qs + b * 16;
      const float m = mn[b];
      for (int j = 0; j < 16; ++j) {
        w[j] = d * static_cast<float>(q[j] & 15) + m;  // d * q is exact: one rounding, fused or not
        w[j + 16] = d * static_cast<float>(q[j] >> 4) + m;
      }
    }
    for (int r = 0; r < MT; ++r) {
      const float* xr = x + r * K + b * 32;
      for (int i = 0; i < 4; ++i) acc[r] += load8(w + 8 * i) * load8(xr + 8 * i);
    }
  }
  for (int r = 0; r < MT; ++r) {
    float s = 0.f;
    for (int i = 0; i < 8; ++i) s += acc[r][i];
    y[r * ldy] = s;
  }
}

#if defined(__AVX2__) && defined(__FMA__)
#define TM_AVX2_GGUF 1
// AVX2 + FMA form: the block's 32 weights in four __m256 (nibbles / bytes widened with vpmovzx/vpmovsx, converted,
// one fma or mul each), then one fma per 8 weights per row into per-row accumulators (several per row when there are
// few rows, so the fma latency chains overlap). Also the path of AVX-512 machines (same instructions).
// The 32 weights of block b in four __m256 (elements 0-7, 8-15, 16-23, 24-31): bytes widened to int32 lanes straight
// from memory (vpmovzx/vpmovsx with a folded load: one shuffle per 8 weights), nibbles split in the 32-bit lanes
// (and / shift on any vector pipe), converted, one fma (Q4) or mul (Q8_0) each.
template <int TYPE>
inline void gguf_block_avx2(const uint8_t* qs, const float* sc, const float* mn, int64_t b, __m256* w) {
  const __m256 d = _mm256_broadcast_ss(sc + b);
  if constexpr (TYPE == kGgufQ8_0) {
    const uint8_t* q = qs + b * 32;
    for (int i = 0; i < 4; ++i)
      w[i] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                  _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * i)))));
  } else {
    const __m256 m = _mm256_broadcast_ss(mn + b);
    const uint8_t* q = qs + b * 16;
    const __m256i low4 = _mm256_set1_epi32(15);
    const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)));
    const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8)));
    w[0] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(a, low4)), m);
    w[1] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(c, low4)), m);
    w[2] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4)), m);
    w[3] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_srli_epi32(c, 4)), m);
  }
}

// AVX2 + FMA form: NR rows of W at once against MT rows of x. Each block's weights (gguf_block_avx2), then one fma
// per 8 weights per row of x into that (W row, x row)'s accumulators: 8 chains in all (NR x MT x NA), so the fma
// latency (4 cycles) overlaps, and a row's reduction overlaps the other rows' work. Also the path of AVX-512 machines.
template <int MT, int NR, int TYPE>
void gguf_rows_avx2(const float* x, int64_t K, const uint8_t* qs, const float* sc, const float* mn, int64_t nb,
                    float* y, int64_t ldy) {
  constexpr int NA = 8 / (MT * NR) > 0 ? 8 / (MT * NR) : 1;  // accumulators per (W row, x row)
  constexpr int64_t QB = TYPE == kGgufQ8_0 ? 32 : 16;
  __m256 acc[NR][MT][NA];
  for (int j = 0; j < NR; ++j)
    for (int r = 0; r < MT; ++r)
      for (int a = 0; a < NA; ++a) acc[j][r][a] = _mm256_setzero_ps();
  // Software prefetch of the next NR rows' blocks, at the pace these are read: with 2-4 rows read side by side the
  // hardware prefetcher fell behind (Q8_0 LM head at M = 1: 7 ns per block from memory, 2.6 with this; a prefetch
  // past the end of W does not fault).
  const char* ahead = reinterpret_cast<const char*>(qs + NR * nb * QB);
  for (int64_t b = 0; b < nb; ++b) {
    for (int64_t off = 0; off < NR * QB; off += 64) __builtin_prefetch(ahead + b * NR * QB + off);
    for (int j = 0; j < NR; ++j) {
      __m256 w[4];
      gguf_block_avx2<TYPE>(qs + j * nb * QB, sc + j * nb, mn == nullptr ? nullptr : mn + j * nb, b, w);
      for (int r = 0; r < MT; ++r) {
        const float* xr = x + r * K + b * 32;
        for (int i = 0; i < 4; ++i) acc[j][r][i % NA] = _mm256_fmadd_ps(w[i], _mm256_loadu_ps(xr + 8 * i),
                                                                       acc[j][r][i % NA]);
      }
    }
  }
  for (int j = 0; j < NR; ++j)
    for (int r = 0; r < MT; ++r) {
      __m256 s = acc[j][r][0];
      for (int a = 1; a < NA; ++a) s = _mm256_add_ps(s, acc[j][r][a]);
      __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
      h = _mm_add_ps(h, _mm_movehl_ps(h, h));
      y[r * ldy + j] = _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
    }
}
#endif

constexpr int kGgufRowTile = 8;  // rows of x per pass over W: 8 accumulators + 4 weights fit AVX2's 16 registers

// Portable: one row n of W against all M rows of x, in passes of 8, 4, 2, 1 rows (its blocks stay in L1).
template <int TYPE>
void gguf_rows_portable(const float* x, int64_t M, int64_t K, const uint8_t* qs, const float* sc, const float* mn,
                        int64_t nb, float* y, int64_t N, int64_t begin, int64_t end) {
  constexpr int64_t QB = TYPE == kGgufQ8_0 ? 32 : 16;
  for (int64_t n = begin; n < end; ++n) {
    const uint8_t* q = qs + n * nb * QB;
    const float* s = sc + n * nb;
    const float* m = mn == nullptr ? nullptr : mn + n * nb;
    int64_t r = 0;
    for (; r + kGgufRowTile <= M; r += kGgufRowTile)
      gguf_row_portable<kGgufRowTile, TYPE>(x + r * K, K, q, s, m, nb, y + r * N + n, N);
    if (M - r >= 4) { gguf_row_portable<4, TYPE>(x + r * K, K, q, s, m, nb, y + r * N + n, N); r += 4; }
    if (M - r >= 2) { gguf_row_portable<2, TYPE>(x + r * K, K, q, s, m, nb, y + r * N + n, N); r += 2; }
    if (M - r >= 1) gguf_row_portable<1, TYPE>(x + r * K, K, q, s, m, nb, y + r * N + n, N);
  }
}

#ifdef TM_AVX2_GGUF
// AVX2: rows [begin, end) of W against all M rows of x, in passes of (x rows MT, W rows at once NR) = (8, 1) while
// 8 rows are left, then (4, 2), (2, 2), (1, 4): 8 accumulator chains in each.
template <int TYPE>
void gguf_rows_avx2_range(const float* x, int64_t M, int64_t K, const uint8_t* qs, const float* sc, const float* mn,
                          int64_t nb, float* y, int64_t N, int64_t begin, int64_t end) {
  constexpr int64_t QB = TYPE == kGgufQ8_0 ? 32 : 16;
  int64_t r = 0;
  auto pass = [&](auto tile_rows, auto tile_w) {
    constexpr int MT = decltype(tile_rows)::value, NR = decltype(tile_w)::value;
    int64_t n = begin;
    for (; n + NR <= end; n += NR)
      gguf_rows_avx2<MT, NR, TYPE>(x + r * K, K, qs + n * nb * QB, sc + n * nb, mn == nullptr ? nullptr : mn + n * nb,
                                   nb, y + r * N + n, N);
    for (; n < end; ++n)
      gguf_rows_avx2<MT, 1, TYPE>(x + r * K, K, qs + n * nb * QB, sc + n * nb, mn == nullptr ? nullptr : mn + n * nb,
                                  nb, y + r * N + n, N);
    r += MT;
  };
  using I1 = std::integral_constant<int, 1>;
  using I2 = std::integral_constant<int, 2>;
  using I4 = std::integral_constant<int, 4>;
  using I8 = std::integral_constant<int, kGgufRowTile>;
  while (r + kGgufRowTile <= M) pass(I8{}, I1{});
  if (M - r >= 4) pass(I4{}, I2{});
  if (M - r >= 2) pass(I2{}, I2{});
  if (M - r >= 1) pass(I1{}, I4{});
}
#endif

template <int TYPE, bool PORTABLE>
void gguf_linear_kernel(const float* x, int64_t M, int64_t K, const uint8_t* qs, const float* scales,
                        const float* mins, int64_t N, float* y) {
  const int64_t nb = K / 32;
  // Rows of W split over the threads: grain 16 so N = 192 still gives every thread of a few some rows.
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
#ifdef TM_AVX2_GGUF
    if constexpr (!PORTABLE) {
      gguf_rows_avx2_range<TYPE>(x, M, K, qs, scales, mins, nb, y, N, begin, end);
      return;
    }
#endif
    gguf_rows_portable<TYPE>(x, M, K, qs, scales, mins, nb, y, N, begin, end);
  });
}

}  // namespace

#define TM_DISPATCH(dtype, name, ...) AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, name, __VA_ARGS__)

// x [T, H] (rows may be strided), weight [H]. Returns [T, H] in x's dtype.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [T, H] with contiguous rows");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "weight must be [H] of x's dtype");
  auto out = at::empty(x.sizes(), x.options());
  TM_DISPATCH(x.scalar_type(), "rms_norm", [&] {
    rms_norm_kernel<scalar_t>(x.data_ptr<scalar_t>(), x.stride(0), nullptr, nullptr, weight.data_ptr<scalar_t>(),
                              out.data_ptr<scalar_t>(), x.size(0), x.size(1), static_cast<float>(eps));
  });
  return out;
}

// x, residual [T, H] contiguous, weight [H]. Returns (rms_norm(residual + x), residual + x), both new tensors.
std::vector<at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                        const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && residual.is_contiguous() && residual.sizes() == x.sizes() &&
              residual.scalar_type() == x.scalar_type(), "x and residual must be contiguous [T, H] of one dtype");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "weight must be [H] of x's dtype");
  auto out = at::empty(x.sizes(), x.options());
  auto sum = at::empty(x.sizes(), x.options());
  TM_DISPATCH(x.scalar_type(), "add_rms_norm", [&] {
    rms_norm_kernel<scalar_t>(x.data_ptr<scalar_t>(), x.size(1), residual.data_ptr<scalar_t>(),
                              sum.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                              x.size(0), x.size(1), static_cast<float>(eps));
  });
  return {out, sum};
}

// qkv [T, (H + 2 Hkv) D] (rows may be strided), cos/sin [T, R] of qkv's dtype (R <= D even: the first R dims of each
// head rotate, the rest pass through; HF's partial rotary), slot_mapping int64 [T], caches [blocks, block_size, Hkv,
// D] contiguous. Writes K (rotated) and V into the caches; returns rotated Q [T, H, D].
at::Tensor rope_write_kv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                            const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& slot_mapping, int64_t num_heads) {
  const int64_t tokens = qkv.size(0), num_kv_heads = k_cache.size(2), head_dim = k_cache.size(3);
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.size(1) == (num_heads + 2 * num_kv_heads) * head_dim,
              "qkv must be [T, (H + 2 Hkv) D] with contiguous rows");
  TORCH_CHECK(head_dim % 2 == 0, "head_dim must be even");
  TORCH_CHECK(cos.dim() == 2 && cos.is_contiguous() && sin.is_contiguous() && cos.size(0) == tokens &&
              cos.size(1) >= 2 && cos.size(1) <= head_dim && cos.size(1) % 2 == 0 &&
              cos.scalar_type() == qkv.scalar_type() && sin.sizes() == cos.sizes() &&
              sin.scalar_type() == qkv.scalar_type(), "cos/sin must be [T, R <= D, even] of qkv's dtype, contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.scalar_type() == qkv.scalar_type() &&
              v_cache.scalar_type() == qkv.scalar_type(), "caches must be contiguous, of qkv's dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
              slot_mapping.numel() == tokens, "slot_mapping must be int64 [T]");
  auto q = at::empty({tokens, num_heads, head_dim}, qkv.options());
  TM_DISPATCH(qkv.scalar_type(), "rope_write_kv", [&] {
    rope_cache_kernel<scalar_t>(qkv.data_ptr<scalar_t>(), qkv.stride(0), cos.data_ptr<scalar_t>(),
                                sin.data_ptr<scalar_t>(), slot_mapping.data_ptr<int64_t>(), q.data_ptr<scalar_t>(),
                                k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(), tokens, num_heads,
                                num_kv_heads, head_dim, cos.size(1));
  });
  return q;
}

// gate_up [T, 2I] contiguous -> silu(gate_up[:, :I]) * gate_up[:, I:], [T, I].
at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "gate_up must be [T, 2I], contiguous");
  const int64_t inter = gate_up.size(1) / 2;
  auto out = at::empty({gate_up.size(0), inter}, gate_up.options());
  TM_DISPATCH(gate_up.scalar_type(), "silu_and_mul", [&] {
    silu_mul_kernel<scalar_t>(gate_up.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), gate_up.size(0), inter);
  });
  return out;
}

// x [M, K] (rows may be strided) -> (uint8 [M, K], fp32 scales [M, 1]); see quantize_rows_kernel.
std::vector<at::Tensor> quantize_rows_u8(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [M, K] with contiguous rows");
  auto q = at::empty(x.sizes(), x.options().dtype(at::kByte));
  auto scales = at::empty({x.size(0), 1}, x.options().dtype(at::kFloat));
  TM_DISPATCH(x.scalar_type(), "quantize_rows_u8", [&] {
    quantize_rows_kernel<scalar_t>(x.data_ptr<scalar_t>(), x.stride(0), q.data_ptr<uint8_t>(),
                                   scales.data_ptr<float>(), x.size(0), x.size(1));
  });
  return {q, scales};
}

// q [T, H, D] (last dim contiguous), caches [num_blocks, block_size, Hkv, D] contiguous, block_tables int32 [B, W],
// seq_lens int32 [B] (>= the request's query rows), query_start_loc int32 [B + 1] (prefix sums of the query rows,
// starting at 0 and ending at T), window: the sliding window in keys (0 = none), softcap: the scores' soft cap (0 =
// none), sinks: fp32 [H] logits in each head's softmax denominator (gpt-oss; None = none). Returns [T, H, D] in q's
// dtype.
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                              const at::Tensor& block_tables, const at::Tensor& seq_lens,
                              const at::Tensor& query_start_loc, double scale, int64_t window, double softcap,
                              const c10::optional<at::Tensor>& sinks) {
  TORCH_CHECK(window >= 0, "window must be >= 0 keys (0 = no sliding window)");
  TORCH_CHECK(softcap >= 0, "softcap must be >= 0 (0 = no soft-capping)");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [T, H, D] with a contiguous last dim");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "KV caches must be contiguous");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "q and the KV caches must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.stride(1) == 1, "block_tables int32");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous(), "seq_lens int32 contiguous");
  TORCH_CHECK(query_start_loc.scalar_type() == at::kInt && query_start_loc.is_contiguous(),
              "query_start_loc int32 contiguous");
  const int64_t num_seqs = seq_lens.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = k_cache.size(2), block_size = k_cache.size(1);
  TORCH_CHECK(k_cache.size(3) == head_dim && num_heads % num_kv_heads == 0, "head shapes do not match");
  TORCH_CHECK(block_tables.size(0) >= num_seqs && query_start_loc.size(0) == num_seqs + 1,
              "one block table per request and num_seqs + 1 query offsets");
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  TORCH_CHECK(qsl[0] == 0 && qsl[num_seqs] == q.size(0), "query_start_loc must run from 0 to T");
  for (int64_t b = 0; b < num_seqs; ++b)
    TORCH_CHECK(qsl[b + 1] > qsl[b] && lens[b] >= qsl[b + 1] - qsl[b] &&
                    (lens[b] + block_size - 1) / block_size <= block_tables.size(1),
                "every request needs >= 1 query row, seq_len >= its rows, and its blocks in the table");
  const float* sink_ptr = nullptr;
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->is_contiguous() && sinks->dim() == 1 &&
                    sinks->size(0) == num_heads, "sinks must be fp32 contiguous [num_heads]");
    sink_ptr = sinks->data_ptr<float>();
  }
  auto out = at::empty({q.size(0), num_heads, head_dim}, q.options());
  TM_DISPATCH(q.scalar_type(), "paged_attention", [&] {
    attention_kernel<scalar_t>(q.data_ptr<scalar_t>(), q.stride(0), q.stride(1), k_cache.data_ptr<scalar_t>(),
                               v_cache.data_ptr<scalar_t>(), block_size, num_kv_heads, head_dim,
                               block_tables.data_ptr<int32_t>(), block_tables.stride(0), lens, qsl, num_seqs,
                               num_heads / num_kv_heads, static_cast<float>(scale), window,
                               static_cast<float>(softcap), out.data_ptr<scalar_t>(), sink_ptr);
  });
  return out;
}

// x [S, V] (rows may be strided) -> int64 [S]: torch.argmax(x, dim=-1), see argmax_rows_kernel.
at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) > 0, "x must be [S, V] with contiguous rows, V > 0");
  auto out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  TM_DISPATCH(x.scalar_type(), "argmax_rows", [&] {
    argmax_rows_kernel<scalar_t>(x.data_ptr<scalar_t>(), x.stride(0), x.size(0), x.size(1),
                                 out.data_ptr<int64_t>());
  });
  return out;
}

// logits [S, V] (rows may be strided); rows int64 [R] (which logit rows), temperature fp32 [R] (> 0), top_k int64
// [R] (0 = off), top_p fp32 [R] (1 = off), u fp64 [R] in [0, 1). Returns int64 [R] token ids (sample_rows_kernel).
at::Tensor sample_rows(const at::Tensor& x, const at::Tensor& rows, const at::Tensor& temperature,
                          const at::Tensor& top_k, const at::Tensor& top_p, const at::Tensor& u) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) > 0, "x must be [S, V] with contiguous rows, V > 0");
  TORCH_CHECK(x.size(1) <= std::numeric_limits<int32_t>::max(), "vocabulary too large");
  const int64_t n = rows.numel();
  TORCH_CHECK(rows.scalar_type() == at::kLong && top_k.scalar_type() == at::kLong &&
                  temperature.scalar_type() == at::kFloat && top_p.scalar_type() == at::kFloat &&
                  u.scalar_type() == at::kDouble,
              "rows, top_k: int64; temperature, top_p: float32; u: float64");
  TORCH_CHECK(temperature.numel() == n && top_k.numel() == n && top_p.numel() == n && u.numel() == n,
              "one temperature, top_k, top_p and u per row");
  auto rows_c = rows.contiguous(), t_c = temperature.contiguous(), k_c = top_k.contiguous();
  auto p_c = top_p.contiguous(), u_c = u.contiguous();
  const int64_t* rp = rows_c.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(rp[i] >= 0 && rp[i] < x.size(0), "row index out of range");
  auto out = at::empty({n}, x.options().dtype(at::kLong));
  TM_DISPATCH(x.scalar_type(), "sample_rows", [&] {
    sample_rows_kernel<scalar_t>(x.data_ptr<scalar_t>(), x.stride(0), x.size(1), n, rp, t_c.data_ptr<float>(),
                                 k_c.data_ptr<int64_t>(), p_c.data_ptr<float>(), u_c.data_ptr<double>(),
                                 out.data_ptr<int64_t>());
  });
  return out;
}

// x fp32 [M, K] contiguous; qs uint8 [N, K/32, 16] (Q4_0, Q4_1) or int8 [N, K/32, 32] (Q8_0); scales fp32 [N, K/32];
// mins fp32 [N, K/32] for Q4 or empty for Q8_0; type_code: ggml's type id (2 Q4_0, 3 Q4_1, 8 Q8_0). Returns y = x W^T
// fp32 [M, N] (see gguf_linear_kernel). portable: the scalar / vector-extension form even where AVX2 is there.
at::Tensor gguf_linear_impl(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scales,
                            const at::Tensor& mins, int64_t type_code, bool portable) {
  TORCH_CHECK(type_code == kGgufQ4_0 || type_code == kGgufQ4_1 || type_code == kGgufQ8_0,
              "type_code must be a ggml type id the kernel reads: 2 (Q4_0), 3 (Q4_1) or 8 (Q8_0)");
  const bool q8 = type_code == kGgufQ8_0;
  TORCH_CHECK(qs.dim() == 3 && qs.is_contiguous() && qs.scalar_type() == (q8 ? at::kChar : at::kByte) &&
                  qs.size(2) == (q8 ? 32 : 16),
              "qs must be contiguous uint8 [N, K/32, 16] for Q4_0/Q4_1, int8 [N, K/32, 32] for Q8_0");
  const int64_t N = qs.size(0), nb = qs.size(1), K = nb * 32;
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat && x.size(1) == K,
              "x must be contiguous fp32 [M, K] with K = 32 * qs.size(1)");
  TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == at::kFloat && scales.dim() == 2 &&
                  scales.size(0) == N && scales.size(1) == nb, "scales must be contiguous fp32 [N, K/32]");
  if (q8) {
    TORCH_CHECK(mins.numel() == 0, "Q8_0 takes no mins: pass an empty tensor");
  } else {
    TORCH_CHECK(mins.is_contiguous() && mins.scalar_type() == at::kFloat && mins.sizes() == scales.sizes(),
                "Q4_0/Q4_1 mins must be contiguous fp32 [N, K/32]");
  }
  auto y = at::empty({x.size(0), N}, x.options());
  if (x.size(0) == 0 || N == 0) return y;
  const float* xp = x.data_ptr<float>();
  const uint8_t* qp = static_cast<const uint8_t*>(qs.data_ptr());
  const float* sp = scales.data_ptr<float>();
  const float* mp = q8 ? nullptr : mins.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t M = x.size(0);
  auto run = [&](auto type) {
    constexpr int T = decltype(type)::value;
    if (portable) gguf_linear_kernel<T, true>(xp, M, K, qp, sp, mp, N, yp);
    else gguf_linear_kernel<T, false>(xp, M, K, qp, sp, mp, N, yp);
  };
  if (type_code == kGgufQ8_0) run(std::integral_constant<int, kGgufQ8_0>{});
  else if (type_code == kGgufQ4_1) run(std::integral_constant<int, kGgufQ4_1>{});
  else run(std::integral_constant<int, kGgufQ4_0>{});
  return y;
}

at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scales, const at::Tensor& mins,
                       int64_t type_code) {
  return gguf_linear_impl(x, qs, scales, mins, type_code, false);
}

at::Tensor gguf_linear_portable(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scales,
                                const at::Tensor& mins, int64_t type_code) {
  return gguf_linear_impl(x, qs, scales, mins, type_code, true);
}

// encoder_kernels.cpp
at::Tensor encoder_attention(const at::Tensor& qkv, const at::Tensor& cu_seqlens, double scale);
bool encoder_attention_available();
at::Tensor bias_gelu_(at::Tensor& y, const at::Tensor& bias);
at::Tensor bias_residual_layer_norm_(at::Tensor& y, const at::Tensor& bias, const at::Tensor& residual,
                                     const at::Tensor& gamma, const at::Tensor& beta, double eps);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "Causal paged attention of a step's query rows (CPU)", py::arg("q"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("seq_lens"),
        py::arg("query_start_loc"), py::arg("scale"), py::arg("window"), py::arg("softcap") = 0.0,
        py::arg("sinks") = py::none());
  m.def("rms_norm", &rms_norm, "RMSNorm of each row");
  m.def("add_rms_norm", &add_rms_norm, "(RMSNorm(residual + x), residual + x)");
  m.def("rope_write_kv", &rope_write_kv, "RoPE of Q and K from a fused QKV, K/V written to the paged cache");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up of a fused gate_up");
  m.def("quantize_rows_u8", &quantize_rows_u8, "per-row symmetric INT8 (+128 as uint8) with fp32 scales");
  m.def("argmax_rows", &argmax_rows, "torch.argmax(x, dim=-1) of [S, V] rows");
  m.def("sample_rows", &sample_rows, "inverse-CDF sampling of [S, V] rows with temperature, top_k, top_p");
  m.def("gguf_linear", &gguf_linear, "y = x W^T, fp32, W read from its GGUF Q4_0/Q4_1/Q8_0 blocks");
  m.def("gguf_linear_portable", &gguf_linear_portable, "gguf_linear's portable form (tests it on AVX2 machines)");
  m.def("encoder_attention", &encoder_attention, "softmax(q k^T * scale) v within each row of a packed batch, fp32",
        py::arg("qkv"), py::arg("cu_seqlens"), py::arg("scale"));
  m.def("bias_gelu_", &bias_gelu_, "y = gelu(y + bias) in place, exact (erf) GELU, fp32");
  m.def("bias_residual_layer_norm_", &bias_residual_layer_norm_,
        "y = LayerNorm(y + bias + residual) * gamma + beta in place, fp32");
  m.def("encoder_attention_available", &encoder_attention_available, "whether encoder_attention is built here");
}
