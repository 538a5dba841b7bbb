// Exact ECP attention on CPU: each segment's queries see the whole previous segment and their
// own segment causally. Work is split into blocks of `block` queries; a query block attends to
// the keys from the start of the previous segment up to its own last row, so only the
// triangle inside the diagonal (block x block) tile is computed and thrown away: about
// (1.5 + block / (2m)) * m^2 score entries per segment, against 2 * m^2 for a static
// (m, 2m) mask. All keys of a query block fit one buffer (at most 2m), so the softmax is exact
// in one pass, without the running rescaling of a flash kernel.
//
// Layout: q, k, v, out (BH, N, D) contiguous, N = S * m; lse (BH, N), all of one dtype.
// The backward pass runs in two phases, even then odd query segments: a query segment s writes
// the key gradients of segments s-1 and s only, so segments of one parity never write the same
// rows and need no locks or private copies.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

extern "C" {
void sgemm_(const char*, const char*, const int*, const int*, const int*, const float*,
            const float*, const int*, const float*, const int*, const float*, float*, const int*);
void dgemm_(const char*, const char*, const int*, const int*, const int*, const double*,
            const double*, const int*, const double*, const int*, const double*, double*,
            const int*);
}

namespace {

// Row-major C (M x N) = alpha * op(A) * op(B) + beta * C, where op(A) is M x K, op(B) is K x N
// and lda, ldb, ldc are row strides. BLAS is column-major, so this computes C^T = op(B)^T op(A)^T.
void gemm(bool ta, bool tb, int M, int N, int K, float alpha, const float* A, int lda,
          const float* B, int ldb, float beta, float* C, int ldc) {
  const char opa = ta ? 'T' : 'N', opb = tb ? 'T' : 'N';
  sgemm_(&opb, &opa, &N, &M, &K, &alpha, B, &ldb, A, &lda, &beta, C, &ldc);
}

void gemm(bool ta, bool tb, int M, int N, int K, double alpha, const double* A, int lda,
          const double* B, int ldb, double beta, double* C, int ldc) {
  const char opa = ta ? 'T' : 'N', opb = tb ? 'T' : 'N';
  dgemm_(&opb, &opa, &N, &M, &K, &alpha, B, &ldb, A, &lda, &beta, C, &ldc);
}

// y[i] = exp(x[i] - shift), written so the compiler vectorises it: Cody-Waite reduction to
// r in [-ln2/2, ln2/2], a degree-7 Taylor polynomial (error < 2e-9), and 2^n put together in
// the exponent bits. Arguments are clamped to [-87, 88], where every result is a normal float.
void exp_shifted(const float* x, float* y, int n, float shift) {
  for (int i = 0; i < n; ++i) {
    float v = x[i] - shift;
    v = v < -87.0f ? -87.0f : (v > 88.0f ? 88.0f : v);
    const float nf = std::nearbyint(v * 1.44269504088896341f);
    float r = std::fma(nf, -0.693359375f, v);
    r = std::fma(nf, 2.12194440e-4f, r);
    float p = 1.0f / 5040.0f;
    p = std::fma(p, r, 1.0f / 720.0f);
    p = std::fma(p, r, 1.0f / 120.0f);
    p = std::fma(p, r, 1.0f / 24.0f);
    p = std::fma(p, r, 1.0f / 6.0f);
    p = std::fma(p, r, 0.5f);
    p = std::fma(p, r, 1.0f);
    p = std::fma(p, r, 1.0f);
    const int32_t bits = (static_cast<int32_t>(nf) + 127) << 23;
    float two_n;
    std::memcpy(&two_n, &bits, sizeof(float));
    y[i] = p * two_n;
  }
}

void exp_shifted(const double* x, double* y, int n, double shift) {
  for (int i = 0; i < n; ++i) y[i] = std::exp(x[i] - shift);
}

// Reductions over independent lanes, so that they vectorise without reassociating floats.
constexpr int kLanes = 16;

template <typename T>
T row_max(const T* x, int n) {
  T acc[kLanes];
  std::fill(acc, acc + kLanes, x[0]);
  int i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] = acc[l] > x[i + l] ? acc[l] : x[i + l];
  for (; i < n; ++i) acc[0] = acc[0] > x[i] ? acc[0] : x[i];
  return *std::max_element(acc, acc + kLanes);
}

template <typename T>
T row_sum(const T* x, int n) {
  T acc[kLanes] = {};
  int i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] += x[i + l];
  for (; i < n; ++i) acc[0] += x[i];
  T sum = 0;
  for (int l = 0; l < kLanes; ++l) sum += acc[l];
  return sum;
}

// The rows of one query block and the keys they see.
struct Tile {
  int64_t q0;  // first query row (within one batch-head)
  int rows;    // query rows in the block
  int64_t k0;  // first key row: start of the previous segment (or 0)
  int keys;    // k0 .. q0 + rows - 1
  // Row i sees the first visible(i) keys; the rest lie above the causal diagonal.
  int visible(int i) const { return keys - rows + i + 1; }
};

Tile tile(int64_t segment, int64_t block_index, int64_t m, int64_t block) {
  Tile t;
  t.q0 = segment * m + block_index * block;
  t.rows = static_cast<int>(std::min(block, m - block_index * block));
  t.k0 = segment > 0 ? (segment - 1) * m : 0;
  t.keys = static_cast<int>(t.q0 + t.rows - t.k0);
  return t;
}

void check(const at::Tensor& x, const at::Tensor& like, const char* name) {
  TORCH_CHECK(x.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(x.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(x.scalar_type() == like.scalar_type(), name, " has dtype ", x.scalar_type(),
              ", expected ", like.scalar_type());
}

// Checks the inputs; returns the block size to use (a block never spans more than a segment).
int64_t check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t m,
                     int64_t block) {
  TORCH_CHECK(q.dim() == 3, "q must be (BH, N, D), got ", q.sizes());
  TORCH_CHECK(k.sizes() == q.sizes() && v.sizes() == q.sizes(), "q, k, v shapes differ: ",
              q.sizes(), " ", k.sizes(), " ", v.sizes());
  TORCH_CHECK(m > 0 && q.size(1) % m == 0, "length ", q.size(1), " is not a multiple of the ",
              "segment length ", m);
  TORCH_CHECK(block > 0, "block must be positive, got ", block);
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kDouble,
              "only float32 and float64 are supported, got ", q.scalar_type());
  check(q, q, "q");
  check(k, q, "k");
  check(v, q, "v");
  return std::min(block, m);
}

template <typename T>
void forward_kernel(const T* q, const T* k, const T* v, T* out, T* lse, int64_t bh,
                    int64_t n, int64_t d, int64_t m, int64_t block) {
  const int64_t segments = n / m, blocks = (m + block - 1) / block;
  const T scale = T(1) / std::sqrt(static_cast<T>(d));
  const int D = static_cast<int>(d);
  at::parallel_for(0, bh * segments * blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> p(static_cast<size_t>(block * 2 * m)), sums(static_cast<size_t>(block));
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / (segments * blocks), rest = item % (segments * blocks);
      const Tile t = tile(rest / blocks, rest % blocks, m, block);
      const T* qb = q + (b * n + t.q0) * d;
      const T* kb = k + (b * n + t.k0) * d;
      const T* vb = v + (b * n + t.k0) * d;
      gemm(false, true, t.rows, t.keys, D, scale, qb, D, kb, D, T(0), p.data(), t.keys);
      for (int i = 0; i < t.rows; ++i) {
        T* row = p.data() + static_cast<int64_t>(i) * t.keys;
        const int len = t.visible(i);
        const T top = row_max(row, len);
        exp_shifted(row, row, len, top);
        sums[i] = row_sum(row, len);
        std::fill(row + len, row + t.keys, T(0));
        lse[b * n + t.q0 + i] = top + std::log(sums[i]);
      }
      T* o = out + (b * n + t.q0) * d;  // unnormalised P V, then each row divided by its sum
      gemm(false, false, t.rows, D, t.keys, T(1), p.data(), t.keys, vb, D, T(0), o, D);
      for (int i = 0; i < t.rows; ++i) {
        const T inv = T(1) / sums[i];
        for (int c = 0; c < D; ++c) o[i * D + c] *= inv;
      }
    }
  });
}

template <typename T>
void backward_kernel(const T* grad, const T* q, const T* k, const T* v, const T* out,
                     const T* lse, T* dq, T* dk, T* dv, int64_t bh, int64_t n, int64_t d,
                     int64_t m, int64_t block) {
  const int64_t segments = n / m, blocks = (m + block - 1) / block;
  const T scale = T(1) / std::sqrt(static_cast<T>(d));
  const int D = static_cast<int>(d);
  for (int64_t parity = 0; parity < 2; ++parity) {
    const int64_t per_head = (segments - parity + 1) / 2;
    at::parallel_for(0, bh * per_head, 1, [&](int64_t begin, int64_t end) {
      std::vector<T> p(static_cast<size_t>(block * 2 * m)), ds(p.size());
      for (int64_t item = begin; item < end; ++item) {
        const int64_t b = item / per_head, segment = 2 * (item % per_head) + parity;
        for (int64_t j = 0; j < blocks; ++j) {
          const Tile t = tile(segment, j, m, block);
          const int64_t qrow = b * n + t.q0, krow = b * n + t.k0;
          const T *qb = q + qrow * d, *gb = grad + qrow * d, *ob = out + qrow * d;
          gemm(false, true, t.rows, t.keys, D, scale, qb, D, k + krow * d, D, T(0), p.data(),
               t.keys);
          gemm(false, true, t.rows, t.keys, D, T(1), gb, D, v + krow * d, D, T(0), ds.data(),
               t.keys);
          for (int i = 0; i < t.rows; ++i) {
            T* prow = p.data() + static_cast<int64_t>(i) * t.keys;
            T* srow = ds.data() + static_cast<int64_t>(i) * t.keys;
            const int len = t.visible(i);
            T delta = 0;  // rowsum(dO * O) = rowsum(dP * P)
            for (int c = 0; c < D; ++c) delta += gb[i * D + c] * ob[i * D + c];
            exp_shifted(prow, prow, len, lse[qrow + i]);
            for (int c = 0; c < len; ++c) srow[c] = prow[c] * (srow[c] - delta);
            std::fill(prow + len, prow + t.keys, T(0));
            std::fill(srow + len, srow + t.keys, T(0));
          }
          gemm(false, false, t.rows, D, t.keys, scale, ds.data(), t.keys, k + krow * d, D, T(0),
               dq + qrow * d, D);
          gemm(true, false, t.keys, D, t.rows, scale, ds.data(), t.keys, qb, D, T(1),
               dk + krow * d, D);
          gemm(true, false, t.keys, D, t.rows, T(1), p.data(), t.keys, gb, D, T(1),
               dv + krow * d, D);
        }
      }
    });
  }
}

std::tuple<at::Tensor, at::Tensor> segment_attention_forward(const at::Tensor& q,
                                                             const at::Tensor& k,
                                                             const at::Tensor& v, int64_t m,
                                                             int64_t block) {
  block = check_inputs(q, k, v, m, block);
  const int64_t bh = q.size(0), n = q.size(1), d = q.size(2);
  auto out = at::empty_like(q);
  auto lse = at::empty({bh, n}, q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "segment_attention_forward", [&] {
    forward_kernel<scalar_t>(q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(),
                             v.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                             lse.data_ptr<scalar_t>(), bh, n, d, m, block);
  });
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> segment_attention_backward(
    const at::Tensor& grad, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, int64_t m, int64_t block) {
  block = check_inputs(q, k, v, m, block);
  check(grad, q, "grad");
  check(out, q, "out");
  check(lse, q, "lse");
  const int64_t bh = q.size(0), n = q.size(1), d = q.size(2);
  auto dq = at::empty_like(q);
  auto dk = at::zeros_like(k);
  auto dv = at::zeros_like(v);
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "segment_attention_backward", [&] {
    backward_kernel<scalar_t>(grad.data_ptr<scalar_t>(), q.data_ptr<scalar_t>(),
                              k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
                              out.data_ptr<scalar_t>(), lse.data_ptr<scalar_t>(),
                              dq.data_ptr<scalar_t>(), dk.data_ptr<scalar_t>(),
                              dv.data_ptr<scalar_t>(), bh, n, d, m, block);
  });
  return {dq, dk, dv};
}

}  // namespace

TORCH_LIBRARY(ecp_lm_native, lib) {
  lib.def("segment_attention_forward(Tensor q, Tensor k, Tensor v, int m, int block) -> "
          "(Tensor, Tensor)");
  lib.def("segment_attention_backward(Tensor grad, Tensor q, Tensor k, Tensor v, Tensor out, "
          "Tensor lse, int m, int block) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(ecp_lm_native, CPU, lib) {
  lib.impl("segment_attention_forward", &segment_attention_forward);
  lib.impl("segment_attention_backward", &segment_attention_backward);
}
