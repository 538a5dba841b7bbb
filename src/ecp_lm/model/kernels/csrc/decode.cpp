// The kernels of a decode step on CPU, where each token reads every weight and every cached key
// and value once and does little arithmetic with them: both are streams, and their speed is how
// fast memory is read.
//
// linear_rows: y = x W^T (+ b) for a few rows x (M, K), one per batch row, and W (N, K) as
// nn.Linear stores it. Each group of four rows of W is read once (its 4 K floats stay in L1) and
// dotted with every row of x, the dot products in vector registers over K. Groups are split
// across torch's threads in chunks of at least kMinChunkBytes of W, so a small weight stays on
// one thread.
//
// query_attention: one query row per (batch, head) against S cached keys and values, where
// allowed (B, 1 or H, S) says which slots it may see: scores q.k / sqrt(D), an exact softmax over the
// allowed ones (max, then exp and sum), then the weighted sum of the values; one pass over the
// keys and one over the values.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

namespace {

constexpr int64_t kGroup = 4;                  // rows of W per group
constexpr int64_t kMinChunkBytes = 256 << 10;  // of W per thread's chunk

// Rows n0 .. n0 + rows of y for every row of x; rows <= kGroup.
template <int64_t Rows>
inline void dot_group(const float* x, const float* w, const float* b, float* y, int64_t m_rows,
                      int64_t k_len, int64_t n_len, int64_t n0) {
  const float* wr[Rows];
  for (int64_t r = 0; r < Rows; ++r) wr[r] = w + (n0 + r) * k_len;
  for (int64_t m = 0; m < m_rows; ++m) {
    const float* xr = x + m * k_len;
    float acc[Rows] = {};
    if constexpr (Rows == kGroup) {
      float a0 = 0, a1 = 0, a2 = 0, a3 = 0;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
      for (int64_t k = 0; k < k_len; ++k) {
        const float xv = xr[k];
        a0 += wr[0][k] * xv;
        a1 += wr[1][k] * xv;
        a2 += wr[2][k] * xv;
        a3 += wr[3][k] * xv;
      }
      acc[0] = a0, acc[1] = a1, acc[2] = a2, acc[3] = a3;
    } else {
      for (int64_t r = 0; r < Rows; ++r) {
        float a = 0;
#pragma omp simd reduction(+ : a)
        for (int64_t k = 0; k < k_len; ++k) a += wr[r][k] * xr[k];
        acc[r] = a;
      }
    }
    float* yr = y + m * n_len + n0;
    for (int64_t r = 0; r < Rows; ++r) yr[r] = b ? acc[r] + b[n0 + r] : acc[r];
  }
}

at::Tensor linear_rows(const at::Tensor& x, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat,
              "linear_rows takes float32");
  TORCH_CHECK(weight.dim() == 2 && x.size(-1) == weight.size(1), "linear_rows: x (..., ",
              weight.size(1), ") for a weight of ", weight.sizes());
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  const int64_t k_len = weight.size(1), n_len = weight.size(0), m_rows = xc.numel() / k_len;
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = n_len;
  at::Tensor y = at::empty(sizes, x.options());
  std::optional<at::Tensor> bc;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == n_len,
                "linear_rows: a float32 bias of ", n_len);
    bc = bias->contiguous();
  }
  const float* xp = xc.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  const float* bp = bc ? bc->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t groups = n_len / kGroup;
  const int64_t grain = std::max<int64_t>(1, kMinChunkBytes / (kGroup * k_len * 4));
  at::parallel_for(0, groups, grain, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      dot_group<kGroup>(xp, wp, bp, yp, m_rows, k_len, n_len, g * kGroup);
  });
  for (int64_t n0 = groups * kGroup; n0 < n_len; ++n0)
    dot_group<1>(xp, wp, bp, yp, m_rows, k_len, n_len, n0);
  return y;
}

at::Tensor query_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const at::Tensor& allowed) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat &&
                  v.scalar_type() == at::kFloat && allowed.scalar_type() == at::kBool,
              "query_attention takes float32 q, k, v and a bool mask");
  TORCH_CHECK(q.dim() == 4 && q.size(2) == 1 && k.dim() == 4 && k.sizes() == v.sizes() &&
                  k.size(0) == q.size(0) && k.size(1) == q.size(1) && k.size(3) == q.size(3) &&
                  allowed.dim() == 3 && allowed.size(0) == k.size(0) &&
                  (allowed.size(1) == 1 || allowed.size(1) == k.size(1)) &&
                  allowed.size(2) == k.size(2) && k.stride(3) == 1 && v.stride(3) == 1,
              "query_attention: q (B, H, 1, D), k and v (B, H, S, D) with unit stride over D, "
              "allowed (B, 1 or H, S); got ", q.sizes(), ", ", k.sizes(), ", ", v.sizes(), ", ",
              allowed.sizes());
  const at::Tensor qc = q.contiguous(), ac = allowed.contiguous();
  const int64_t batch = k.size(0), heads = k.size(1), slots = k.size(2), d = k.size(3);
  const int64_t mask_heads = ac.size(1);
  at::Tensor out = at::empty_like(qc);
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const float* qp = qc.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const bool* ap = ac.data_ptr<bool>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, batch * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> p(slots);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / heads, h = i % heads;
      const float* qi = qp + i * d;
      const float* ki = kp + b * k.stride(0) + h * k.stride(1);
      const float* vi = vp + b * v.stride(0) + h * v.stride(1);
      const bool* ai = ap + (b * mask_heads + (mask_heads == 1 ? 0 : h)) * slots;
      float top = -INFINITY;
      for (int64_t s = 0; s < slots; ++s) {
        if (!ai[s]) continue;
        const float* ks = ki + s * k.stride(2);
        float dot = 0;
#pragma omp simd reduction(+ : dot)
        for (int64_t c = 0; c < d; ++c) dot += qi[c] * ks[c];
        p[s] = dot * scale;
        top = std::max(top, p[s]);
      }
      float* oi = op + i * d;
      std::fill(oi, oi + d, 0.0f);
      if (top == -INFINITY) continue;  // no slot allowed: zeros
      float total = 0;
      for (int64_t s = 0; s < slots; ++s) {
        if (!ai[s]) continue;
        const float w = std::exp(p[s] - top);
        total += w;
        const float* vs = vi + s * v.stride(2);
#pragma omp simd
        for (int64_t c = 0; c < d; ++c) oi[c] += w * vs[c];
      }
      const float inv = 1.0f / total;
#pragma omp simd
      for (int64_t c = 0; c < d; ++c) oi[c] *= inv;
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ecp_lm_native, lib) {
  lib.def("linear_rows(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  lib.def("query_attention(Tensor q, Tensor k, Tensor v, Tensor allowed) -> Tensor");
}

TORCH_LIBRARY_IMPL(ecp_lm_native, CPU, lib) {
  lib.impl("linear_rows", &linear_rows);
  lib.impl("query_attention", &query_attention);
}
