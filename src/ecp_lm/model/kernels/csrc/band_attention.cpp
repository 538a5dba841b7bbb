// Exact band attention on CPU. A band rule (period, shift, back) gives every query row t (its
// position within the call, 0-based) the keys lo(t) .. t, with
//
//     lo(t) = max(0, floor((t + shift) / period) * period - shift - back),
//
// which never decreases with t. Instances: ECP with segment m is (m, 0, m) (a query sees the
// whole previous segment and its own causally); a sliding window of w keys is (1, 0, w - 1);
// block-local attention in blocks of b is (b, 0, 0); LongLoRA's shifted groups of G are
// (G, G / 2, 0), the first group being G / 2 long.
//
// Work is split into query blocks of `block` rows starting at multiples of `block`. A block
// [q0, q0 + rows) attends to the keys lo(q0) .. q0 + rows - 1 in one buffer; row i keeps the
// entries lo(q0 + i) - lo(q0) .. q0 + i - lo(q0) and zeroes the rest, so only triangles at the
// sides of each block are computed and thrown away: about (1.5 + block / (2m)) * m^2 score
// entries per ECP segment, w - 1 + block per query for a sliding window. All keys of a block fit
// one buffer, so the softmax is exact in one pass, without the running rescaling of a flash
// kernel.
//
// Dropout (training): each probability is kept with probability 1 - p and scaled by 1 / (1 - p),
// or zeroed. Whether entry (row, col) of batch-head b is kept is a counter-based hash of the
// call's seed and the entry's coordinates (the splitmix64 sequence at index (b T + row) T + col),
// so the backward pass regenerates the forward's mask instead of storing it, and the mask does
// not depend on how the work is split into blocks or threads. p is applied in steps of 2^-32.
//
// Layout: q, k, v, out (BH, T, D) contiguous, any T; lse (BH, T), all of one dtype.
// The backward pass cuts the rows into chunks of C rows (whole blocks) and runs the even chunks,
// then the odd ones. A chunk [x, x + C) writes the key gradients of rows lo(x) .. x + C - 1
// only; C is the smallest multiple of `block` with lo(x + 2C) >= x + C for every chunk start x,
// so chunks of one parity never write the same rows and need no locks or private copies (for
// ECP with block | m, C = m; for a sliding window, C >= w - 1).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <climits>
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

// Dropout of one call: entries whose hash falls below `threshold` (p * 2^32) are zeroed, the
// others scaled by `scale` = 1 / (1 - threshold / 2^32). threshold 0: no dropout.
struct Dropout {
  uint64_t seed = 0;
  uint64_t threshold = 0;
  double scale = 1.0;
  bool on() const { return threshold > 0; }
  bool kept(int64_t b, int64_t n, int64_t row, int64_t col) const {
    return kept(static_cast<uint64_t>(b * n + row) * static_cast<uint64_t>(n) +
                static_cast<uint64_t>(col));
  }
  bool kept(uint64_t index) const {  // the splitmix64 sequence's output number `index`
    uint64_t x = seed + index * 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    x ^= x >> 31;
    return (x >> 32) >= threshold;
  }
};

Dropout make_dropout(double p, int64_t seed) {
  TORCH_CHECK(p >= 0.0 && p < 1.0, "dropout_p must be in [0, 1), got ", p);
  Dropout drop;
  drop.seed = static_cast<uint64_t>(seed);
  drop.threshold = static_cast<uint64_t>(std::llround(p * 4294967296.0));
  drop.scale = 4294967296.0 / (4294967296.0 - static_cast<double>(drop.threshold));
  return drop;
}

// Which keys each query row sees: lo(t) .. t.
struct Rule {
  int64_t period, shift, back;
  int64_t lo(int64_t t) const {
    return std::max<int64_t>(0, (t + shift) / period * period - shift - back);
  }
};

// The rows of one query block and the keys they see.
struct Tile {
  int64_t q0;  // first query row (within one batch-head)
  int rows;    // query rows in the block
  int64_t k0;  // first key row: lo(q0)
  int keys;    // k0 .. q0 + rows - 1
  // Row i keeps the entries first(i) .. last(i) of its buffer row (inclusive).
  int first(const Rule& rule, int i) const { return static_cast<int>(rule.lo(q0 + i) - k0); }
  int last(int i) const { return static_cast<int>(q0 + i - k0); }
};

Tile tile(const Rule& rule, int64_t index, int64_t n, int64_t block) {
  Tile t;
  t.q0 = index * block;
  t.rows = static_cast<int>(std::min(block, n - t.q0));
  t.k0 = rule.lo(t.q0);
  t.keys = static_cast<int>(t.q0 + t.rows - t.k0);
  return t;
}

// The largest rows x keys buffer any tile needs.
int64_t buffer_size(const Rule& rule, int64_t n, int64_t block) {
  int64_t size = 1;
  for (int64_t j = 0; j * block < n; ++j) {
    const Tile t = tile(rule, j, n, block);
    size = std::max<int64_t>(size, static_cast<int64_t>(t.rows) * t.keys);
  }
  return size;
}

// The backward chunk length: the smallest multiple of block such that chunks of one parity
// write disjoint key-gradient rows. Chunk [x, x + C) writes rows lo(x) .. x + C - 1 and lo never
// decreases, so lo(x + 2C) >= x + C for every chunk start x suffices. C with 2C >= n always
// passes (no two chunks share a parity), so the search ends.
int64_t chunk_length(const Rule& rule, int64_t n, int64_t block) {
  for (int64_t c = block;; c += block) {
    bool disjoint = true;
    for (int64_t x = 0; x + 2 * c < n && disjoint; x += c) disjoint = rule.lo(x + 2 * c) >= x + c;
    if (disjoint) return c;
  }
}

void check(const at::Tensor& x, const at::Tensor& like, const char* name) {
  TORCH_CHECK(x.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(x.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(x.scalar_type() == like.scalar_type(), name, " has dtype ", x.scalar_type(),
              ", expected ", like.scalar_type());
}

// Checks the inputs; returns the rule and the block size to use (at most T, at least 1).
std::pair<Rule, int64_t> check_inputs(const at::Tensor& q, const at::Tensor& k,
                                      const at::Tensor& v, int64_t period, int64_t shift,
                                      int64_t back, int64_t block) {
  TORCH_CHECK(q.dim() == 3, "q must be (BH, T, D), got ", q.sizes());
  TORCH_CHECK(k.sizes() == q.sizes() && v.sizes() == q.sizes(), "q, k, v shapes differ: ",
              q.sizes(), " ", k.sizes(), " ", v.sizes());
  TORCH_CHECK(q.size(2) > 0, "head dimension D must be positive, got ", q.sizes());
  TORCH_CHECK(q.size(1) < INT_MAX && q.size(2) < INT_MAX, "T and D must be below 2^31, got ",
              q.sizes());
  TORCH_CHECK(period >= 1, "band rule: period must be >= 1, got ", period);
  TORCH_CHECK(shift >= 0 && shift < period, "band rule: shift must be in [0, period = ", period,
              "), got ", shift);
  TORCH_CHECK(back >= 0, "band rule: back must be >= 0, got ", back);
  TORCH_CHECK(block > 0, "block must be positive, got ", block);
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kDouble,
              "only float32 and float64 are supported, got ", q.scalar_type());
  check(q, q, "q");
  check(k, q, "k");
  check(v, q, "v");
  return {Rule{period, shift, back}, std::max<int64_t>(1, std::min(block, q.size(1)))};
}

template <typename T>
void forward_kernel(const T* q, const T* k, const T* v, T* out, T* lse, int64_t bh,
                    int64_t n, int64_t d, const Rule& rule, int64_t block, const Dropout& drop) {
  const int64_t tiles = (n + block - 1) / block;
  const size_t size = static_cast<size_t>(buffer_size(rule, n, block));
  const T scale = T(1) / std::sqrt(static_cast<T>(d));
  const int D = static_cast<int>(d);
  at::parallel_for(0, bh * tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> p(size), sums(static_cast<size_t>(block));
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / tiles;
      const Tile t = tile(rule, item % tiles, n, block);
      const T* qb = q + (b * n + t.q0) * d;
      const T* kb = k + (b * n + t.k0) * d;
      const T* vb = v + (b * n + t.k0) * d;
      gemm(false, true, t.rows, t.keys, D, scale, qb, D, kb, D, T(0), p.data(), t.keys);
      for (int i = 0; i < t.rows; ++i) {
        T* row = p.data() + static_cast<int64_t>(i) * t.keys;
        const int lo = t.first(rule, i), hi = t.last(i) + 1, len = hi - lo;
        const T top = row_max(row + lo, len);
        exp_shifted(row + lo, row + lo, len, top);
        sums[i] = row_sum(row + lo, len);
        std::fill(row, row + lo, T(0));
        std::fill(row + hi, row + t.keys, T(0));
        lse[b * n + t.q0 + i] = top + std::log(sums[i]);
        if (drop.on()) {  // normalised by the sum of every entry, kept or not
          const T keep = static_cast<T>(drop.scale);
          for (int c = lo; c < hi; ++c)
            row[c] = drop.kept(b, n, t.q0 + i, t.k0 + c) ? row[c] * keep : T(0);
        }
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
                     const Rule& rule, int64_t block, const Dropout& drop) {
  const int64_t chunk = chunk_length(rule, n, block), chunks = (n + chunk - 1) / chunk;
  const int64_t tiles_per_chunk = chunk / block;
  const size_t size = static_cast<size_t>(buffer_size(rule, n, block));
  const T scale = T(1) / std::sqrt(static_cast<T>(d));
  const int D = static_cast<int>(d);
  for (int64_t parity = 0; parity < 2; ++parity) {
    const int64_t per_head = (chunks - parity + 1) / 2;
    at::parallel_for(0, bh * per_head, 1, [&](int64_t begin, int64_t end) {
      std::vector<T> p(size), ds(size);
      for (int64_t item = begin; item < end; ++item) {
        const int64_t b = item / per_head, ch = 2 * (item % per_head) + parity;
        for (int64_t j = ch * tiles_per_chunk; j < (ch + 1) * tiles_per_chunk && j * block < n;
             ++j) {
          const Tile t = tile(rule, j, n, block);
          const int64_t qrow = b * n + t.q0, krow = b * n + t.k0;
          const T *qb = q + qrow * d, *gb = grad + qrow * d, *ob = out + qrow * d;
          gemm(false, true, t.rows, t.keys, D, scale, qb, D, k + krow * d, D, T(0), p.data(),
               t.keys);
          gemm(false, true, t.rows, t.keys, D, T(1), gb, D, v + krow * d, D, T(0), ds.data(),
               t.keys);
          for (int i = 0; i < t.rows; ++i) {
            T* prow = p.data() + static_cast<int64_t>(i) * t.keys;
            T* srow = ds.data() + static_cast<int64_t>(i) * t.keys;
            const int lo = t.first(rule, i), hi = t.last(i) + 1;
            T delta = 0;  // rowsum(dO * O) = rowsum(dP * P), with or without dropout
            for (int c = 0; c < D; ++c) delta += gb[i * D + c] * ob[i * D + c];
            exp_shifted(prow + lo, prow + lo, hi - lo, lse[qrow + i]);
            if (drop.on()) {  // dP = mask * dO V^T; P V's gradient dV takes the dropped P
              const T keep = static_cast<T>(drop.scale);
              for (int c = lo; c < hi; ++c) {
                const T m = drop.kept(b, n, t.q0 + i, t.k0 + c) ? keep : T(0);
                srow[c] = prow[c] * (srow[c] * m - delta);
                prow[c] *= m;
              }
            } else {
              for (int c = lo; c < hi; ++c) srow[c] = prow[c] * (srow[c] - delta);
            }
            std::fill(prow, prow + lo, T(0));
            std::fill(srow, srow + lo, T(0));
            std::fill(prow + hi, prow + t.keys, T(0));
            std::fill(srow + hi, srow + t.keys, T(0));
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

std::tuple<at::Tensor, at::Tensor> band_attention_forward(const at::Tensor& q,
                                                          const at::Tensor& k,
                                                          const at::Tensor& v, int64_t period,
                                                          int64_t shift, int64_t back,
                                                          int64_t block, double dropout_p,
                                                          int64_t seed) {
  const auto checked = check_inputs(q, k, v, period, shift, back, block);
  const Dropout drop = make_dropout(dropout_p, seed);
  const Rule rule = checked.first;
  const int64_t rows = checked.second;
  const int64_t bh = q.size(0), n = q.size(1), d = q.size(2);
  auto out = at::empty_like(q);
  auto lse = at::empty({bh, n}, q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "band_attention_forward", [&] {
    forward_kernel<scalar_t>(q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(),
                             v.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                             lse.data_ptr<scalar_t>(), bh, n, d, rule, rows, drop);
  });
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> band_attention_backward(
    const at::Tensor& grad, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, int64_t period, int64_t shift, int64_t back,
    int64_t block, double dropout_p, int64_t seed) {
  const auto checked = check_inputs(q, k, v, period, shift, back, block);
  const Dropout drop = make_dropout(dropout_p, seed);
  const Rule rule = checked.first;
  const int64_t rows = checked.second;
  TORCH_CHECK(grad.sizes() == q.sizes() && out.sizes() == q.sizes(),
              "grad and out must be shaped like q ", q.sizes(), ", got ", grad.sizes(), " ",
              out.sizes());
  TORCH_CHECK(lse.dim() == 2 && lse.size(0) == q.size(0) && lse.size(1) == q.size(1),
              "lse must be (BH, T) = (", q.size(0), ", ", q.size(1), "), got ", lse.sizes());
  check(grad, q, "grad");
  check(out, q, "out");
  check(lse, q, "lse");
  const int64_t bh = q.size(0), n = q.size(1), d = q.size(2);
  auto dq = at::empty_like(q);
  auto dk = at::zeros_like(k);
  auto dv = at::zeros_like(v);
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "band_attention_backward", [&] {
    backward_kernel<scalar_t>(grad.data_ptr<scalar_t>(), q.data_ptr<scalar_t>(),
                              k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
                              out.data_ptr<scalar_t>(), lse.data_ptr<scalar_t>(),
                              dq.data_ptr<scalar_t>(), dk.data_ptr<scalar_t>(),
                              dv.data_ptr<scalar_t>(), bh, n, d, rule, rows, drop);
  });
  return {dq, dk, dv};
}

// Dropout of any tensor by the same hash, element i of its contiguous order kept or not:
// x * mask / (1 - p). Its gradient is the same op on the output's gradient, with the same seed.
at::Tensor hash_dropout(const at::Tensor& x, double dropout_p, int64_t seed) {
  TORCH_CHECK(x.device().is_cpu(), "x must be a CPU tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble,
              "only float32 and float64 are supported, got ", x.scalar_type());
  const Dropout drop = make_dropout(dropout_p, seed);
  const auto in = x.contiguous();
  auto out = at::empty_like(in);
  AT_DISPATCH_FLOATING_TYPES(in.scalar_type(), "hash_dropout", [&] {
    const scalar_t* a = in.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    const scalar_t keep = static_cast<scalar_t>(drop.scale);
    at::parallel_for(0, in.numel(), 1 << 14, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i)
        o[i] = drop.kept(static_cast<uint64_t>(i)) ? a[i] * keep : scalar_t(0);
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(ecp_lm_native, lib) {
  lib.def("band_attention_forward(Tensor q, Tensor k, Tensor v, int period, int shift, "
          "int back, int block, float dropout_p=0., int seed=0) -> (Tensor, Tensor)");
  lib.def("band_attention_backward(Tensor grad, Tensor q, Tensor k, Tensor v, Tensor out, "
          "Tensor lse, int period, int shift, int back, int block, float dropout_p=0., "
          "int seed=0) "
          "-> (Tensor, Tensor, Tensor)");
  lib.def("hash_dropout(Tensor x, float dropout_p, int seed) -> Tensor");
}

TORCH_LIBRARY_IMPL(ecp_lm_native, CPU, lib) {
  lib.impl("band_attention_forward", &band_attention_forward);
  lib.impl("band_attention_backward", &band_attention_backward);
  lib.impl("hash_dropout", &hash_dropout);
}
