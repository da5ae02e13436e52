// subquad's native tile kernels (optional; built on request by subquad._native, see there).
//
// Each makes one pass over bfloat16 tiles, row by row, a row held in the core's own cache, where
// eager PyTorch makes several passes over the whole tile, each streaming it through the shared
// cache. Forward: the rows' maximum, 2^(x - shift), the row sums and the rounding back to
// bfloat16 (eager: a conversion, amax, a subtraction, exp2, sum and a cast). Backward: P and dS
// from the offset products S - lse and dP - D (eager: two conversions, a subtraction, two
// multiplications, exp2, an addition, a subtraction and two casts).
//
// Where the compiler targets AVX512-BF16, forward_segment_bf16 runs a whole segment of keys for a
// block of query rows: per thread, per block of 128 rows of one head, per 512 keys, q·kᵀ and p·v
// with float32 accumulation (vdpbf16ps) and the online softmax between them, every intermediate
// in the core's own cache, as torch's fused CPU kernel works. backward_segment_bf16 does the same
// for the backward (FlashAttention-2's five products per block of 128 rows and 128 keys), one
// task per batch entry and key head so that each gradient has one writer. Both take a soft cap
// (softcap > 0: each score becomes c · tanh(score / c), Gemma 2's, with its derivative in dS),
// ALiBi (subquad.mods.alibi: a bias per head and distance) and a band of diagonals (the causal
// mask, subquad.mods.sliding_window and local_window: keys outside it skipped), the mods they
// evaluate themselves (Mods), and one range of keys per query row (document masks, prefix-LM,
// key padding: Mods::ranges). Their products run on the micro-kernels below or on ATen's CPU
// BLAS micro-kernels (at::native::cpublas::brgemm: oneDNN's, AMX tiles where the CPU has them),
// whichever set_products chose. Where it targets AVX512F, forward_segment_f32 runs the same
// forward loop for float32 and float16 inputs, its products in float32 on FMA (float16 converted
// exactly when the rows and keys are copied in), p kept in float32. forward_packed_f32 and
// forward_packed_bf16 run the forward loop over each of a group of packed sequences in one call.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#if __has_include(<ATen/native/CPUBlas.h>)
#include <ATen/native/CPUBlas.h>
#endif
// ATen's CPU BLAS micro-kernels (at::native::cpublas::brgemm: oneDNN's, on AMX tiles where the CPU
// has them, AVX512 or AVX2 elsewhere, chosen at run time), where this torch exports them.
#if defined(CPUBLAS_BRGEMM_BF16BF16F32) && defined(CPUBLAS_BRGEMM_F32F32F32)
#define SUBQUAD_ATEN_PRODUCTS 1
#endif

// The float32 loops need 512-bit FMA (AVX512F) or 256-bit FMA (AVX2 and FMA); the bfloat16 ones
// AVX512-BF16.
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define SUBQUAD_WIDE_LOOPS 1
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

constexpr double kLog2e = 1.4426950408889634;

// Which products the loops run: bit kWideProducts for the float32 loops (float32 and float16
// inputs), kPairProducts for the bfloat16 ones; a set bit: ATen's micro-kernels, else the
// micro-kernels below (set_products). Read once per call; the call's threads keep it in
// tl_aten_products for its products.
constexpr int kWideProducts = 1, kPairProducts = 2;
std::atomic<int> g_aten_products{0};
thread_local bool tl_aten_products = false;

// ATen's micro-kernels refused a product during a call (oneDNN found no kernel for its shape on
// this CPU): that product and every later one run on the loops' own, and the switch is cleared.
void aten_products_failed() {
  tl_aten_products = false;
  g_aten_products.store(0);
}

// For tests only (_fail_aten_products): the next n of ATen's products throw just before they run,
// as oneDNN does where it refuses one, so that the fallback above runs on any CPU. One atomic
// counter, taken down once per refused product by whichever thread asks.
std::atomic<int64_t> g_fail_aten_products{0};
[[maybe_unused]] void refuse_for_tests() {
  int64_t n = g_fail_aten_products.load();
  while (n > 0 && !g_fail_aten_products.compare_exchange_weak(n, n - 1)) {
  }
  if (n > 0) throw std::runtime_error("ATen's product refused by subquad's test hook (_fail_aten_products)");
}

inline float bf16_to_float(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Round to nearest, ties to even (what PyTorch's casts do); a NaN stays a NaN.
inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// 2^x for x below 2^31: 0 below -126 (-inf included), +inf from 128 on; a NaN gives a NaN. The
// kernels' x lie at or just above 0 at most (scores minus their row's maximum, or minus the lse).
// 2^x = 2^k · 2^f, k = round(x), f in [-1/2, 1/2], 2^f by a degree-6 polynomial fitted for the
// least largest relative error (1.9e-9; float32's own rounding is 6e-8). Written without branches
// or library calls so that the compiler vectorizes it. x is clamped below only and the exponent
// k + 127 in integers: a float clamp above, with the Taylor polynomial of degree 7 used before,
// made the forward pass slower (docs/benchmarks/loops.md).
inline float exp2_approx(float x) {
  x = x < -127.0f ? -127.0f : x;
  const float k = (x + 12582912.0f) - 12582912.0f;  // round to nearest: 1.5 · 2^23
  const float f = x - k;
  float p = 1.5345768873419225e-4f;
  p = p * f + 1.3399921717254148e-3f;
  p = p * f + 9.6184890194597646e-3f;
  p = p * f + 5.5503288012084352e-2f;
  p = p * f + 2.4022646891035759e-1f;
  p = p * f + 6.9314720572566602e-1f;
  p = p * f + 1.0000000005539629f;
  int32_t e = static_cast<int32_t>(k) + 127;
  e = e < 0 ? 0 : e;
  e = e > 255 ? 255 : e;  // 255: the exponent of +inf
  const uint32_t bits = static_cast<uint32_t>(e) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// tanh from exp2_approx: 1 - 2 / (2^(2 z log2 e) + 1), z clamped to [-9, 9] (tanh(9) rounds to 1
// in float32). Absolute error below 2e-7 (the cancellation near 0), branch-free to vectorize.
inline float tanh_approx(float z) {
  z = z < -9.0f ? -9.0f : (z > 9.0f ? 9.0f : z);
  const float e = exp2_approx(z * 2.8853900817779268f);  // 2 log2 e
  return 1.0f - 2.0f / (e + 1.0f);
}

}  // namespace

// r: (batch, rows, n) bfloat16, contiguous: scores minus each row's offset `used`, in log2 units
// (-inf where masked). m_run, used: (batch, rows) float32: each row's maximum so far and offset.
// Per row: m_tile = max(r) + used; m_new = max(m_run, m_tile) (0 where that is -inf); r is
// overwritten by p = 2^(r - (m_new - used)), rounded to bfloat16; sums = the float32 sum of the
// unrounded p. Returns (sums, m_tile).
std::vector<torch::Tensor> exp2_rows_bf16(torch::Tensor r, torch::Tensor m_run, torch::Tensor used) {
  TORCH_CHECK(r.dim() == 3 && r.scalar_type() == torch::kBFloat16 && r.is_contiguous() && r.device().is_cpu(),
              "r: a contiguous (batch, rows, n) bfloat16 CPU tensor");
  const int64_t rows = r.size(0) * r.size(1);
  const int64_t n = r.size(2);
  for (const auto& t : {m_run, used}) {
    TORCH_CHECK(t.scalar_type() == torch::kFloat && t.is_contiguous() && t.numel() == rows && t.device().is_cpu(),
                "m_run, used: contiguous float32 CPU tensors of one entry per row of r");
  }
  auto sums = torch::empty({r.size(0), r.size(1)}, m_run.options());
  auto m_tile = torch::empty({r.size(0), r.size(1)}, m_run.options());
  uint16_t* data = reinterpret_cast<uint16_t*>(r.data_ptr());
  const float* run = m_run.data_ptr<float>();
  const float* off = used.data_ptr<float>();
  float* out_sums = sums.data_ptr<float>();
  float* out_max = m_tile.data_ptr<float>();
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(n, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(static_cast<size_t>(n));
    float* x = buf.data();
    for (int64_t i = begin; i < end; ++i) {
      uint16_t* row = data + i * n;
      float mx = neg_inf;
#pragma omp simd reduction(max : mx)
      for (int64_t j = 0; j < n; ++j) {
        const float v = bf16_to_float(row[j]);
        x[j] = v;
        mx = v > mx ? v : mx;
      }
      const float tile_max = mx + off[i];
      out_max[i] = tile_max;
      float ref = run[i] > tile_max ? run[i] : tile_max;
      ref = ref == neg_inf ? 0.0f : ref;
      const float shift = ref - off[i];
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t j = 0; j < n; ++j) {
        const float p = exp2_approx(x[j] - shift);
        sum += p;
        row[j] = float_to_bf16(p);
      }
      out_sums[i] = sum;
    }
  });
  return {sums, m_tile};
}

// s, dp: (batch, rows, n) bfloat16, contiguous: S minus each row's offset (-inf where masked) and
// dP minus each row's offset. shift, c: (batch, rows) float32. In place, per entry:
// p = exp(s - shift) (shift = lse - S's offset), s <- p and dp <- scale · p · (dp + c)
// (c = dP's offset - D: dS = P ∘ (dP - D)), each rounded once to bfloat16.
void softmax_grad_rows_bf16(torch::Tensor s, torch::Tensor dp, torch::Tensor shift, torch::Tensor c, double scale) {
  for (const auto& t : {s, dp}) {
    TORCH_CHECK(t.dim() == 3 && t.scalar_type() == torch::kBFloat16 && t.is_contiguous() && t.device().is_cpu(),
                "s, dp: contiguous (batch, rows, n) bfloat16 CPU tensors");
  }
  TORCH_CHECK(s.sizes() == dp.sizes(), "s, dp: one shape");
  const int64_t rows = s.size(0) * s.size(1);
  const int64_t n = s.size(2);
  for (const auto& t : {shift, c}) {
    TORCH_CHECK(t.scalar_type() == torch::kFloat && t.is_contiguous() && t.numel() == rows && t.device().is_cpu(),
                "shift, c: contiguous float32 CPU tensors of one entry per row of s");
  }
  uint16_t* sp = reinterpret_cast<uint16_t*>(s.data_ptr());
  uint16_t* dpp = reinterpret_cast<uint16_t*>(dp.data_ptr());
  const float* sh = shift.data_ptr<float>();
  const float* cc = c.data_ptr<float>();
  const float log2e = static_cast<float>(kLog2e);
  const float sc = static_cast<float>(scale);
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(n, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      uint16_t* srow = sp + i * n;
      uint16_t* drow = dpp + i * n;
      const float base = sh[i] * log2e;
      const float ci = cc[i];
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) {
        const float p = exp2_approx(bf16_to_float(srow[j]) * log2e - base);
        srow[j] = float_to_bf16(p);
        drow[j] = float_to_bf16(sc * p * (bf16_to_float(drow[j]) + ci));
      }
    }
  });
}

namespace {

void check_rows(const torch::Tensor& t, int64_t rows, const char* what) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat && t.is_contiguous() && t.numel() == rows && t.device().is_cpu(),
              what, ": contiguous float32 CPU tensors of one entry per row");
}

}  // namespace

// A forward tile's next offsets, in one call where the eager code makes about a dozen small ones.
// m_tile, m_run, used: (batch, rows) float32: the tile's rows' maxima, the maxima before it, the
// offsets its product used. col: (batch, rows) bfloat16, any strides: the offset column of the
// rows' operand (subquad/_backends/offsets.py, OffsetOperand). Per row: moved = m_tile > m_run;
// far = moved and |m_tile - used| > drift; the next offset o = m_tile where moved, else used (0
// where not finite) is written to col as -bf16(o / alpha) and returned as bf16(o / alpha) · alpha;
// bf16(o / alpha) is 0 where alpha is below float32's smallest normal (the products are 0:
// OffsetOperand.vanishes) or where it overflows bfloat16, as in OffsetOperand.set_offset.
// Returns (next offsets (batch, rows) float32, far (batch, rows) bool, the number of far rows).
std::tuple<torch::Tensor, torch::Tensor, int64_t> next_offsets(torch::Tensor m_tile, torch::Tensor m_run,
                                                               torch::Tensor used, torch::Tensor col, double alpha,
                                                               double drift) {
  TORCH_CHECK(col.dim() == 2 && col.scalar_type() == torch::kBFloat16 && col.device().is_cpu(),
              "col: a (batch, rows) bfloat16 CPU tensor");
  const int64_t batch = col.size(0), rows = col.size(1);
  for (const auto& t : {m_tile, m_run, used}) check_rows(t, batch * rows, "m_tile, m_run, used");
  auto next = torch::empty({batch, rows}, m_tile.options());
  auto far = torch::empty({batch, rows}, m_tile.options().dtype(torch::kBool));
  const float* mt = m_tile.data_ptr<float>();
  const float* mr = m_run.data_ptr<float>();
  const float* u = used.data_ptr<float>();
  float* nx = next.data_ptr<float>();
  bool* fr = far.data_ptr<bool>();
  uint16_t* c = reinterpret_cast<uint16_t*>(col.data_ptr());
  const int64_t s0 = col.stride(0), s1 = col.stride(1);
  const float a = static_cast<float>(alpha), d = static_cast<float>(drift);
  const bool vanishes = std::fabs(alpha) < std::numeric_limits<float>::min();
  int64_t n_far = 0;
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t i = b * rows + r;
      const bool moved = mt[i] > mr[i];
      const bool is_far = moved && std::fabs(mt[i] - u[i]) > d;
      fr[i] = is_far;
      n_far += is_far;
      float o = moved ? mt[i] : u[i];
      o = std::isfinite(o) ? o : 0.0f;
      uint16_t h = vanishes ? uint16_t{0} : float_to_bf16(o / a);
      if ((h & 0x7F80u) == 0x7F80u) h = 0;  // infinite or NaN
      c[b * s0 + r * s1] = static_cast<uint16_t>(h ^ 0x8000u);  // -h: the sign bit flipped
      nx[i] = bf16_to_float(h) * a;
    }
  }
  return {next, far, n_far};
}

// The online softmax's state after a tile, in one call (eager: eight small ones). m_run, l, m_tile,
// sums: (batch, rows) float32; acc: (batch, rows, ev) float32, contiguous. Per row:
// m_new = max(m_run, m_tile) (NaN where either is); ref = m_new, 0 where it is -inf;
// c = 2^(m_run - ref); l <- l · c + sums; acc's row *= c; m_run <- m_new.
void online_update(torch::Tensor m_run, torch::Tensor l, torch::Tensor acc, torch::Tensor m_tile, torch::Tensor sums) {
  TORCH_CHECK(acc.dim() == 3 && acc.scalar_type() == torch::kFloat && acc.is_contiguous() && acc.device().is_cpu(),
              "acc: a contiguous (batch, rows, ev) float32 CPU tensor");
  const int64_t rows = acc.size(0) * acc.size(1), ev = acc.size(2);
  for (const auto& t : {m_run, l, m_tile, sums}) check_rows(t, rows, "m_run, l, m_tile, sums");
  float* mr = m_run.data_ptr<float>();
  float* lp = l.data_ptr<float>();
  float* ap = acc.data_ptr<float>();
  const float* mt = m_tile.data_ptr<float>();
  const float* sp = sums.data_ptr<float>();
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(ev, 1));
  at::parallel_for(0, rows, grain, [=](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float old = mr[i], tile = mt[i];
      float m_new = tile > old ? tile : old;
      if (std::isnan(tile) || std::isnan(old)) m_new = std::numeric_limits<float>::quiet_NaN();
      const float ref = m_new == neg_inf ? 0.0f : m_new;
      const float c = std::exp2(old - ref);
      lp[i] = lp[i] * c + sp[i];
      float* row = ap + i * ev;
      for (int64_t j = 0; j < ev; ++j) row[j] *= c;
      mr[i] = m_new;
    }
  });
}

#if defined(SUBQUAD_WIDE_LOOPS)
namespace {

// Micro::run<r, nv, ACC>, r <= R and nv <= NV chosen at run time.
template <class Micro, bool ACC, int R, int NV>
inline void micro_at(int r, int nv, const typename Micro::Op* a, int64_t lda, const typename Micro::Op* b, int64_t ldb,
                     int64_t k, float* c, int64_t ldc) {
  if constexpr (NV > 1) {
    if (nv < NV) return micro_at<Micro, ACC, R, NV - 1>(r, nv, a, lda, b, ldb, k, c, ldc);
  }
  if constexpr (R > 1) {
    if (r < R) return micro_at<Micro, ACC, R - 1, NV>(r, nv, a, lda, b, ldb, k, c, ldc);
  }
  Micro::template run<R, NV, ACC>(a, lda, b, ldb, k, c, ldc);
}

// C (rows x 16·n16 float32) = A · B (ACC: C += A · B) in blocks of Micro::kRows rows x 16 ·
// Micro::kVectors columns, each by Micro::run<R, NV, ACC>(a, lda, b, ldb, k, c, ldc): B's
// columns 16·v.. lie at b + v · Micro::kColumn.
template <class Micro, bool ACC>
void gemm_blocks(const typename Micro::Op* a, int64_t lda, const typename Micro::Op* b, int64_t ldb, int64_t k,
                 float* c, int64_t ldc, int64_t rows, int64_t n16) {
  constexpr int R = Micro::kRows, NV = Micro::kVectors;
  for (int64_t i = 0; i < rows; i += R) {
    const int r = static_cast<int>(std::min<int64_t>(R, rows - i));
    for (int64_t v = 0; v < n16; v += NV) {
      const int nv = static_cast<int>(std::min<int64_t>(NV, n16 - v));
      micro_at<Micro, ACC, R, NV>(r, nv, a + i * lda, lda, b + v * Micro::kColumn, ldb, k, c + i * ldc + v * 16, ldc);
    }
  }
}

// A vector of float32 lanes: 16 with AVX512F, else 8 (AVX2 and FMA).
struct Lanes {
#if defined(__AVX512F__)
  using V = __m512;
  static constexpr int kWidth = 16;
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V zero() { return _mm512_setzero_ps(); }
  static V splat(float x) { return _mm512_set1_ps(x); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
#else
  using V = __m256;
  static constexpr int kWidth = 8;
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V zero() { return _mm256_setzero_ps(); }
  static V splat(float x) { return _mm256_set1_ps(x); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
#endif
};

// A micro-kernel's R x N accumulators (vectors of C's rows): zero or C's (ACC), and stored back.
template <int R, int N, bool ACC>
inline void load_acc(Lanes::V (&acc)[R][N], const float* c, int64_t ldc) {
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < N; ++v) acc[r][v] = ACC ? Lanes::load(c + r * ldc + v * Lanes::kWidth) : Lanes::zero();
}

template <int R, int N>
inline void store_acc(const Lanes::V (&acc)[R][N], float* c, int64_t ldc) {
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < N; ++v) Lanes::store(c + r * ldc + v * Lanes::kWidth, acc[r][v]);
}

// C (R x 16·NV float32) = A (R x k float32, row stride lda) · B (k rows of the columns, ldb
// elements apart), one FMA per entry of A and vector of columns. ACC: C += A · B instead. Blocks
// of 8 x 32 with 16 lanes (AVX512F; 8 x 48 and 6 x 64 ran as fast), 6 x 16 with 8 lanes (AVX2:
// 16 registers). The micro-kernels are kept out of line: inlined, their accumulators' registers
// depended on the code around them, and one edit elsewhere could halve the loops' speed
// (docs/benchmarks/loops.md).
struct WideMicro {
  using Op = float;
  static constexpr int64_t kColumn = 16;
  static constexpr int kRows = Lanes::kWidth == 16 ? 8 : 6, kVectors = Lanes::kWidth == 16 ? 2 : 1;
  template <int R, int NV, bool ACC>
  __attribute__((noinline)) static void run(const float* a, int64_t lda, const float* b, int64_t ldb, int64_t k, float* c,
                                            int64_t ldc) {
    constexpr int N = NV * 16 / Lanes::kWidth;  // vectors per row
    Lanes::V acc[R][N];
    load_acc<R, N, ACC>(acc, c, ldc);
    for (int64_t p = 0; p < k; ++p) {
      Lanes::V bv[N];
#pragma GCC unroll 4
      for (int v = 0; v < N; ++v) bv[v] = Lanes::load(b + p * ldb + v * Lanes::kWidth);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const Lanes::V av = Lanes::splat(a[r * lda + p]);
#pragma GCC unroll 4
        for (int v = 0; v < N; ++v) acc[r][v] = Lanes::fma(av, bv[v], acc[r][v]);
      }
    }
    store_acc<R, N>(acc, c, ldc);
  }
};

#if defined(__AVX512BF16__)
// C (R x 16·NV float32) = A (R x 2·k2 bfloat16, row stride lda) · B, B in pairs ("VNNI"): k2 rows
// of (columns x 2) bfloat16, ldb elements apart; vdpbf16ps accumulates each pair in float32. ACC:
// C += A · B instead.
struct PairMicro {
  using Op = uint16_t;
  static constexpr int64_t kColumn = 32;
  static constexpr int kRows = 8, kVectors = 2;
  template <int R, int NV, bool ACC>
  __attribute__((noinline)) static void run(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb, int64_t k2, float* c, int64_t ldc) {
    __m512 acc[R][NV];
    load_acc<R, NV, ACC>(acc, c, ldc);
    for (int64_t p = 0; p < k2; ++p) {
      __m512i bv[NV];
      for (int v = 0; v < NV; ++v) bv[v] = _mm512_loadu_si512(b + p * ldb + v * 32);
      for (int r = 0; r < R; ++r) {
        int32_t pair;
        std::memcpy(&pair, a + r * lda + 2 * p, sizeof pair);
        const __m512i av = _mm512_set1_epi32(pair);
        for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], (__m512bh)av, (__m512bh)bv[v]);
      }
    }
    store_acc<R, NV>(acc, c, ldc);
  }
};

// C (rows x 16·n16) = A · B (ACC: C += A · B), A and B bfloat16 as PairMicro reads them, k2 pairs.
template <bool ACC = false>
void gemm_pairs(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb, int64_t k2, float* c, int64_t ldc,
                int64_t rows, int64_t n16) {
  gemm_blocks<PairMicro, ACC>(a, lda, b, ldb, k2, c, ldc, rows, n16);
}
#endif

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
inline int64_t round16(int64_t n) { return round_up(n, 16); }
inline const at::BFloat16* as_bf16(const uint16_t* p) { return reinterpret_cast<const at::BFloat16*>(p); }

// While alive, this thread's products are ATen's where `aten` (the call's set_products bit); at
// the end the thread's AMX state is released, as torch's own kernels do after theirs.
struct ProductsScope {
  const bool aten, pairs;
  ProductsScope(bool aten_, bool pairs_) : aten(aten_), pairs(pairs_) { tl_aten_products = aten; }
  ~ProductsScope() {
#if defined(SUBQUAD_ATEN_PRODUCTS)
    if (aten) at::native::cpublas::brgemm_release(pairs);
#endif
    tl_aten_products = false;
  }
  ProductsScope(const ProductsScope&) = delete;
  ProductsScope& operator=(const ProductsScope&) = delete;
};

template <class Tiles>
bool aten_products_on() {
  return (g_aten_products.load(std::memory_order_relaxed) & Tiles::kProducts) != 0;
}

void check_inputs(std::initializer_list<torch::Tensor> ts, const char* what, bool wide) {
  const auto first = ts.begin()->scalar_type();
  for (const auto& t : ts) {
    const auto dt = t.scalar_type();
    const bool ok = wide ? (dt == torch::kFloat || dt == torch::kHalf) && dt == first : dt == torch::kBFloat16;
    TORCH_CHECK(t.dim() == 4 && ok && (t.stride(3) == 1 || t.size(3) <= 1) && t.device().is_cpu(), what,
                wide ? ": (batch, heads, length, dim) CPU tensors of last stride 1, all float32 or all float16"
                     : ": (batch, heads, length, dim) bfloat16 CPU tensors of last stride 1");
  }
}

void check_bf16(std::initializer_list<torch::Tensor> ts, const char* what) { check_inputs(ts, what, false); }

constexpr int64_t kCopyRows = 32;  // rows per task of a layout copy
// Each transposed row is kSkew entries longer than the keys, so that a product's successive rows
// of B do not fall into one set of the core's cache (npad is often a power of 2: with 4096 keys
// the bfloat16 keys' rows lay 16 KiB apart, and the micro-kernel's 32 of them fought over 8 ways).
constexpr int64_t kSkew = 16;

// Per head b·H + h of t (B, H, n, d), the (cols x ld) matrix out[c][j] = unit(row j of t, c), 0
// for j >= n: the rows transposed, into a contiguous tensor of `shape` and dtype `type` (B·H
// blocks of cols x ld Dsts). A task copies kCopyRows rows: it reads them from the cache while
// each of its writes fills kCopyRows consecutive entries.
template <typename Dst, typename Src, typename Unit>
torch::Tensor transpose_rows(const torch::Tensor& t, int64_t cols, int64_t ld, std::initializer_list<int64_t> shape,
                             torch::ScalarType type, Unit unit) {
  const int64_t heads = t.size(1), n = t.size(2), bh_all = t.size(0) * heads;
  auto out = torch::empty(shape, t.options().dtype(type).memory_format(c10::MemoryFormat::Contiguous));
  TORCH_CHECK(out.numel() * out.element_size() == bh_all * cols * ld * static_cast<int64_t>(sizeof(Dst)),
              "transpose_rows: shape and layout disagree");
  auto* dst = reinterpret_cast<Dst*>(out.data_ptr());
  const auto* src = reinterpret_cast<const Src*>(t.data_ptr());
  const int64_t blocks = (ld + kCopyRows - 1) / kCopyRows;
  at::parallel_for(0, bh_all * blocks, 8, [&](int64_t begin, int64_t end) {
    const Src* rows[kCopyRows];
    for (int64_t x = begin; x < end; ++x) {
      const int64_t bh = x / blocks, j0 = (x % blocks) * kCopyRows, nr = std::min(kCopyRows, ld - j0);
      const int64_t seen = std::clamp<int64_t>(n - j0, 0, nr);  // rows of t in this block
      const Src* head = src + (bh / heads) * t.stride(0) + (bh % heads) * t.stride(1);
      for (int64_t r = 0; r < seen; ++r) rows[r] = head + (j0 + r) * t.stride(2);
      Dst* o = dst + bh * cols * ld + j0;
      for (int64_t c = 0; c < cols; ++c, o += ld) {
        for (int64_t r = 0; r < seen; ++r) o[r] = unit(rows[r], c);
        for (int64_t r = seen; r < nr; ++r) o[r] = Dst(0);
      }
    }
  });
  return out;
}

// Per head of t (B, H, n, d), its rows in groups of Step (1 or 2) with their entries interleaved:
// out[j / Step][c][j % Step] = t[j][c] as Dst, 0 for c >= d or j >= n: (npad / Step, dpad, Step)
// per head, into a contiguous tensor of `shape` and dtype `type` (npad a multiple of kCopyRows).
template <typename Dst, typename Src, int64_t Step>
torch::Tensor interleave_rows(const torch::Tensor& t, int64_t npad, int64_t dpad, std::initializer_list<int64_t> shape,
                              torch::ScalarType type) {
  const int64_t heads = t.size(1), n = t.size(2), d = t.size(3), bh_all = t.size(0) * heads;
  auto out = torch::empty(shape, t.options().dtype(type).memory_format(c10::MemoryFormat::Contiguous));
  TORCH_CHECK(out.numel() * out.element_size() == bh_all * npad * dpad * static_cast<int64_t>(sizeof(Dst)) &&
                  npad % kCopyRows == 0,
              "interleave_rows: shape and layout disagree");
  auto* dst = reinterpret_cast<Dst*>(out.data_ptr());
  const auto* src = reinterpret_cast<const Src*>(t.data_ptr());
  const int64_t blocks = npad / kCopyRows;
  at::parallel_for(0, bh_all * blocks, 8, [&](int64_t begin, int64_t end) {
    for (int64_t x = begin; x < end; ++x) {
      const int64_t bh = x / blocks, j0 = (x % blocks) * kCopyRows;
      const Src* head = src + (bh / heads) * t.stride(0) + (bh % heads) * t.stride(1);
      for (int64_t j = j0; j < j0 + kCopyRows; ++j) {
        Dst* o = dst + bh * npad * dpad + (j / Step) * dpad * Step + j % Step;
        const int64_t have = j < n ? d : 0;
        const Src* row = head + j * t.stride(2);
        for (int64_t c = 0; c < have; ++c) o[c * Step] = static_cast<Dst>(row[c]);
        for (int64_t c = have; c < dpad; ++c) o[c * Step] = Dst(0);
      }
    }
  });
  return out;
}

// t (B, H, n, d) bfloat16 as the B operand of a product that reduces over d (x · tᵀ): pairs of
// head-dim entries, out[b·H + h][p][j][0..1] = t[b][h][j][2p..2p+1]: (B·H, ceil(d/2), npad + kSkew,
// 2), zero where padded.
torch::Tensor pairs_of_dims(const torch::Tensor& t, int64_t npad) {
  const int64_t d = t.size(3), d2 = (d + 1) / 2, ld = npad + kSkew;
  return transpose_rows<uint32_t, uint16_t>(t, d2, ld, {t.size(0) * t.size(1), d2, ld, 2}, torch::kBFloat16,
                                            [d](const uint16_t* row, int64_t p) {
                                              const uint32_t hi = 2 * p + 1 < d ? row[2 * p + 1] : 0;
                                              return static_cast<uint32_t>(row[2 * p]) | hi << 16;
                                            });
}

// t (B, H, n, d) bfloat16 as the B operand of a product that reduces over its rows (p · t): pairs
// of rows, out[b·H + h][i][c][0..1] = t[b][h][2i..2i+1][c]: (B·H, npad / 2, dpad, 2), zero where
// padded (npad a multiple of 32, dpad >= d).
torch::Tensor pairs_of_rows(const torch::Tensor& t, int64_t npad, int64_t dpad) {
  return interleave_rows<uint16_t, uint16_t, 2>(t, npad, dpad, {t.size(0) * t.size(1), npad / 2, dpad, 2},
                                                torch::kBFloat16);
}

// t (B, H, n, d) float32 or float16 in float32, transposed (the B operand of x · tᵀ):
// out[b·H + h][c][j] = t[b][h][j][c]: (B·H, d, npad + kSkew), zero where padded. wide_rows: as it
// lies, (B·H, npad, dpad) (the B operand of p · t).
torch::Tensor wide_dims(const torch::Tensor& t, int64_t npad) {
  const int64_t d = t.size(3), ld = npad + kSkew;
  const std::initializer_list<int64_t> shape = {t.size(0) * t.size(1), d, ld};
  if (t.scalar_type() == torch::kHalf)
    return transpose_rows<float, at::Half>(t, d, ld, shape, torch::kFloat,
                                           [](const at::Half* row, int64_t c) { return static_cast<float>(row[c]); });
  return transpose_rows<float, float>(t, d, ld, shape, torch::kFloat, [](const float* row, int64_t c) { return row[c]; });
}

torch::Tensor wide_rows(const torch::Tensor& t, int64_t npad, int64_t dpad) {
  const std::initializer_list<int64_t> shape = {t.size(0) * t.size(1), npad, dpad};
  if (t.scalar_type() == torch::kHalf) return interleave_rows<float, at::Half, 1>(t, npad, dpad, shape, torch::kFloat);
  return interleave_rows<float, float, 1>(t, npad, dpad, shape, torch::kFloat);
}

constexpr int64_t kNoMask = 0, kBoolMask = 1, kFloatMask = 2, kBFloat16Mask = 3, kHalfMask = 4;

// The kind of an attn_mask viewed as (B, Hq, qn, kn), any strides (0 where broadcast).
int64_t mask_kind_of(const torch::Tensor& m, int64_t batch, int64_t hq, int64_t qn, int64_t kn) {
  TORCH_CHECK(m.dim() == 4 && m.size(0) == batch && m.size(1) == hq && m.size(2) == qn && m.size(3) == kn &&
                  m.device().is_cpu(),
              "mask: a (B, Hq, qn, kn) CPU tensor (expanded where it broadcasts)");
  switch (m.scalar_type()) {
    case torch::kBool: return kBoolMask;
    case torch::kFloat: return kFloatMask;
    case torch::kBFloat16: return kBFloat16Mask;
    case torch::kHalf: return kHalfMask;
    default: TORCH_CHECK(false, "mask: bool, float32, bfloat16 or float16");
  }
  return kNoMask;
}

// Row i of the mask from key j0 on, n entries, as what the scores in log2 units get added:
// -inf where a bool mask is False, else 0; a float mask's values times log2 e.
void mask_row(const torch::Tensor& m, int64_t kind, int64_t b, int64_t h, int64_t i, int64_t j0, int64_t n,
              float* out) {
  const int64_t s3 = m.stride(3);
  const int64_t at = b * m.stride(0) + h * m.stride(1) + i * m.stride(2) + j0 * s3;
  const float log2e = static_cast<float>(kLog2e);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  if (kind == kBoolMask) {
    const bool* p = m.data_ptr<bool>() + at;
    for (int64_t j = 0; j < n; ++j) out[j] = p[j * s3] ? 0.0f : neg_inf;
  } else if (kind == kFloatMask) {
    const float* p = m.data_ptr<float>() + at;
    for (int64_t j = 0; j < n; ++j) out[j] = p[j * s3] * log2e;
  } else if (kind == kBFloat16Mask) {
    const uint16_t* p = reinterpret_cast<const uint16_t*>(m.data_ptr()) + at;
    for (int64_t j = 0; j < n; ++j) out[j] = bf16_to_float(p[j * s3]) * log2e;
  } else {
    const at::Half* p = reinterpret_cast<const at::Half*>(m.data_ptr()) + at;
    for (int64_t j = 0; j < n; ++j) out[j] = static_cast<float>(p[j * s3]) * log2e;
  }
}

// A bound that no position reaches: a band's open side (kept far from int64's limits, so that
// positions can be added to it).
constexpr int64_t kUnbounded = std::numeric_limits<int64_t>::max() / 4;

// What the loops evaluate themselves of subquad.mods' built-ins, in the positions of the call
// (query i at q0 + i, key j at k0 + j): a band of diagonals, query i seeing key j where
// lo <= (q0 + i) - (k0 + j) <= hi (the causal mask: lo = -causal_offset; sliding_window,
// local_window and their intersections), and ALiBi, adding -slope[h] · |(q0 + i) - (k0 + j) +
// shift| to head h's scaled scores (shift: the callback's query positions minus its keys').
// slopes: per query head, times log2 e (the scores' units); empty: no ALiBi.
// And per-row ranges of keys (document masks with sorted key ids, prefix-LM, key padding): query
// i of batch entry b sees only keys [ranges[b][i][0], ranges[b][i][1]) of the call's k (0: its first
// key; a batch of 1 broadcast), intersected with the band.
struct Mods {
  int64_t lo = -kUnbounded, hi = kUnbounded;
  std::vector<float> slopes;
  int64_t shift = 0;
  const int64_t* ranges = nullptr;  // (range_batch, rows, 2) int64, contiguous
  int64_t range_batch = 0, range_rows = 0;
  bool alibi() const { return !slopes.empty(); }
  // Keys [first, end) of a block of keys from k0 + j0 on, nb of them, that query q0 + i sees; at
  // = (q0 + i) - (k0 + j0), the block's key on the row's diagonal.
  int64_t first(int64_t at, int64_t nb) const { return std::clamp<int64_t>(at - hi, 0, nb); }
  int64_t end(int64_t at, int64_t nb, int64_t from) const { return std::clamp<int64_t>(at - lo + 1, from, nb); }
  // [from, vis) of the block of keys from j0 on, nb of them, narrowed to query i's range.
  void narrow(int64_t b, int64_t i, int64_t j0, int64_t nb, int64_t& from, int64_t& vis) const {
    if (ranges == nullptr) return;
    const int64_t* r = ranges + ((range_batch == 1 ? 0 : b) * range_rows + i) * 2;
    from = std::max(from, std::clamp<int64_t>(r[0] - j0, 0, nb));
    vis = std::max(from, std::min(vis, std::clamp<int64_t>(r[1] - j0, 0, nb)));
  }
  // [j_first, j_end) of the kn keys narrowed to what rows [i0, i0 + rows) of batch entry b see.
  void narrow_rows(int64_t b, int64_t i0, int64_t rows, int64_t kn, int64_t& j_first, int64_t& j_end) const {
    if (ranges == nullptr) return;
    int64_t lo_all = kn, hi_all = 0;
    for (int64_t i = i0; i < i0 + rows; ++i) {
      const int64_t* r = ranges + ((range_batch == 1 ? 0 : b) * range_rows + i) * 2;
      if (r[1] <= r[0]) continue;  // the row sees nothing here
      lo_all = std::min(lo_all, r[0]);
      hi_all = std::max(hi_all, r[1]);
    }
    j_first = std::max(j_first, std::clamp<int64_t>(lo_all, 0, kn) / 32 * 32);
    j_end = std::min(j_end, std::clamp<int64_t>(hi_all, 0, kn));
  }
};

// The Mods of an exported loop's arguments: causal (query i sees keys j <= i + causal_offset),
// window_lo and window_hi (None: that side open), slopes (None, or float32 of one per query head
// of hq) and alibi_shift.
Mods mods_of(bool causal, int64_t causal_offset, std::optional<int64_t> window_lo, std::optional<int64_t> window_hi,
             const std::optional<torch::Tensor>& slopes, int64_t alibi_shift, int64_t hq,
             const std::optional<torch::Tensor>& ranges = std::nullopt, int64_t batch = 1, int64_t qn = 0) {
  Mods mods;
  if (ranges.has_value()) {
    const auto& t = *ranges;
    TORCH_CHECK(t.dim() == 3 && (t.size(0) == 1 || t.size(0) == batch) && t.size(1) == qn && t.size(2) == 2 &&
                    t.scalar_type() == torch::kLong && t.is_contiguous() && t.device().is_cpu(),
                "ranges: a contiguous int64 CPU tensor of (1 or B, Lq, 2): each query row's [first, end) keys");
    mods.ranges = t.data_ptr<int64_t>();
    mods.range_batch = t.size(0);
    mods.range_rows = qn;
  }
  const auto bounded = [](int64_t x) { return std::clamp<int64_t>(x, -kUnbounded, kUnbounded); };
  if (window_lo.has_value()) mods.lo = bounded(*window_lo);
  if (window_hi.has_value()) mods.hi = bounded(*window_hi);
  if (causal) mods.lo = std::max(mods.lo, bounded(-causal_offset));
  if (slopes.has_value()) {
    const auto& t = *slopes;
    TORCH_CHECK(t.dim() == 1 && t.numel() == hq && t.scalar_type() == torch::kFloat && t.is_contiguous() &&
                    t.device().is_cpu(),
                "slopes: a contiguous float32 CPU tensor of one slope per query head");
    const float* sp = t.data_ptr<float>();
    for (int64_t h = 0; h < hq; ++h) mods.slopes.push_back(sp[h] * static_cast<float>(kLog2e));
  }
  TORCH_CHECK(std::abs(alibi_shift) < kUnbounded, "alibi_shift: a position difference");
  mods.shift = alibi_shift;
  return mods;
}

// What the scores of query head h's row get added from key from on, n entries, in log2 units:
// the mask's row (mask_row) where there is a mask, ALiBi's bias where the call has it. d0 = the
// row's query position minus key from's, shift included.
void additive_row(const std::optional<torch::Tensor>& mask, int64_t kind, const Mods& mods, int64_t b, int64_t h,
                  int64_t i, int64_t from, int64_t n, int64_t d0, float* out) {
  if (kind != kNoMask) mask_row(*mask, kind, b, h, i, from, n, out);
  if (!mods.alibi()) return;
  const float neg = -mods.slopes[static_cast<size_t>(h)], d = static_cast<float>(d0);
  if (kind != kNoMask) {
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) out[j] += neg * std::fabs(d - static_cast<float>(j));
  } else {
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) out[j] = neg * std::fabs(d - static_cast<float>(j));
  }
}

// The exponentials of one row of a tile: out[j] = 2^(x[j] · mul - ref) rounded to Op (one FMA and
// exp2_approx's steps, 16 lanes at a time where the build has AVX512F), j < n; returns the float32
// sum of the unrounded values.
template <typename Op>
float exp2_row(const float* x, int64_t n, float mul, float ref, Op* out);

#if defined(__AVX512F__)
// exp2_approx on 16 lanes, step for step (a NaN stays a NaN: the clamp keeps x where it is NaN).
inline __m512 exp2_lanes(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-127.0f), x);
  const __m512 k = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, k);
  __m512 p = _mm512_set1_ps(1.5345768873419225e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3399921717254148e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6184890194597646e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5503288012084352e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022646891035759e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314720572566602e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0000000005539629f));
  __m512i e = _mm512_add_epi32(_mm512_cvttps_epi32(k), _mm512_set1_epi32(127));
  e = _mm512_min_epi32(_mm512_max_epi32(e, _mm512_setzero_si512()), _mm512_set1_epi32(255));
  return _mm512_mul_ps(p, _mm512_castsi512_ps(_mm512_slli_epi32(e, 23)));
}

// 2^(x · mul - ref) for the lanes of `keep` (0 elsewhere), x read under the same mask.
inline __m512 exp2_masked(const float* x, __mmask16 keep, __m512 mul, __m512 neg_ref) {
  const __m512 y = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(keep, x), mul, neg_ref);
  return _mm512_maskz_mov_ps(keep, exp2_lanes(y));
}

inline __mmask16 first_lanes(int64_t n) { return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1u); }

template <>
float exp2_row<float>(const float* x, int64_t n, float mul, float ref, float* out) {
  const __m512 m = _mm512_set1_ps(mul), nr = _mm512_set1_ps(-ref);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 keep = first_lanes(n - j);
    const __m512 p = exp2_masked(x + j, keep, m, nr);
    sum = _mm512_add_ps(sum, p);
    _mm512_mask_storeu_ps(out + j, keep, p);
  }
  return _mm512_reduce_add_ps(sum);
}
#else
template <>
float exp2_row<float>(const float* x, int64_t n, float mul, float ref, float* out) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) {
    const float p = exp2_approx(x[j] * mul - ref);
    sum += p;
    out[j] = p;
  }
  return sum;
}
#endif

#if defined(__AVX512BF16__)
// Two vectors at a time, rounded to bfloat16 by vcvtne2ps2bf16 (to nearest, ties to even, as
// float_to_bf16; it also flushes subnormal results, below 2^-126, to zero).
template <>
float exp2_row<uint16_t>(const float* x, int64_t n, float mul, float ref, uint16_t* out) {
  const __m512 m = _mm512_set1_ps(mul), nr = _mm512_set1_ps(-ref);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 32) {
    const __mmask16 lo = first_lanes(n - j), hi = first_lanes(std::max<int64_t>(0, n - j - 16));
    const __m512 p0 = exp2_masked(x + j, lo, m, nr), p1 = exp2_masked(x + j + 16, hi, m, nr);
    sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
    const __m512i packed = (__m512i)_mm512_cvtne2ps_pbh(p1, p0);
    _mm512_mask_storeu_epi16(out + j, static_cast<__mmask32>(lo) | static_cast<__mmask32>(hi) << 16, packed);
  }
  return _mm512_reduce_add_ps(sum);
}
#endif

constexpr int64_t kSegmentRows = 128;  // a task's rows (fewer where the threads would idle)
constexpr int64_t kSegmentKeys = 512;  // keys per step; a multiple of 32



// The forward loop's operands per input dtype. Op: the products' operand type (p is rounded to
// it); q_row: a query row into a buffer of q_width(E) Ops; keys, values: a segment's keys and
// values in the layouts the products read; scores: s (rows x nb, row stride lds) = q·kᵀ for keys
// [j0, j0 + nb) of key head kvh; pv: out (rows x evp) = p (rows x nb, padded with zeros to a
// multiple of kStep) · v for the same keys.

// float32 or float16 inputs: float32 operands (float16 converted exactly), one FMA per product.
struct WideTiles {
  using Op = float;
  static constexpr int64_t kStep = 1;
  static int64_t q_width(int64_t e) { return e; }
  static void q_row(const torch::Tensor& q, int64_t at, int64_t e, float* dst) {
    if (q.scalar_type() == torch::kHalf) {
      const at::Half* src = reinterpret_cast<const at::Half*>(q.data_ptr()) + at;
      for (int64_t c = 0; c < e; ++c) dst[c] = static_cast<float>(src[c]);
    } else {
      std::memcpy(dst, q.data_ptr<float>() + at, static_cast<size_t>(e) * sizeof(float));
    }
  }
  static torch::Tensor keys(const torch::Tensor& k, int64_t npad) { return wide_dims(k, npad); }
  static torch::Tensor values(const torch::Tensor& v, int64_t npad, int64_t evp) { return wide_rows(v, npad, evp); }
  static constexpr int kProducts = kWideProducts;
  static void scores(const float* q, int64_t e, const float* kd, int64_t kvh, int64_t npad, int64_t j0, int64_t nb,
                     int64_t rows, float* s, int64_t lds) {
    const int64_t ld = npad + kSkew;
    const float* b = kd + kvh * e * ld + j0;
#if defined(SUBQUAD_ATEN_PRODUCTS)
    if (tl_aten_products) {
      try {
        refuse_for_tests();
        at::native::cpublas::brgemm(rows, round16(nb), e, e, ld, lds, false, q, b, s, false);
        return;
      } catch (const std::exception&) {
        aten_products_failed();
      }
    }
#endif
    gemm_blocks<WideMicro, false>(q, e, b, ld, e, s, lds, rows, (nb + 15) / 16);
  }
  // C (m x 16·n16) (ACC: +)= A (m x red, row stride lda) · B, B `red` rows of dpad columns as
  // pack_rows or values lay them out.
  template <bool ACC>
  static void over_rows(const float* a, int64_t lda, const float* b, int64_t dpad, int64_t red, float* c, int64_t ldc,
                        int64_t m, int64_t n16) {
#if defined(SUBQUAD_ATEN_PRODUCTS)
    if (tl_aten_products) {
      try {
        refuse_for_tests();
        at::native::cpublas::brgemm(m, 16 * n16, red, lda, dpad, ldc, ACC, a, b, c, false);
        return;
      } catch (const std::exception&) {
        aten_products_failed();
      }
    }
#endif
    gemm_blocks<WideMicro, ACC>(a, lda, b, dpad, red, c, ldc, m, n16);
  }
  template <bool ACC = false>
  static void pv(const float* p, int64_t ldp, const float* vd, int64_t kvh, int64_t npad, int64_t evp, int64_t j0,
                 int64_t nb, int64_t rows, float* out) {
    over_rows<ACC>(p, ldp, vd + (kvh * npad + j0) * evp, evp, nb, out, evp, rows, evp / 16);
  }
  // Rows [i0, i0 + rows) of t (B, H, n, d) at (b, h) in float32: `flat` as A operands (rows of d)
  // and `by_rows` as a B operand reduced over the rows (rows of dpad, zero past d).
  static void pack_rows(const torch::Tensor& t, int64_t b, int64_t h, int64_t i0, int64_t rows, float* flat,
                        float* by_rows, int64_t dpad) {
    const int64_t d = t.size(3);
    for (int64_t r = 0; r < rows; ++r) {
      q_row(t, b * t.stride(0) + h * t.stride(1) + (i0 + r) * t.stride(2), d, flat + r * d);
      std::memcpy(by_rows + r * dpad, flat + r * d, static_cast<size_t>(d) * sizeof(float));
      std::fill(by_rows + r * dpad + d, by_rows + (r + 1) * dpad, 0.0f);
    }
  }
  static float round(float x) { return x; }
};

#if defined(__AVX512BF16__)
// Pack rows [i0, i0 + rows) of t (B, H, n, d) bfloat16 at (b, h): `flat` as A operands (rows of
// 2·ceil(d/2) entries) and `paired` as a B operand reduced over the rows (pairs of rows, dpad
// columns), both zero where padded.
void pack_block(const torch::Tensor& t, int64_t b, int64_t h, int64_t i0, int64_t rows, uint16_t* flat,
                uint16_t* paired, int64_t dpad) {
  const int64_t d = t.size(3), d2 = (d + 1) / 2;
  const auto* src = reinterpret_cast<const uint16_t*>(t.data_ptr()) + b * t.stride(0) + h * t.stride(1);
  for (int64_t r = 0; r < round_up(rows, 2); ++r) {
    uint16_t* f = flat + r * d2 * 2;
    uint16_t* pr = paired + (r / 2) * dpad * 2 + (r % 2);
    if (r < rows) {
      const uint16_t* row = src + (i0 + r) * t.stride(2);
      std::memcpy(f, row, static_cast<size_t>(d) * sizeof(uint16_t));
      for (int64_t c = 0; c < d; ++c) pr[c * 2] = row[c];
    } else {
      std::memset(f, 0, static_cast<size_t>(d2 * 2) * sizeof(uint16_t));
      for (int64_t c = 0; c < d; ++c) pr[c * 2] = 0;
    }
  }
}

// bfloat16 inputs: pairs along each product's reduction (pairs_of_dims, pairs_of_rows), vdpbf16ps.
struct PairTiles {
  using Op = uint16_t;
  static constexpr int64_t kStep = 2;
  static int64_t q_width(int64_t e) { return round_up(e, 2); }
  static void q_row(const torch::Tensor& q, int64_t at, int64_t e, uint16_t* dst) {
    std::memcpy(dst, reinterpret_cast<const uint16_t*>(q.data_ptr()) + at, static_cast<size_t>(e) * sizeof(uint16_t));
  }
  static torch::Tensor keys(const torch::Tensor& k, int64_t npad) { return pairs_of_dims(k, npad); }
  static torch::Tensor values(const torch::Tensor& v, int64_t npad, int64_t evp) { return pairs_of_rows(v, npad, evp); }
  static constexpr int kProducts = kPairProducts;
  static void scores(const uint16_t* q, int64_t e, const uint16_t* kd, int64_t kvh, int64_t npad, int64_t j0,
                     int64_t nb, int64_t rows, float* s, int64_t lds) {
    const int64_t e2 = (e + 1) / 2, ld = npad + kSkew;
    const uint16_t* b = kd + kvh * e2 * ld * 2 + j0 * 2;
#if defined(SUBQUAD_ATEN_PRODUCTS)
    if (tl_aten_products) {  // B's pairs are the "VNNI" layout: ldb counts columns
      try {
        refuse_for_tests();
        at::native::cpublas::brgemm(rows, round16(nb), e2 * 2, e2 * 2, ld, lds, false, as_bf16(q), as_bf16(b), s, true);
        return;
      } catch (const std::exception&) {
        aten_products_failed();
      }
    }
#endif
    gemm_pairs(q, e2 * 2, b, ld * 2, e2, s, lds, rows, (nb + 15) / 16);
  }
  template <bool ACC>
  static void over_rows(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t dpad, int64_t red, float* c,
                        int64_t ldc, int64_t m, int64_t n16) {
#if defined(SUBQUAD_ATEN_PRODUCTS)
    if (tl_aten_products) {
      try {
        refuse_for_tests();
        at::native::cpublas::brgemm(m, 16 * n16, round_up(red, 2), lda, dpad, ldc, ACC, as_bf16(a), as_bf16(b), c, true);
        return;
      } catch (const std::exception&) {
        aten_products_failed();
      }
    }
#endif
    gemm_pairs<ACC>(a, lda, b, dpad * 2, round_up(red, 2) / 2, c, ldc, m, n16);
  }
  template <bool ACC = false>
  static void pv(const uint16_t* p, int64_t ldp, const uint16_t* vd, int64_t kvh, int64_t npad, int64_t evp,
                 int64_t j0, int64_t nb, int64_t rows, float* out) {
    over_rows<ACC>(p, ldp, vd + (kvh * (npad / 2) + j0 / 2) * evp * 2, evp, nb, out, evp, rows, evp / 16);
  }
  static void pack_rows(const torch::Tensor& t, int64_t b, int64_t h, int64_t i0, int64_t rows, uint16_t* flat,
                        uint16_t* by_rows, int64_t dpad) {
    pack_block(t, b, h, i0, rows, flat, by_rows, dpad);
  }
  static uint16_t round(float x) { return float_to_bf16(x); }
};
#endif

// One segment of keys for a block of query rows, the whole tile loop of a forward: per task (up to
// kSegmentRows rows of one query head), per block of up to kSegmentKeys keys, s = alpha · q·kᵀ in float32 (log2
// units), the online softmax on it (m, l and acc updated in place; keys outside the band of
// mods are skipped, in whole blocks where no row of the task sees them), p rounded to the
// operands' type and acc = acc · 2^(m_old - m_new) + p·v in float32.
// q: (B, Hq, qn, E), k: (B, Hk, kn, E), v: (B, Hk, kn, Ev), last stride 1, any others
// (a batch broadcast by stride 0 included); query head h reads key head h / (Hq / Hk). m_run, l:
// (B·Hq·qn) float32, acc: (B·Hq·qn, Ev) float32, contiguous. mods: the band of keys query i (q0 +
// i overall) sees among keys j (k0 + j), the causal mask's included, and ALiBi (Mods). mask: None,
// or the attn_mask's (B, Hq, qn, kn) view of these rows and keys (bool: False hides; float: added
// to the scaled scores, as SDPA's), read in place. softcap: 0, or c > 0 for scores c · tanh(scale
// · q·k / c) (before the mask and ALiBi's bias). Keys and values are first copied into the
// layouts the products read (Tiles): a segment-sized copy.
// State: row i of head bh (b · Hq + h) is row bh · head + (row0 + i) · row of m_run, l and acc
// (head < 0: qn, the dense (B, Hq, qn) order; forward_packed passes its (T, Hq) order).
struct State {
  int64_t head = -1, row = 1, row0 = 0;
};

template <class Tiles>
void forward_segment(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, torch::Tensor& m_run,
                     torch::Tensor& l, torch::Tensor& acc, double alpha, int64_t q0, int64_t k0, const Mods& mods,
                     const std::optional<torch::Tensor>& mask, double softcap, State state = State{}) {
  using Op = typename Tiles::Op;
  const int64_t batch = q.size(0), hq = q.size(1), qn = q.size(2), e = q.size(3);
  const int64_t hk = k.size(1), kn = k.size(2), ev = v.size(3);
  TORCH_CHECK(k.size(0) == batch && v.size(0) == batch && v.size(1) == hk && v.size(2) == kn && k.size(3) == e,
              "q, k, v: shapes (B, Hq, qn, E), (B, Hk, kn, E), (B, Hk, kn, Ev)");
  TORCH_CHECK(hk > 0 && hq % hk == 0, "q, k: the query heads must be a multiple of the key heads");
  const int64_t s_head = state.head < 0 ? qn : state.head, s_row = state.row, s_row0 = state.row0;
  if (state.head < 0) {
    const int64_t rows_all = batch * hq * qn;
    for (const auto& t : {m_run, l}) check_rows(t, rows_all, "m_run, l");
    TORCH_CHECK(acc.scalar_type() == torch::kFloat && acc.is_contiguous() && acc.numel() == rows_all * ev &&
                    acc.device().is_cpu(),
                "acc: a contiguous float32 CPU tensor of (rows, Ev)");
  }
  const int64_t mask_kind = mask.has_value() ? mask_kind_of(*mask, batch, hq, qn, kn) : kNoMask;
  TORCH_CHECK(!mods.alibi() || static_cast<int64_t>(mods.slopes.size()) == hq, "slopes: one per query head");
  const bool additive = mask_kind != kNoMask || mods.alibi();  // the scores get a row added (additive_row)
  if (batch * hq * qn == 0 || kn == 0) return;
  const int64_t group = hq / hk, bhq = batch * hq, bhk = batch * hk;
  const int64_t qw = Tiles::q_width(e), npad = round_up(kn, 32), ev16 = (ev + 15) / 16, evp = ev16 * 16;
  // Keys and values in the layouts the products read (Tiles::keys, Tiles::values).
  const auto kp = Tiles::keys(k, npad);
  const auto vp = Tiles::values(v, npad, evp);
  const auto* kd = reinterpret_cast<const Op*>(kp.data_ptr());
  const auto* vd = reinterpret_cast<const Op*>(vp.data_ptr());
  // Blocks of kSegmentRows rows, fewer where that leaves too few tasks for the threads.
  int64_t qb = kSegmentRows;
  while (qb > 16 && bhq * ((qn + qb - 1) / qb) < 4 * at::get_num_threads()) qb /= 2;
  const int64_t nqb = (qn + qb - 1) / qb, kb = std::min(kSegmentKeys, npad);  // short calls: smaller buffers
  float* mp = m_run.data_ptr<float>();
  float* lp = l.data_ptr<float>();
  float* ap = acc.data_ptr<float>();
  const float a = static_cast<float>(alpha);
  TORCH_CHECK(softcap >= 0.0, "softcap: 0 (none) or the cap c of c · tanh(score / c)");
  const bool capped = softcap > 0.0;
  const float zc = capped ? static_cast<float>(alpha / (softcap * kLog2e)) : 0.0f;  // scale / c
  const float yc = static_cast<float>(softcap * kLog2e);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  // Tasks are handed out one at a time (a shared counter), not in one fixed share per thread: a
  // thread whose core the VM slows takes fewer of them instead of holding up the call.
  const int64_t tasks = bhq * nqb;
  std::atomic<int64_t> next_task{0};
  const bool aten = aten_products_on<Tiles>();
  at::parallel_for(0, std::min<int64_t>(tasks, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    const ProductsScope products(aten, Tiles::kStep == 2);
    std::vector<Op> q_buf(static_cast<size_t>(qb * qw), Op(0));
    std::vector<float> s_buf(static_cast<size_t>(qb * kb));
    std::vector<Op> p_buf(std::is_same_v<Op, float> ? 0 : static_cast<size_t>(qb * kb));  // float p: over s
    std::vector<float> pv_buf(static_cast<size_t>(qb * evp));
    std::vector<float> c_buf(static_cast<size_t>(qb));
    std::vector<float> mask_buf(additive ? static_cast<size_t>(kb) : 0);
    for (int64_t t = next_task++; t < tasks; t = next_task++) {
      const int64_t bh = t / nqb, i0 = (t % nqb) * qb, rows = std::min(qb, qn - i0);
      const int64_t b = bh / hq, h = bh % hq, kvh = b * hk + h / group;
      // Keys [j_first, j_end) are seen by some row of the task: the products start at the block of
      // 32 that holds its first row's first key and stop at its last row's last key.
      const int64_t at0 = q0 + i0 - k0;  // the diagonal's key on the task's first row
      int64_t j_first = mods.first(at0, kn) / 32 * 32, j_end = mods.end(at0 + rows - 1, kn, 0);
      mods.narrow_rows(b, i0, rows, kn, j_first, j_end);
      if (j_end <= j_first) continue;
      for (int64_t r = 0; r < rows; ++r)
        Tiles::q_row(q, b * q.stride(0) + h * q.stride(1) + (i0 + r) * q.stride(2), e, q_buf.data() + r * qw);
      for (int64_t j0 = j_first; j0 < j_end; j0 += kb) {
        const int64_t nb = std::min(kb, j_end - j0);  // p is 0 beyond the last key a row sees
        const int64_t nbp = round_up(nb, Tiles::kStep);
        float* s = s_buf.data();
        Tiles::scores(q_buf.data(), e, kd, kvh, npad, j0, nb, rows, s, kb);
        Op* p;
        if constexpr (std::is_same_v<Op, float>) p = s;  // each p overwrites its own score
        else p = p_buf.data();
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t row = bh * s_head + (s_row0 + i0 + r) * s_row;
          const int64_t at = at0 + r - j0;  // the row's diagonal in this block
          int64_t from = mods.first(at, nb), vis = mods.end(at, nb, from);  // it sees keys [from, vis)
          mods.narrow(b, i0 + r, j0, nb, from, vis);
          float* x = s + r * kb + from;
          const int64_t n = vis - from;
          float mx = neg_inf, mul = a;
          if (capped) {  // x = c · tanh(scale · q·k / c) in log2 units
#pragma omp simd
            for (int64_t j = 0; j < n; ++j) x[j] = tanh_approx(x[j] * zc) * yc;
            mul = 1.0f;
          }
          float p_mul = 1.0f;  // p = 2^(x · p_mul - ref)
          if (!additive && mul > 0.0f) {
            // x stays as the product gave it: max(mul · x) = mul · max(x) (rounding keeps the
            // order), and mul is the exponentials' FMA.
            float raw = neg_inf;
#pragma omp simd reduction(max : raw)
            for (int64_t j = 0; j < n; ++j) raw = x[j] > raw ? x[j] : raw;
            mx = raw * mul;
            p_mul = mul;
          } else if (!additive) {
#pragma omp simd reduction(max : mx)
            for (int64_t j = 0; j < n; ++j) {
              const float y = x[j] * mul;
              x[j] = y;
              mx = y > mx ? y : mx;
            }
          } else {
            float* mb = mask_buf.data();
            additive_row(mask, mask_kind, mods, b, h, i0 + r, j0 + from, n, at + mods.shift - from, mb);
#pragma omp simd reduction(max : mx)
            for (int64_t j = 0; j < n; ++j) {
              const float y = x[j] * mul + mb[j];
              x[j] = y;
              mx = y > mx ? y : mx;
            }
          }
          const float old = mp[row];
          float m_new = mx > old ? mx : old;
          if (std::isnan(old) || std::isnan(mx)) m_new = std::numeric_limits<float>::quiet_NaN();
          const float ref = m_new == neg_inf ? 0.0f : m_new;  // rows with nothing visible yet stay finite
          c_buf[r] = std::exp2(old - ref);
          Op* pr = p + r * kb;
          for (int64_t j = 0; j < from; ++j) pr[j] = Op(0);
          const float sum = exp2_row<Op>(x, n, p_mul, ref, pr + from);
          for (int64_t j = vis; j < nbp; ++j) pr[j] = Op(0);
          lp[row] = lp[row] * c_buf[r] + sum;
          mp[row] = m_new;
        }
        Tiles::pv(p, kb, vd, kvh, npad, evp, j0, nb, rows, pv_buf.data());
        for (int64_t r = 0; r < rows; ++r) {
          float* arow = ap + (bh * s_head + (s_row0 + i0 + r) * s_row) * ev;
          const float* pvr = pv_buf.data() + r * evp;
          const float c = c_buf[r];
#pragma omp simd
          for (int64_t d = 0; d < ev; ++d) arow[d] = arow[d] * c + pvr[d];
        }
      }
    }
  });
}

}  // namespace

// forward_segment for float32 or float16 inputs (all one dtype): float32 products (FMA). Its Mods
// from causal, causal_offset, window_lo, window_hi, slopes and alibi_shift (mods_of).
void forward_segment_f32(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor m_run, torch::Tensor l,
                         torch::Tensor acc, double alpha, int64_t q0, int64_t k0, bool causal, int64_t causal_offset,
                         std::optional<torch::Tensor> mask, double softcap, std::optional<int64_t> window_lo,
                         std::optional<int64_t> window_hi, std::optional<torch::Tensor> slopes, int64_t alibi_shift,
                         std::optional<torch::Tensor> ranges) {
  check_inputs({q, k, v}, "q, k, v", true);
  const Mods mods = mods_of(causal, causal_offset, window_lo, window_hi, slopes, alibi_shift, q.size(1), ranges,
                             q.size(0), q.size(2));
  forward_segment<WideTiles>(q, k, v, m_run, l, acc, alpha, q0, k0, mods, mask, softcap);
}

namespace {

// Packed sequences, one forward_segment each, in one call: spans (n, 4) int64 holds each
// sequence's query rows [qs, qe) of q (1, Hq, Tq, E) and keys [ks, ke) of k, v (1, Hk, Tk, ·)
// (the caller's (T, H, ·) layout, viewed); causal, query i sees key j where j <= i + offsets[s]
// (positions within the sequence; offsets: n int64). spans, offsets: contiguous CPU tensors.
// m_run, l: (Tq · Hq) and acc (Tq · Hq, Ev), contiguous float32, in the packed order (row-major,
// as the caller's output); the rows of no sequence are left as they are. No mask: the calls
// whose packed sequences share a call (plain ones).
template <class Tiles>
void forward_packed(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& spans,
                    const torch::Tensor& offsets, torch::Tensor& m_run, torch::Tensor& l, torch::Tensor& acc,
                    double alpha, bool causal, double softcap) {
  TORCH_CHECK(q.size(0) == 1 && k.size(0) == 1 && v.size(0) == 1, "q, k, v: packed sequences (1, H, T, ·)");
  const int64_t n = offsets.numel();
  for (const auto& t : {spans, offsets})
    TORCH_CHECK(t.scalar_type() == torch::kLong && t.is_contiguous() && t.device().is_cpu(),
                "spans, offsets: contiguous int64 CPU tensors");
  TORCH_CHECK(offsets.dim() == 1 && spans.dim() == 2 && spans.size(0) == n && spans.size(1) == 4,
              "spans: (n, 4) [qs, qe, ks, ke] of the n sequences of offsets");
  const int64_t* sp = spans.data_ptr<int64_t>();
  const int64_t* off = offsets.data_ptr<int64_t>();
  const int64_t tq = q.size(2), tk = k.size(2), hq = q.size(1), ev = v.size(3);
  for (const auto& t : {m_run, l}) check_rows(t, tq * hq, "m_run, l");
  TORCH_CHECK(acc.scalar_type() == torch::kFloat && acc.is_contiguous() && acc.numel() == tq * hq * ev &&
                  acc.device().is_cpu(),
              "acc: a contiguous float32 CPU tensor of (Tq · Hq, Ev)");
  for (int64_t s = 0; s < n; ++s) {
    const int64_t* r = sp + 4 * s;
    TORCH_CHECK(0 <= r[0] && r[0] <= r[1] && r[1] <= tq && 0 <= r[2] && r[2] <= r[3] && r[3] <= tk,
                "spans: [qs, qe, ks, ke] within q's and k's lengths");
  }
  const std::optional<torch::Tensor> none;
  for (int64_t s = 0; s < n; ++s) {
    const int64_t* r = sp + 4 * s;
    if (r[1] == r[0]) continue;
    const auto qs = q.narrow(2, r[0], r[1] - r[0]);
    const auto ks = k.narrow(2, r[2], r[3] - r[2]), vs = v.narrow(2, r[2], r[3] - r[2]);
    const Mods mods = mods_of(causal, off[s], std::nullopt, std::nullopt, std::nullopt, 0, hq);
    forward_segment<Tiles>(qs, ks, vs, m_run, l, acc, alpha, 0, 0, mods, none, softcap, State{1, hq, r[0]});
  }
}

}  // namespace

// forward_packed for float32 or float16 inputs.
void forward_packed_f32(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor spans, torch::Tensor offsets,
                        torch::Tensor m_run, torch::Tensor l, torch::Tensor acc, double alpha, bool causal,
                        double softcap) {
  check_inputs({q, k, v}, "q, k, v", true);
  forward_packed<WideTiles>(q, k, v, spans, offsets, m_run, l, acc, alpha, causal, softcap);
}

namespace {

constexpr int64_t kBackRows = 128;  // the backward's rows per block
constexpr int64_t kBackKeys = 128;  // and keys per step; a multiple of 32

void check_grad(const torch::Tensor& t, std::initializer_list<int64_t> shape, const char* what) {
  TORCH_CHECK(t.dim() == 4 && t.sizes() == c10::IntArrayRef(shape) && t.scalar_type() == torch::kFloat &&
                  (t.stride(3) == 1 || t.size(3) <= 1) && t.device().is_cpu(),
              what, ": float32 CPU tensors of last stride 1, shaped as their input");
}

// dst (b, h, rows i0.., d columns of a float32 4-D tensor, last stride 1) += src (rows x ld).
void add_rows(torch::Tensor& dst, int64_t b, int64_t h, int64_t i0, int64_t rows, const float* src, int64_t ld) {
  float* base = dst.data_ptr<float>() + b * dst.stride(0) + h * dst.stride(1);
  const int64_t d = dst.size(3);
  for (int64_t r = 0; r < rows; ++r) {
    float* o = base + (i0 + r) * dst.stride(2);
    const float* x = src + r * ld;
#pragma omp simd
    for (int64_t c = 0; c < d; ++c) o[c] += x[c];
  }
}


// The backward of one segment of keys for a block of query rows (FlashAttention-2's), every
// product with float32 accumulation (Tiles: vdpbf16ps or FMA, as in forward_segment). Per task (a batch entry and key head, with all
// of its query heads, so that dQ, dK and dV each have one writer), per block of kBackRows rows, per
// block of kBackKeys keys:
//   s = alpha · q·kᵀ (+ mask) in float32, log2 units; p = 2^(s - lse2); dp = dO·vᵀ;
//   ds = scale · p ∘ (dp - D); p and ds rounded once to the operands' type;
//   dV += pᵀ·dO, dK += dsᵀ·q (in the task's float32 buffers), dQ += ds·k.
// q, dout: (B, Hq, qn, E / Ev), k, v: (B, Hk, kn, E / Ev), last stride 1. lse2: the
// forward's lse in log2 units (+inf for rows that see nothing), dd: rowsum(dO ∘ O) minus the lse's
// gradient, both (B·Hq·qn) float32, contiguous. dq, dk, dv: float32 (B, Hq, qn, E), (B, Hk, kn, E),
// (B, Hk, kn, Ev), last stride 1, added into. alpha = scale · log2 e. mods, mask and softcap as in
// forward_segment (with a cap, ds also takes the factor 1 - tanh²; ALiBi's bias and the mask, whose
// derivatives in the score are 1, are only added to s). Keys and values are first copied into
// three layouts (keys for q·kᵀ and ds·k, values for dO·vᵀ): segment-sized copies.
template <class Tiles>
void backward_segment(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& dout,
                      const torch::Tensor& lse2, const torch::Tensor& dd, torch::Tensor& dq, torch::Tensor& dk,
                      torch::Tensor& dv, double alpha, double scale, int64_t q0, int64_t k0, const Mods& mods,
                      const std::optional<torch::Tensor>& mask, double softcap) {
  using Op = typename Tiles::Op;
  constexpr int64_t step = Tiles::kStep;
  const int64_t batch = q.size(0), hq = q.size(1), qn = q.size(2), e = q.size(3);
  const int64_t hk = k.size(1), kn = k.size(2), ev = v.size(3);
  TORCH_CHECK(k.size(0) == batch && v.size(0) == batch && v.size(1) == hk && v.size(2) == kn && k.size(3) == e,
              "q, k, v: shapes (B, Hq, qn, E), (B, Hk, kn, E), (B, Hk, kn, Ev)");
  TORCH_CHECK(dout.size(0) == batch && dout.size(1) == hq && dout.size(2) == qn && dout.size(3) == ev,
              "dout: shape (B, Hq, qn, Ev)");
  TORCH_CHECK(hk > 0 && hq % hk == 0, "q, k: the query heads must be a multiple of the key heads");
  check_grad(dq, {batch, hq, qn, e}, "dq");
  check_grad(dk, {batch, hk, kn, e}, "dk");
  check_grad(dv, {batch, hk, kn, ev}, "dv");
  const int64_t rows_all = batch * hq * qn;
  for (const auto& t : {lse2, dd}) check_rows(t, rows_all, "lse2, dd");
  const int64_t mask_kind = mask.has_value() ? mask_kind_of(*mask, batch, hq, qn, kn) : kNoMask;
  TORCH_CHECK(!mods.alibi() || static_cast<int64_t>(mods.slopes.size()) == hq, "slopes: one per query head");
  const bool additive = mask_kind != kNoMask || mods.alibi();  // s gets a row added (additive_row)
  if (rows_all == 0 || kn == 0) return;
  const int64_t group = hq / hk, qb = kBackRows, kb = kBackKeys;
  const int64_t qw = Tiles::q_width(e), ow = Tiles::q_width(ev), ep = round_up(e, 16), evp = round_up(ev, 16);
  const int64_t npad = round_up(kn, 32);
  const auto kp = Tiles::keys(k, npad);         // s = q·kᵀ
  const auto vt = Tiles::keys(v, npad);         // dp = dO·vᵀ
  const auto kr = Tiles::values(k, npad, ep);   // dQ += ds·k
  const auto* kpd = reinterpret_cast<const Op*>(kp.data_ptr());
  const auto* vtd = reinterpret_cast<const Op*>(vt.data_ptr());
  const auto* krd = reinterpret_cast<const Op*>(kr.data_ptr());
  const float* l2p = lse2.data_ptr<float>();
  const float* ddp = dd.data_ptr<float>();
  const float a = static_cast<float>(alpha), sc = static_cast<float>(scale);
  TORCH_CHECK(softcap >= 0.0, "softcap: 0 (none) or the cap c of c · tanh(score / c)");
  const bool capped = softcap > 0.0;
  const float zc = capped ? static_cast<float>(alpha / (softcap * kLog2e)) : 0.0f;  // scale / c
  const float yc = static_cast<float>(softcap * kLog2e);
  const int64_t tasks = batch * hk;
  std::atomic<int64_t> next_task{0};
  const bool aten = aten_products_on<Tiles>();
  at::parallel_for(0, std::min<int64_t>(tasks, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    const ProductsScope products(aten, Tiles::kStep == 2);
    std::vector<Op> q_flat(static_cast<size_t>(qb * qw)), q_pair(static_cast<size_t>(qb * ep), Op(0));
    std::vector<Op> o_flat(static_cast<size_t>(qb * ow)), o_pair(static_cast<size_t>(qb * evp), Op(0));
    std::vector<float> s_buf(static_cast<size_t>(qb * kb)), dp_buf(static_cast<size_t>(qb * kb));
    std::vector<Op> pt(static_cast<size_t>(kb * qb)), ds(static_cast<size_t>(qb * kb)), dst(static_cast<size_t>(kb * qb));
    std::vector<float> dq_buf(static_cast<size_t>(qb * ep));
    std::vector<float> dk_acc(static_cast<size_t>(npad * ep)), dv_acc(static_cast<size_t>(npad * evp));
    std::vector<float> mask_buf(additive ? static_cast<size_t>(kb) : 0);
    std::vector<float> cap_grad(capped ? static_cast<size_t>(kb) : 0);  // 1 - tanh², the cap's derivative
    for (int64_t t = next_task++; t < tasks; t = next_task++) {
      const int64_t b = t / hk, kh = t % hk, kvh = t;
      std::fill(dk_acc.begin(), dk_acc.end(), 0.0f);
      std::fill(dv_acc.begin(), dv_acc.end(), 0.0f);
      for (int64_t h = kh * group; h < (kh + 1) * group; ++h) {
        for (int64_t i0 = 0; i0 < qn; i0 += qb) {
          const int64_t rows = std::min(qb, qn - i0), rows2 = round_up(rows, step);
          // Keys [j_first, j_end) of the segment are seen by some row of the block (from a block of 32).
          const int64_t at0 = q0 + i0 - k0;  // the diagonal's key on the block's first row
          int64_t j_first = mods.first(at0, kn) / 32 * 32, j_end = mods.end(at0 + rows - 1, kn, 0);
          mods.narrow_rows(b, i0, rows, kn, j_first, j_end);
          if (j_end <= j_first) continue;
          Tiles::pack_rows(q, b, h, i0, rows, q_flat.data(), q_pair.data(), ep);
          Tiles::pack_rows(dout, b, h, i0, rows, o_flat.data(), o_pair.data(), evp);
          std::fill(dq_buf.begin(), dq_buf.end(), 0.0f);
          for (int64_t j0 = j_first; j0 < j_end; j0 += kb) {
            const int64_t nb = std::min(kb, j_end - j0), nb2 = round_up(nb, step);  // seen keys
            float* s = s_buf.data();
            float* dp = dp_buf.data();
            Tiles::scores(q_flat.data(), e, kpd, kvh, npad, j0, nb, rows, s, kb);
            Tiles::scores(o_flat.data(), ev, vtd, kvh, npad, j0, nb, rows, dp, kb);
            for (int64_t r = 0; r < rows2; ++r) {
              Op* dsr = ds.data() + r * kb;
              const int64_t at = at0 + r - j0;  // the row's diagonal in this block
              int64_t from = r < rows ? mods.first(at, nb) : 0;
              int64_t vis = r < rows ? mods.end(at, nb, from) : 0;  // the row sees keys [from, vis)
              if (r < rows) mods.narrow(b, i0 + r, j0, nb, from, vis);
              if (vis > from) {
                const int64_t row = (b * hq + h) * qn + i0 + r, n = vis - from;
                const float l2 = l2p[row], d_row = ddp[row];
                float* x = s + r * kb + from;
                const float* y = dp + r * kb + from;
                float mul = a;
                float* g = cap_grad.data();
                if (capped) {  // x = c · tanh(scale · q·k / c) in log2 units; g = its derivative's factor
#pragma omp simd
                  for (int64_t j = 0; j < n; ++j) {
                    const float th = tanh_approx(x[j] * zc);
                    g[j] = 1.0f - th * th;
                    x[j] = th * yc;
                  }
                  mul = 1.0f;
                }
                if (additive) {
                  additive_row(mask, mask_kind, mods, b, h, i0 + r, j0 + from, n, at + mods.shift - from,
                               mask_buf.data());
                  const float* mb = mask_buf.data();
#pragma omp simd
                  for (int64_t j = 0; j < n; ++j) x[j] = x[j] * mul + mb[j];
                } else {
#pragma omp simd
                  for (int64_t j = 0; j < n; ++j) x[j] = x[j] * mul;
                }
                // P and dS (times the cap's derivative, `factor`), in their three layouts. One loop
                // per factor: a test of `capped` inside it made the plain backward about 1.5x slower.
                auto p_and_ds = [&](auto factor) {
                  for (int64_t j = 0; j < n; ++j) {
                    const float pj = exp2_approx(x[j] - l2);
                    const Op pb = Tiles::round(pj);
                    const Op db = Tiles::round(sc * pj * (y[j] - d_row) * factor(j));
                    dsr[from + j] = db;
                    pt[(from + j) * qb + r] = pb;
                    dst[(from + j) * qb + r] = db;
                  }
                };
                if (capped) {
                  p_and_ds([g](int64_t j) { return g[j]; });
                } else {
                  p_and_ds([](int64_t) { return 1.0f; });
                }
              }
              for (int64_t j = 0; j < from; ++j) dsr[j] = pt[j * qb + r] = dst[j * qb + r] = Op(0);
              for (int64_t j = vis; j < nb2; ++j) dsr[j] = Op(0);
              for (int64_t j = vis; j < nb; ++j) pt[j * qb + r] = dst[j * qb + r] = Op(0);
            }
            Tiles::template over_rows<true>(pt.data(), qb, o_pair.data(), evp, rows2, dv_acc.data() + j0 * evp, evp,
                                            nb, evp / 16);
            Tiles::template over_rows<true>(dst.data(), qb, q_pair.data(), ep, rows2, dk_acc.data() + j0 * ep, ep, nb,
                                            ep / 16);
            Tiles::template pv<true>(ds.data(), kb, krd, kvh, npad, ep, j0, nb, rows, dq_buf.data());
          }
          add_rows(dq, b, h, i0, rows, dq_buf.data(), ep);
        }
      }
      add_rows(dk, b, kh, 0, kn, dk_acc.data(), ep);
      add_rows(dv, b, kh, 0, kn, dv_acc.data(), evp);
    }
  });
}

}  // namespace

// backward_segment for float32 or float16 inputs (q, k, v and dout of one dtype): float32 products.
void backward_segment_f32(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor dout, torch::Tensor lse2,
                          torch::Tensor dd, torch::Tensor dq, torch::Tensor dk, torch::Tensor dv, double alpha,
                          double scale, int64_t q0, int64_t k0, bool causal, int64_t causal_offset,
                          std::optional<torch::Tensor> mask, double softcap, std::optional<int64_t> window_lo,
                          std::optional<int64_t> window_hi, std::optional<torch::Tensor> slopes, int64_t alibi_shift,
                         std::optional<torch::Tensor> ranges) {
  check_inputs({q, k, v, dout}, "q, k, v, dout", true);
  const Mods mods = mods_of(causal, causal_offset, window_lo, window_hi, slopes, alibi_shift, q.size(1), ranges,
                             q.size(0), q.size(2));
  backward_segment<WideTiles>(q, k, v, dout, lse2, dd, dq, dk, dv, alpha, scale, q0, k0, mods, mask, softcap);
}

#if defined(__AVX512BF16__)
// forward_segment for bfloat16 inputs: p rounded to bfloat16, products on vdpbf16ps.
void forward_segment_bf16(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor m_run, torch::Tensor l,
                          torch::Tensor acc, double alpha, int64_t q0, int64_t k0, bool causal, int64_t causal_offset,
                          std::optional<torch::Tensor> mask, double softcap, std::optional<int64_t> window_lo,
                          std::optional<int64_t> window_hi, std::optional<torch::Tensor> slopes, int64_t alibi_shift,
                         std::optional<torch::Tensor> ranges) {
  check_bf16({q, k, v}, "q, k, v");
  const Mods mods = mods_of(causal, causal_offset, window_lo, window_hi, slopes, alibi_shift, q.size(1), ranges,
                             q.size(0), q.size(2));
  forward_segment<PairTiles>(q, k, v, m_run, l, acc, alpha, q0, k0, mods, mask, softcap);
}

// forward_packed for bfloat16 inputs.
void forward_packed_bf16(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor spans, torch::Tensor offsets,
                         torch::Tensor m_run, torch::Tensor l, torch::Tensor acc, double alpha, bool causal,
                         double softcap) {
  check_bf16({q, k, v}, "q, k, v");
  forward_packed<PairTiles>(q, k, v, spans, offsets, m_run, l, acc, alpha, causal, softcap);
}

// backward_segment for bfloat16 inputs: p and ds rounded to bfloat16, products on vdpbf16ps.
void backward_segment_bf16(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor dout, torch::Tensor lse2,
                           torch::Tensor dd, torch::Tensor dq, torch::Tensor dk, torch::Tensor dv, double alpha,
                           double scale, int64_t q0, int64_t k0, bool causal, int64_t causal_offset,
                           std::optional<torch::Tensor> mask, double softcap, std::optional<int64_t> window_lo,
                           std::optional<int64_t> window_hi, std::optional<torch::Tensor> slopes,
                           int64_t alibi_shift, std::optional<torch::Tensor> ranges) {
  check_bf16({q, k, v, dout}, "q, k, v, dout");
  const Mods mods = mods_of(causal, causal_offset, window_lo, window_hi, slopes, alibi_shift, q.size(1), ranges,
                             q.size(0), q.size(2));
  backward_segment<PairTiles>(q, k, v, dout, lse2, dd, dq, dk, dv, alpha, scale, q0, k0, mods, mask, softcap);
}
#endif  // __AVX512BF16__
#endif  // SUBQUAD_WIDE_LOOPS

namespace {

int products_bit(const std::string& which) {
  TORCH_CHECK(which == "float32" || which == "bfloat16",
              "which: 'float32' (the float32 and float16 loops) or 'bfloat16' (the bfloat16 ones), not '", which, "'");
  return which == "float32" ? kWideProducts : kPairProducts;
}

// Whether ATen's micro-kernels run here and give the products the loops expect: a small product of
// small integers (exact in every order of summation), B laid out as the loops lay it out (pairs of
// rows for bfloat16), a leading dimension wider than the product. False where this torch does
// not export them or oneDNN refuses the product on this CPU.
// One product of small integers (exact in any order of summation), M x N x K with B's leading
// dimension ldb and C's ldc, by ATen's micro-kernels in the loops' layout, against a plain loop.
bool aten_product_exact(bool pairs, int64_t M, int64_t N, int64_t K, int64_t ldb, int64_t ldc) {
#if defined(SUBQUAD_ATEN_PRODUCTS)
  std::vector<float> a(M * K), b(K * N), want(M * ldc, 0.0f), got(M * ldc, 0.0f);
  for (int64_t i = 0; i < M * K; ++i) a[i] = static_cast<float>(i % 7) - 3.0f;
  for (int64_t i = 0; i < K * N; ++i) b[i] = static_cast<float>(i % 5) - 2.0f;
  for (int64_t i = 0; i < M; ++i)
    for (int64_t c = 0; c < K; ++c)
      for (int64_t j = 0; j < N; ++j) want[i * ldc + j] += a[i * K + c] * b[c * N + j];
  if (pairs) {
    std::vector<at::BFloat16> a16(M * K), b16(round_up(K, 2) * ldb, at::BFloat16(0.0f));
    for (int64_t i = 0; i < M * K; ++i) a16[i] = at::BFloat16(a[i]);
    for (int64_t c = 0; c < K; ++c)
      for (int64_t j = 0; j < N; ++j) b16[(c / 2) * ldb * 2 + j * 2 + c % 2] = at::BFloat16(b[c * N + j]);
    at::native::cpublas::brgemm(M, N, K, K, ldb, ldc, false, a16.data(), b16.data(), got.data(), true);
    at::native::cpublas::brgemm_release(true);
  } else {
    std::vector<float> bw(K * ldb, 0.0f);
    for (int64_t c = 0; c < K; ++c)
      for (int64_t j = 0; j < N; ++j) bw[c * ldb + j] = b[c * N + j];
    at::native::cpublas::brgemm(M, N, K, K, ldb, ldc, false, a.data(), bw.data(), got.data(), false);
  }
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j)
      if (got[i * ldc + j] != want[i * ldc + j]) return false;
  return true;
#else
  (void)pairs, (void)M, (void)N, (void)K, (void)ldb, (void)ldc;
  return false;
#endif
}

// Whether ATen's micro-kernels run here and give the products the loops expect, on the shapes the
// loops ask of them: a tiny one, a block of rows by a block of keys over a head dim with a pair
// left over, and a full block of keys; leading dimensions wider than the products. False where
// this torch does not export them or oneDNN refuses or miscomputes one of them on this CPU.
bool check_aten_products(bool pairs) {
  try {
    return aten_product_exact(pairs, 3, 32, 6, 48, 40) && aten_product_exact(pairs, 37, 144, 58, 160, 150) &&
           aten_product_exact(pairs, 64, 512, 128, 528, 512);
  } catch (const std::exception&) {
    return false;
  }
}

// check_aten_products, once per kind of products in the process.
bool aten_products_work(const std::string& which) {
  static const bool wide = check_aten_products(false), pairs = check_aten_products(true);
  return products_bit(which) == kPairProducts ? pairs : wide;
}

// The loops of `which` ("float32" or "bfloat16") multiply on ATen's micro-kernels (aten) or on
// their own (the default), from their next call on.
void set_products(const std::string& which, bool aten) {
  const int bit = products_bit(which);
  TORCH_CHECK(!aten || aten_products_work(which), "ATen's micro-kernels do not run the ", which,
              " products here (torch without cpublas::brgemm, or oneDNN refused them on this CPU)");
  if (aten) g_aten_products.fetch_or(bit);
  else g_aten_products.fetch_and(~bit);
}

// "aten" or "own": what the loops of `which` multiply on.
std::string products(const std::string& which) {
  return (g_aten_products.load() & products_bit(which)) ? "aten" : "own";
}

// For tests only: the next n of ATen's products (any kind, any thread) throw before they run
// (refuse_for_tests); returns how many of the previous setting had not thrown yet.
int64_t fail_aten_products(int64_t n) {
  TORCH_CHECK(n >= 0, "n: how many of ATen's products to refuse (0 or more), not ", n);
  return g_fail_aten_products.exchange(n);
}

}  // namespace

#if defined(SUBQUAD_WIDE_LOOPS)
namespace {

// The built-in mods' arguments of the loops, last and optional (no band, no ALiBi), so that a
// call without them reads as before.
auto mods_args() {
  return std::make_tuple(py::arg("window_lo") = py::none(), py::arg("window_hi") = py::none(),
                         py::arg("slopes") = py::none(), py::arg("alibi_shift") = 0, py::arg("ranges") = py::none());
}

auto forward_args() {
  return std::tuple_cat(std::make_tuple(py::arg("q"), py::arg("k"), py::arg("v"), py::arg("m_run"), py::arg("l"),
                                        py::arg("acc"), py::arg("alpha"), py::arg("q0"), py::arg("k0"),
                                        py::arg("causal"), py::arg("causal_offset"), py::arg("mask"),
                                        py::arg("softcap")),
                        mods_args());
}

auto backward_args() {
  return std::tuple_cat(std::make_tuple(py::arg("q"), py::arg("k"), py::arg("v"), py::arg("dout"), py::arg("lse2"),
                                        py::arg("dd"), py::arg("dq"), py::arg("dk"), py::arg("dv"), py::arg("alpha"),
                                        py::arg("scale"), py::arg("q0"), py::arg("k0"), py::arg("causal"),
                                        py::arg("causal_offset"), py::arg("mask"), py::arg("softcap")),
                        mods_args());
}

// m.def(name, f, doc, the arguments of args).
template <class F, class Args>
void def_loop(py::module_& m, const char* name, F f, const char* doc, const Args& args) {
  std::apply([&](const auto&... a) { m.def(name, f, doc, a...); }, args);
}

}  // namespace
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("exp2_rows_bf16", &exp2_rows_bf16, "one pass of a bfloat16 tile's online softmax (_native_tiles.cpp)");
  m.def("softmax_grad_rows_bf16", &softmax_grad_rows_bf16, "P and dS of a bfloat16 tile in one pass (_native_tiles.cpp)");
  m.def("next_offsets", &next_offsets, "a forward tile's next offsets and far rows (_native_tiles.cpp)");
  m.def("online_update", &online_update, "the online softmax's state after a tile (_native_tiles.cpp)");
  m.def("aten_products_work", &aten_products_work, "whether ATen's micro-kernels run the loops' products here",
        py::arg("which"));
  m.def("set_products", &set_products, "the loops' products: ATen's micro-kernels or their own", py::arg("which"),
        py::arg("aten"));
  m.def("products", &products, "what the loops of `which` multiply on: 'aten' or 'own'", py::arg("which"));
  m.def("_fail_aten_products", &fail_aten_products,
        "for tests only: the next n of ATen's products throw (the loops fall back to their own); returns the "
        "previous setting's n not yet thrown",
        py::arg("n"));
#if defined(SUBQUAD_WIDE_LOOPS)
  m.attr("float_lanes") = Lanes::kWidth;  // 16: AVX512F; 8: AVX2 (auto leaves those loops to backend="matmul")
  const auto forward = forward_args();
  const auto backward = backward_args();
  def_loop(m, "forward_segment_f32", &forward_segment_f32, "the same for float32 or float16 inputs (_native_tiles.cpp)",
           forward);
  def_loop(m, "backward_segment_f32", &backward_segment_f32,
           "the same for float32 or float16 inputs (_native_tiles.cpp)", backward);
  m.def("forward_packed_f32", &forward_packed_f32, "packed sequences' forward loops (_native_tiles.cpp)");
#endif
#if defined(__AVX512BF16__)
  def_loop(m, "forward_segment_bf16", &forward_segment_bf16, "a segment of keys for a block of rows (_native_tiles.cpp)",
           forward);
  def_loop(m, "backward_segment_bf16", &backward_segment_bf16,
           "the backward of a segment for a block of rows (_native_tiles.cpp)", backward);
  m.def("forward_packed_bf16", &forward_packed_bf16, "packed sequences' forward loops (_native_tiles.cpp)");
#endif
}
