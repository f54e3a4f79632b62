// The fp32 encoder's kernels on AVX2 + FMA CPUs (BERT-family embedding models: engine/model/bert.py), bound in
// cpu_kernels.cpp (one extension module); when they run: engine.kernels.cpu_kernels.encoder_fp32_ops.
//
// encoder_attention: bidirectional attention over a packed batch of rows, no KV cache: every token of a row attends
// to every token of its own row, none of another's (contract: engine/layers/encoder_attention.py). Why our own:
// torch's CPU scaled_dot_product_attention (its flash kernel) runs the small heads of embedding models (head_dim 32:
// all-MiniLM, bge-small) at a fraction of the GEMMs' rate, and wants the rows padded into [B, H, L, D] (a scatter in,
// a gather out). Here the rows stay packed: each (row, head) pair is one work item that reads its q, k and v straight
// from the fused QKV projection [T, 3, H, D], and writes its output rows in place in [T, H * D]. Per item (n tokens):
// K is packed once, transposed in blocks of 16 keys ([n / 16][D][16]), and V contiguous ([n][D]); then query rows in
// blocks of 48: their scores q k^T * scale against all n keys (6 x 16 register tiles of FMAs over D), the softmax of
// each row with its maximum subtracted first (Milakov & Gimelshein, "Online normalizer calculation for softmax", 2018:
// the two-pass form), exp by tm_avx2::exp8 (Cephes expf, relative error ~1e-7), and the weighted sums of the values
// 64 value rows at a time (they stay in L1 while the block's rows use them; 3 x 32 register tiles), divided by each
// row's sum at the end. Everything in fp32: the math of softmax(q k^T / sqrt(D)) v (Vaswani et al., "Attention Is
// All You Need", 2017), summed in another order than torch's (differences of a few ulp).
//
// bias_gelu_ and bias_residual_layer_norm_: what follows the linears MKL's sgemm computes without their bias (it has
// no epilogue), each in one pass over the rows instead of torch's two or three: bias + exact GELU (the MLP's up
// projection), bias + residual + LayerNorm (post-LN BERT's two block outputs).

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "simd_avx2.h"

namespace {

#if defined(__AVX2__) && defined(__FMA__)
constexpr int kQueryTile = 6;   // query rows per score tile: 6 x 2 accumulators + 2 key loads + 1 broadcast
constexpr int kKeyBlock = 16;   // keys per score tile (two 8-lane vectors)
constexpr int kRowBlock = 48;   // query rows whose scores are held at once (a multiple of kQueryTile and of 3)
constexpr int64_t kKeyChunk = 64;  // value rows the weighted sums take at a time (8 KB at head_dim 32)

// Scores of query rows q[0..R) (each D floats) against every key block of kt ([nb][D][16]), times
// scale, into s[r * np + j] (np = nb * 16).
template <int R>
inline void score_tile(const float* const* q, const float* kt, int64_t nb, int64_t D, float scale, float* s,
                       int64_t np) {
  const __m256 sc = _mm256_set1_ps(scale);
  for (int64_t b = 0; b < nb; ++b) {
    const float* kb = kt + b * D * kKeyBlock;
    __m256 acc[R][2];
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; ++d) {
      const __m256 k0 = _mm256_loadu_ps(kb + d * kKeyBlock), k1 = _mm256_loadu_ps(kb + d * kKeyBlock + 8);
#pragma GCC unroll 6
      for (int r = 0; r < R; ++r) {
        const __m256 qd = _mm256_broadcast_ss(q[r] + d);
        acc[r][0] = _mm256_fmadd_ps(qd, k0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(qd, k1, acc[r][1]);
      }
    }
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_ps(s + r * np + b * kKeyBlock, _mm256_mul_ps(acc[r][0], sc));
      _mm256_storeu_ps(s + r * np + b * kKeyBlock + 8, _mm256_mul_ps(acc[r][1], sc));
    }
  }
}

// acc rows a[0..R), columns [0, 32) (each row of stride D floats) += sum_j p[r * np + j] * v[j * vs + c] over j < n
// (v: n rows of stride vs floats). 3 rows x 4 vectors: 12 accumulators, the values read from memory by the FMAs.
template <int R>
inline void weighted_values_tile(const float* p, int64_t np, const float* v, int64_t vs, int64_t n, float* a,
                                 int64_t as) {
  __m256 acc[R][4];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm256_loadu_ps(a + r * as + c * 8);
  for (int64_t j = 0; j < n; ++j) {
    const float* vj = v + j * vs;
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m256 pj = _mm256_broadcast_ss(p + r * np + j);
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + c * 8), acc[r][c]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) _mm256_storeu_ps(a + r * as + c * 8, acc[r][c]);
}

// One (row, head) item: n tokens from token `start`; qkv rows of stride ts floats (3 * H * D), head offset ho.
template <int DC>
void attend_item(const float* qkv, int64_t ts, int64_t hd, int64_t ho, int64_t start, int64_t n, float scale,
                 float* out, int64_t os, std::vector<float>& buf) {
  constexpr int64_t D = DC * 8;
  const int64_t nb = (n + kKeyBlock - 1) / kKeyBlock, np = nb * kKeyBlock;
  buf.resize(static_cast<size_t>(np * D * 2 + kRowBlock * (np + D)));
  float* kt = buf.data();
  float* v = kt + np * D;
  float* s = v + np * D;
  const float* base = qkv + start * ts + ho;
  for (int64_t j = 0; j < np; ++j) {
    float* dst = kt + (j / kKeyBlock) * D * kKeyBlock + j % kKeyBlock;
    if (j < n) {
      const float* k = base + j * ts + hd;
      for (int64_t d = 0; d < D; ++d) dst[d * kKeyBlock] = k[d];
      std::copy(base + j * ts + 2 * hd, base + j * ts + 2 * hd + D, v + j * D);
    } else {
      for (int64_t d = 0; d < D; ++d) dst[d * kKeyBlock] = 0.f;
    }
  }
  // Query rows in blocks of kRowBlock: their scores (kRowBlock x np), softmax, then the weighted values key chunk by
  // key chunk (kKeyChunk rows of V, L1-resident while every row of the block uses them).
  float* acc = s + kRowBlock * np;  // [kRowBlock][D] running sums
  const float* q[kQueryTile];
  float inv[kRowBlock];
  for (int64_t i0 = 0; i0 < n; i0 += kRowBlock) {
    const int rows = static_cast<int>(std::min<int64_t>(kRowBlock, n - i0));
    for (int t = 0; t < rows; t += kQueryTile) {
      for (int r = 0; r < kQueryTile; ++r) q[r] = base + (i0 + std::min(t + r, rows - 1)) * ts;  // a short tile
      score_tile<kQueryTile>(q, kt, nb, D, scale, s + t * np, np);  // repeats its last row (computed, not used)
    }
    for (int r = 0; r < rows; ++r) {
      std::fill(s + r * np + n, s + (r + 1) * np, -std::numeric_limits<float>::infinity());
      inv[r] = 1.f / tm_avx2::exp_scores16(s + r * np, np);  // np: a multiple of 16
    }
    std::fill(acc, acc + rows * D, 0.f);
    for (int64_t j0 = 0; j0 < n; j0 += kKeyChunk) {
      const int64_t jn = std::min<int64_t>(kKeyChunk, n - j0);
      for (int64_t col = 0; col < D; col += 32) {  // 32 columns at a time: 3 rows (then 1) x 4 vectors in registers
        int r = 0;
        for (; r + 3 <= rows; r += 3)
          weighted_values_tile<3>(s + r * np + j0, np, v + j0 * D + col, D, jn, acc + r * D + col, D);
        for (; r < rows; ++r)
          weighted_values_tile<1>(s + r * np + j0, np, v + j0 * D + col, D, jn, acc + r * D + col, D);
      }
    }
    for (int r = 0; r < rows; ++r) {
      float* o = out + (start + i0 + r) * os + ho;
      const __m256 iv = _mm256_set1_ps(inv[r]);
      for (int64_t c = 0; c < D; c += 8) _mm256_storeu_ps(o + c, _mm256_mul_ps(_mm256_loadu_ps(acc + r * D + c), iv));
    }
  }
}

// erf of 8 lanes: x clamped to [-4, 4] (erf is +-1 in fp32 beyond), then the odd / even rational minimax
// approximation x P(x^2) / Q(x^2), P of degree 6 and Q of degree 4 in x^2 (the coefficients of Eigen's
// generic_fast_erf_float, as XLA and TensorFlow use them): |error| <= 4.5e-7 against erf in fp64 over the whole line
// (tests/engine/kernels/test_encoder_elementwise.py), no exp, one division.
inline __m256 erf8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-4.f)), _mm256_set1_ps(4.f));
  const __m256 x2 = _mm256_mul_ps(x, x);
  __m256 p = _mm256_fmadd_ps(x2, _mm256_set1_ps(-2.72614225801306e-10f), _mm256_set1_ps(2.77068142495902e-08f));
  p = _mm256_fmadd_ps(x2, p, _mm256_set1_ps(-2.10102402082508e-06f));
  p = _mm256_fmadd_ps(x2, p, _mm256_set1_ps(-5.69250639462346e-05f));
  p = _mm256_fmadd_ps(x2, p, _mm256_set1_ps(-7.34990630326855e-04f));
  p = _mm256_fmadd_ps(x2, p, _mm256_set1_ps(-2.95459980854025e-03f));
  p = _mm256_fmadd_ps(x2, p, _mm256_set1_ps(-1.60960333262415e-02f));
  __m256 q = _mm256_fmadd_ps(x2, _mm256_set1_ps(-1.45660718464996e-05f), _mm256_set1_ps(-2.13374055278905e-04f));
  q = _mm256_fmadd_ps(x2, q, _mm256_set1_ps(-1.68282697438203e-03f));
  q = _mm256_fmadd_ps(x2, q, _mm256_set1_ps(-7.37332916720468e-03f));
  q = _mm256_fmadd_ps(x2, q, _mm256_set1_ps(-1.42647390514189e-02f));
  return _mm256_div_ps(_mm256_mul_ps(x, p), q);
}

// y = gelu(y + bias) over one row of n floats (n a multiple of 8), exact (erf) GELU: 0.5 x (1 + erf(x / sqrt(2))).
inline void bias_gelu_row(float* y, const float* bias, int64_t n) {
  const __m256 half = _mm256_set1_ps(0.5f), rsqrt2 = _mm256_set1_ps(0.70710678118654752f);
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 x = _mm256_add_ps(_mm256_loadu_ps(y + i), _mm256_loadu_ps(bias + i));
    const __m256 hx = _mm256_mul_ps(half, x);
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(hx, erf8(_mm256_mul_ps(x, rsqrt2)), hx));
  }
}

// y = LayerNorm(y + bias + residual) * gamma + beta over one row of n floats (n a multiple of 8): the mean, then the
// variance of the centered values (two passes over the row, which stays in L1), biased as torch's layer_norm.
inline void bias_residual_layer_norm_row(float* y, const float* bias, const float* residual, const float* gamma,
                                         const float* beta, int64_t n, float eps) {
  __m256 sum = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 x = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(y + i), _mm256_loadu_ps(bias + i)),
                                   _mm256_loadu_ps(residual + i));
    _mm256_storeu_ps(y + i, x);
    sum = _mm256_add_ps(sum, x);
  }
  const __m256 mean = _mm256_set1_ps(tm_avx2::hsum8(sum) / static_cast<float>(n));
  __m256 sq = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 d = _mm256_sub_ps(_mm256_loadu_ps(y + i), mean);
    sq = _mm256_fmadd_ps(d, d, sq);
  }
  const __m256 rstd = _mm256_set1_ps(1.f / std::sqrt(tm_avx2::hsum8(sq) / static_cast<float>(n) + eps));
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 d = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(y + i), mean), rstd);
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(d, _mm256_loadu_ps(gamma + i), _mm256_loadu_ps(beta + i)));
  }
}
#endif

}  // namespace

// qkv fp32 [T, 3, H, D] contiguous (q, k, v of each token), cu_seqlens int64 [B + 1] on the host (row b owns tokens
// cu_seqlens[b]:cu_seqlens[b + 1], each row >= 1 token, cu_seqlens[B] = T), scale the scores' factor (1 / sqrt(D)).
// Returns fp32 [T, H * D]: softmax(q k^T * scale) v of each row and head. D must be 32 or 64; AVX2 + FMA builds only
// (encoder_attention_available says which).
at::Tensor encoder_attention(const at::Tensor& qkv, const at::Tensor& cu_seqlens, double scale) {
  TORCH_CHECK(qkv.dim() == 4 && qkv.size(1) == 3 && qkv.is_contiguous() && qkv.scalar_type() == at::kFloat,
              "qkv must be contiguous fp32 [T, 3, H, D]");
  TORCH_CHECK(cu_seqlens.dim() == 1 && cu_seqlens.numel() >= 2 && cu_seqlens.scalar_type() == at::kLong &&
                  cu_seqlens.is_contiguous() && cu_seqlens.device().is_cpu(),
              "cu_seqlens must be contiguous int64 [B + 1] on the host");
  const int64_t T = qkv.size(0), H = qkv.size(2), D = qkv.size(3), B = cu_seqlens.numel() - 1;
  const int64_t* cu = cu_seqlens.data_ptr<int64_t>();
  TORCH_CHECK(cu[0] == 0 && cu[B] == T, "cu_seqlens must start at 0 and end at T = qkv.size(0)");
  for (int64_t b = 0; b < B; ++b) TORCH_CHECK(cu[b + 1] > cu[b], "every row needs >= 1 token");
  auto out = at::empty({T, H * D}, qkv.options());
#if defined(__AVX2__) && defined(__FMA__)
  TORCH_CHECK(D == 32 || D == 64, "encoder_attention takes head_dim 32 or 64, got ", D);
  const float* in = qkv.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item % B, h = item / B;  // head-major: each thread's range holds every row (rows sorted by
      // length would otherwise give one thread the longest)
      if (D == 32) attend_item<4>(in, 3 * H * D, H * D, h * D, cu[b], cu[b + 1] - cu[b], sc, o, H * D, buf);
      else attend_item<8>(in, 3 * H * D, H * D, h * D, cu[b], cu[b + 1] - cu[b], sc, o, H * D, buf);
    }
  });
#else
  TORCH_CHECK(false, "encoder_attention needs a build for AVX2 + FMA");
#endif
  return out;
}

// Whether this build has encoder_attention (an AVX2 + FMA target).
bool encoder_attention_available() {
#if defined(__AVX2__) && defined(__FMA__)
  return true;
#else
  return false;
#endif
}

namespace {
// The checks the elementwise kernels share: y fp32 [T, N] contiguous, N a multiple of 8, and each of `vectors` fp32 [N]
// contiguous.
void check_rows(const at::Tensor& y, std::initializer_list<const at::Tensor*> vectors, const char* name) {
  TORCH_CHECK(y.dim() == 2 && y.is_contiguous() && y.scalar_type() == at::kFloat && y.size(1) % 8 == 0, name,
              ": y must be contiguous fp32 [T, N], N a multiple of 8");
  for (const at::Tensor* v : vectors)
    TORCH_CHECK(v->dim() == 1 && v->is_contiguous() && v->scalar_type() == at::kFloat && v->size(0) == y.size(1), name,
                ": bias, gamma and beta must be contiguous fp32 [N]");
#if !(defined(__AVX2__) && defined(__FMA__))
  TORCH_CHECK(false, name, " needs a build for AVX2 + FMA");
#endif
}
}  // namespace

// y = gelu(y + bias) in place (exact, erf GELU), y fp32 [T, N] contiguous, bias fp32 [N]; N a multiple of 8. Returns y.
at::Tensor bias_gelu_(at::Tensor& y, const at::Tensor& bias) {
  check_rows(y, {&bias}, "bias_gelu_");
#if defined(__AVX2__) && defined(__FMA__)
  float* yp = y.data_ptr<float>();
  const float* bp = bias.data_ptr<float>();
  const int64_t n = y.size(1);
  at::parallel_for(0, y.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) bias_gelu_row(yp + r * n, bp, n);
  });
#endif
  return y;
}

// y = LayerNorm(y + bias + residual) * gamma + beta in place (post-LN BERT's BertSelfOutput / BertOutput), y and
// residual fp32 [T, N] contiguous, bias, gamma, beta fp32 [N]; N a multiple of 8. Returns y.
at::Tensor bias_residual_layer_norm_(at::Tensor& y, const at::Tensor& bias, const at::Tensor& residual,
                                     const at::Tensor& gamma, const at::Tensor& beta, double eps) {
  check_rows(y, {&bias, &gamma, &beta}, "bias_residual_layer_norm_");
  TORCH_CHECK(residual.sizes() == y.sizes() && residual.is_contiguous() && residual.scalar_type() == at::kFloat,
              "bias_residual_layer_norm_: residual must be contiguous fp32 of y's shape");
#if defined(__AVX2__) && defined(__FMA__)
  float* yp = y.data_ptr<float>();
  const float *bp = bias.data_ptr<float>(), *rp = residual.data_ptr<float>();
  const float *gp = gamma.data_ptr<float>(), *betap = beta.data_ptr<float>();
  const int64_t n = y.size(1);
  const float e = static_cast<float>(eps);
  at::parallel_for(0, y.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) bias_residual_layer_norm_row(yp + r * n, bp, rp + r * n, gp, betap, n, e);
  });
#endif
  return y;
}
