// subquad's native tile kernels (optional; built on request by subquad._native, see there).
//
// Each makes one pass over bfloat16 tiles, row by row, a row held in the core's own cache, where
// eager PyTorch makes several passes over the whole tile, each streaming it through the shared
// cache. Forward: the rows' maximum, 2^(x - shift), the row sums and the rounding back to
// bfloat16 (eager: a conversion, amax, a subtraction, exp2, sum and a cast). Backward: P and dS
// from the offset products S - lse and dP - D (eager: two conversions, a subtraction, two
// multiplications, exp2, an addition, a subtraction and two casts).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

namespace {

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
// made the forward pass 15-20% slower (one thread, 2M scores: 1131 against 920-980 us).
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
  const float log2e = 1.4426950408889634f;
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
// where not finite) is written to col as -bf16(o / alpha) and returned as bf16(o / alpha) · alpha.
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
      const uint16_t h = float_to_bf16(o / a);
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("exp2_rows_bf16", &exp2_rows_bf16, "one pass of a bfloat16 tile's online softmax (_native_tiles.cpp)");
  m.def("softmax_grad_rows_bf16", &softmax_grad_rows_bf16, "P and dS of a bfloat16 tile in one pass (_native_tiles.cpp)");
  m.def("next_offsets", &next_offsets, "a forward tile's next offsets and far rows (_native_tiles.cpp)");
  m.def("online_update", &online_update, "the online softmax's state after a tile (_native_tiles.cpp)");
}
