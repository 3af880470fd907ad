// y = x @ W^T in float32 for a few rows of x, on AVX-512: see specroll_mcore/cpu_gemm.py.
//
// W [O, K] is packed once into panels of 16 outputs, [ceil(O / 16), K, 16] (outputs past O are
// zero), so that one 64-byte load holds one k of 16 outputs. A block of MB rows of x and OB
// panels keeps MB x OB accumulators in registers; each k loads OB panel vectors, broadcasts MB
// values of x and issues MB x OB fused multiply-adds. The weights stream from memory once per
// call whatever the row count (every row block runs on a group of panels while it is in cache),
// and no horizontal sums are needed.
//
// Every output is one fused multiply-add chain over k = 0 .. K-1 in order, whichever block,
// group or thread computes it: a row's result does not depend on the other rows in the call.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>

namespace {

constexpr int64_t kPanel = 16;    // outputs per panel: one AVX-512 float32 vector
constexpr int64_t kMaxBlock = 12; // rows of x per register block

// Panels per group for a block of `mb` rows: the most that keeps mb x ob accumulators, ob panel
// vectors and a broadcast within the 32 vector registers (one row streams 4 panels, so the
// loads of the weights, not the multiply-adds, set the pace).
constexpr int panels_for(int64_t mb) { return mb <= 3 ? 4 : (mb <= 6 ? 3 : 2); }

template <int MB, int OB>
void block(const float* x, int64_t ldx, const float* w, int64_t K, float* y, int64_t ldy, int64_t o0, int64_t O) {
  __m512 acc[OB][MB];
  for (int b = 0; b < OB; ++b)
    for (int m = 0; m < MB; ++m) acc[b][m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512 wv[OB];
    for (int b = 0; b < OB; ++b) wv[b] = _mm512_loadu_ps(w + (b * K + k) * kPanel);
    for (int m = 0; m < MB; ++m) {
      const __m512 xv = _mm512_set1_ps(x[m * ldx + k]);
      for (int b = 0; b < OB; ++b) acc[b][m] = _mm512_fmadd_ps(wv[b], xv, acc[b][m]);
    }
  }
  for (int b = 0; b < OB; ++b) {
    const int64_t o = o0 + b * kPanel;
    const int64_t n = std::min<int64_t>(kPanel, O - o);
    const __mmask16 mask = n >= kPanel ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
    for (int m = 0; m < MB; ++m) _mm512_mask_storeu_ps(y + m * ldy + o, mask, acc[b][m]);
  }
}

// Rows [0, MB) of x against panels [p, p + nb): a full group in one register block, a partial
// one (the last group of the matrix) panel by panel.
template <int MB>
void group(const float* x, int64_t ldx, const float* panels, int64_t K, float* y, int64_t ldy, int64_t O, int64_t p,
           int64_t nb) {
  constexpr int OB = panels_for(MB);
  if (nb == OB) {
    block<MB, OB>(x, ldx, panels + p * K * kPanel, K, y, ldy, p * kPanel, O);
  } else {
    for (int64_t q = p; q < p + nb; ++q) block<MB, 1>(x, ldx, panels + q * K * kPanel, K, y, ldy, q * kPanel, O);
  }
}

using GroupFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t, int64_t, int64_t);
const GroupFn kGroup[kMaxBlock + 1] = {nullptr,   group<1>, group<2>, group<3>,  group<4>,  group<5>, group<6>,
                                       group<7>,  group<8>, group<9>, group<10>, group<11>, group<12>};

}  // namespace

torch::Tensor pack_panels(const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kFloat32 && weight.device().is_cpu(),
              "pack_panels takes a 2-D float32 CPU weight [out, in]");
  const torch::Tensor w = weight.contiguous();
  const int64_t O = w.size(0), K = w.size(1), P = (O + kPanel - 1) / kPanel;
  torch::Tensor out = torch::zeros({P, K, kPanel}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t n = std::min<int64_t>(kPanel, O - p * kPanel);
      for (int64_t j = 0; j < n; ++j) {
        const float* row = src + (p * kPanel + j) * K;
        for (int64_t k = 0; k < K; ++k) dst[(p * K + k) * kPanel + j] = row[k];
      }
    }
  });
  return out;
}

torch::Tensor panel_linear(const torch::Tensor& x, const torch::Tensor& panels, int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.device().is_cpu() && x.stride(1) == 1,
              "panel_linear takes float32 CPU rows [n, in] with unit stride along in");
  TORCH_CHECK(panels.dim() == 3 && panels.size(1) == x.size(1) && panels.size(2) == kPanel && panels.is_contiguous() &&
                  panels.size(0) == (out_features + kPanel - 1) / kPanel,
              "panels do not match x [n, in] and out_features: pack the weight with pack_panels");
  const int64_t M = x.size(0), K = x.size(1), O = out_features, P = panels.size(0);
  torch::Tensor y = torch::empty({M, O}, x.options());
  if (M == 0) return y;
  const float* xp = x.data_ptr<float>();
  const float* wp = panels.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  // Rows in blocks of at most kMaxBlock, as even as possible (13 rows: 7 + 6, not 12 + 1).
  const int64_t blocks = (M + kMaxBlock - 1) / kMaxBlock, base = M / blocks, extra = M % blocks;
  const int ob = panels_for(base + (extra > 0 ? 1 : 0));  // the first (largest) block's group size
  const int64_t groups = (P + ob - 1) / ob;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t p = g * ob, nb = std::min<int64_t>(ob, P - p);
      int64_t m0 = 0;
      for (int64_t i = 0; i < blocks; ++i) {
        const int64_t mb = base + (i < extra ? 1 : 0);
        const float* xb = xp + m0 * ldx;
        float* yb = yp + m0 * O;
        if (panels_for(mb) == ob) {
          kGroup[mb](xb, ldx, wp, K, yb, O, O, p, nb);
        } else {  // a smaller block whose own group size differs: panel by panel
          for (int64_t q = p; q < p + nb; ++q) kGroup[mb](xb, ldx, wp, K, yb, O, O, q, 1);
        }
        m0 += mb;
      }
    }
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack_panels", &pack_panels, "W [out, in] float32 -> panels [ceil(out / 16), in, 16]");
  m.def("panel_linear", &panel_linear, "x [n, in] @ W^T from pack_panels(W) -> [n, out]");
}
