// 8-lane fp32 helpers (AVX2 + FMA) shared by the CPU kernels: exp8, hmax8, hsum8, exp_scores16. Included by
// cpu_kernels.cpp and encoder_kernels.cpp; defined only where the build targets AVX2 + FMA (-march=native or
// x86-64-v3 and up).
#pragma once

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace tm_avx2 {

// exp of 8 lanes: Cody-Waite range reduction x = n ln2 + r, |r| <= ln2 / 2, and Cephes' degree-6 polynomial for expf
// (Moshier, "Cephes Math Library", expf.c; relative error about 1e-7), scaled by 2^n through the exponent bits, n
// rounded half away from zero. Inputs are clamped to [-87.3, 88.7]: exp(-87.3) ~ 1e-38 stands in for exp(-inf) = 0.
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_set1_ps(-87.3f), x);
  x = _mm256_min_ps(_mm256_set1_ps(88.7f), x);
  const __m256 y = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
  const __m256 half = _mm256_or_ps(_mm256_and_ps(y, _mm256_set1_ps(-0.f)), _mm256_set1_ps(0.5f));
  const __m256i n = _mm256_cvttps_epi32(_mm256_add_ps(y, half));
  const __m256 fn = _mm256_cvtepi32_ps(n);
  __m256 r = _mm256_fnmadd_ps(fn, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(fn, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Softmax numerators in place: sh[t] = exp(sh[t] - max) over `padded` scores (a multiple of 8) whose masked entries
// hold -inf; returns their sum (the denominator). The row maximum is subtracted first (Milakov & Gimelshein, 2018).
// With a sink (gpt-oss's attention sinks; -inf = none) the maximum and the sum take exp(sink) as one more score.
inline float exp_scores16(float* sh, int64_t padded, float sink = -std::numeric_limits<float>::infinity()) {
  __m256 mv = _mm256_loadu_ps(sh);
  for (int64_t t = 8; t < padded; t += 8) mv = _mm256_max_ps(_mm256_loadu_ps(sh + t), mv);
  const float m = std::max(hmax8(mv), sink);
  const __m256 mx = _mm256_set1_ps(m);
  __m256 sum = _mm256_setzero_ps();
  for (int64_t t = 0; t < padded; t += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sh + t), mx));
    _mm256_storeu_ps(sh + t, e);
    sum = _mm256_add_ps(sum, e);
  }
  return sink == -std::numeric_limits<float>::infinity() ? hsum8(sum) : hsum8(sum) + std::exp(sink - m);
}

}  // namespace tm_avx2
#endif
