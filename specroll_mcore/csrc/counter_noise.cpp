// The counter-based sampler's uniforms on CPU: see specroll_mcore/sampling.py.
//
// h[r] = combine(combine(combine(combine(fmix32(seed ^ 0x5BD1E995), step), prompt[r]), sample[r]), position[r])
// with combine(h, x) = fmix32(h * 0x9E3779B1 + x + 0x7F4A7C15), all mod 2^32 (SampleKeys.row_hash), and
// u[r, j] = (fmix32(row_hash[r] ^ (ids[j] * 0x9E3779B1 mod 2^32)) + 0.5) / 2^32
//
// in uint32 arithmetic, one pass over the output. Torch's reference computes the same integers on
// int64 tensors (about a dozen passes, each with its own temporary), and the same float64 value from
// them: an integer below 2^32 plus 0.5, times a power of two, is exact in float64. The logarithms
// that turn u into Gumbel noise stay torch's, so the noise is bit for bit the reference's.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace {

constexpr uint32_t kGolden = 0x9E3779B1u;
constexpr double kInv32 = 1.0 / 4294967296.0;
constexpr int64_t kGrain = 16384;  // outputs per parallel task

inline uint32_t fmix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  return h ^ (h >> 16);
}

inline uint32_t combine(uint32_t h, int64_t x) {
  return fmix32(h * kGolden + static_cast<uint32_t>(x) + 0x7F4A7C15u);
}

// The row hashes of n keys: seed_mix = (seed ^ 0x5BD1E995) mod 2^32, step, and the keys' prompt,
// sample and position [n] int64 -> [n] int64 (uint32 values). One call instead of ~75 torch ops on
// a few elements each, which cost more than the hash of a whole vocabulary row.
torch::Tensor counter_row_hash(int64_t seed_mix, int64_t step, torch::Tensor prompt, torch::Tensor sample,
                               torch::Tensor position) {
  for (const auto& t : {prompt, sample, position}) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kLong && t.dim() == 1,
                "counter_row_hash: prompt, sample and position must be CPU int64 tensors [n]");
    TORCH_CHECK(t.size(0) == prompt.size(0), "counter_row_hash: prompt, sample and position must have equal length");
  }
  const auto pc = prompt.contiguous(), sc = sample.contiguous(), qc = position.contiguous();
  const int64_t n = pc.size(0);
  auto out = torch::empty({n}, torch::dtype(torch::kLong));
  const int64_t *pp = pc.data_ptr<int64_t>(), *sp = sc.data_ptr<int64_t>(), *qp = qc.data_ptr<int64_t>();
  int64_t* op = out.data_ptr<int64_t>();
  const uint32_t base = combine(fmix32(static_cast<uint32_t>(seed_mix)), step);
  for (int64_t r = 0; r < n; ++r) {
    op[r] = static_cast<int64_t>(combine(combine(combine(base, pp[r]), sp[r]), qp[r]));
  }
  return out;
}

// row_hash [n] int64 (uint32 values); ids [1, s] (shared by every row) or [n, s] int64 -> [n, s] float64.
torch::Tensor counter_uniform(torch::Tensor row_hash, torch::Tensor ids) {
  TORCH_CHECK(row_hash.device().is_cpu() && ids.device().is_cpu(), "counter_uniform: CPU tensors only");
  TORCH_CHECK(row_hash.scalar_type() == torch::kLong && ids.scalar_type() == torch::kLong,
              "counter_uniform: int64 row hashes and ids");
  TORCH_CHECK(row_hash.dim() == 1 && ids.dim() == 2, "counter_uniform: row_hash [n], ids [1 or n, s]");
  const int64_t n = row_hash.size(0), s = ids.size(1);
  TORCH_CHECK(ids.size(0) == 1 || ids.size(0) == n, "counter_uniform: ids must have 1 or n = ", n, " rows, got ",
              ids.size(0));
  const auto hc = row_hash.contiguous();
  const auto ic = ids.contiguous();
  auto out = torch::empty({n, s}, torch::dtype(torch::kDouble));
  const int64_t* hp = hc.data_ptr<int64_t>();
  const int64_t* ip = ic.data_ptr<int64_t>();
  const int64_t id_stride = ic.size(0) == 1 ? 0 : s;
  double* op = out.data_ptr<double>();
  at::parallel_for(0, n * s, kGrain, [&](int64_t begin, int64_t end) {
    int64_t r = begin / s, j = begin % s;
    for (int64_t e = begin; e < end;) {
      const uint32_t h = static_cast<uint32_t>(hp[r]);
      const int64_t* row_ids = ip + r * id_stride;
      double* row_out = op + r * s;
      const int64_t stop = std::min<int64_t>(s, j + (end - e));
      for (int64_t k = j; k < stop; ++k) {
        const uint32_t mixed = static_cast<uint32_t>(row_ids[k]) * kGolden;
        row_out[k] = (static_cast<double>(fmix32(h ^ mixed)) + 0.5) * kInv32;
      }
      e += stop - j;
      j = 0;
      ++r;
    }
  });
  return out;
}

// One row's first maximal index. With AVX2: 16 running maxima in two vectors, each lane with the
// first index where it was reached (strictly greater replaces), then the largest lane maximum at its
// smallest index; the rest (and rows of fewer than 16) one by one, likewise.
inline int64_t row_first_argmax(const float* row, int64_t v) {
  int64_t j = 1, at = 0;
  float best = row[0];
  bool nan = best != best;
#ifdef __AVX2__
  if (v >= 16) {
    __m256 m[2] = {_mm256_loadu_ps(row), _mm256_loadu_ps(row + 8)};
    __m256i mi[2] = {_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15)};
    __m256 bad = _mm256_or_ps(_mm256_cmp_ps(m[0], m[0], _CMP_UNORD_Q), _mm256_cmp_ps(m[1], m[1], _CMP_UNORD_Q));
    __m256i idx[2] = {mi[0], mi[1]};
    const __m256i step = _mm256_set1_epi32(16);
    for (j = 16; j + 16 <= v; j += 16) {
      for (int a = 0; a < 2; ++a) {
        idx[a] = _mm256_add_epi32(idx[a], step);
        const __m256 y = _mm256_loadu_ps(row + j + 8 * a);
        const __m256 up = _mm256_cmp_ps(y, m[a], _CMP_GT_OQ);  // (false for a NaN)
        m[a] = _mm256_blendv_ps(m[a], y, up);
        mi[a] = _mm256_blendv_epi8(mi[a], idx[a], _mm256_castps_si256(up));
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(y, y, _CMP_UNORD_Q));
      }
    }
    alignas(32) float lm[16];
    alignas(32) int32_t li[16];
    for (int a = 0; a < 2; ++a) {
      _mm256_store_ps(lm + 8 * a, m[a]);
      _mm256_store_si256(reinterpret_cast<__m256i*>(li + 8 * a), mi[a]);
    }
    best = lm[0];
    at = li[0];
    for (int l = 1; l < 16; ++l) {
      if (lm[l] > best || (lm[l] == best && li[l] < at)) {
        best = lm[l];
        at = li[l];
      }
    }
    nan = _mm256_movemask_ps(bad) != 0;
  }
#endif
  for (; j < v; ++j) {  // past the vectors' last full block (indices above all of theirs)
    const float y = row[j];
    nan |= y != y;
    if (y > best) {
      best = y;
      at = j;
    }
  }
  if (nan) {  // torch counts a NaN as the maximum: the first NaN
    for (at = 0; row[at] == row[at]; ++at) {
    }
  }
  return at;
}

// The first maximal index of every row of x [n, V] float32 -> [n] int64, as torch's max(dim).indices
// and argmax give it (a NaN counts as the maximum: its first one). Comparisons only, so the result is
// theirs exactly; torch's CPU reductions with indices are not vectorised (~44 us a 49152-id row).
torch::Tensor first_argmax(torch::Tensor x) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat && x.dim() == 2 && x.size(1) > 0,
              "first_argmax: a CPU float32 tensor [n, V] with V > 0");
  TORCH_CHECK(x.size(1) < (int64_t{1} << 31), "first_argmax: rows of fewer than 2^31 entries");
  const auto xc = x.stride(1) == 1 ? x : x.contiguous();  // rows read in place (a view of a forward's logits)
  const int64_t n = xc.size(0), v = xc.size(1), row_stride = xc.stride(0);
  auto out = torch::empty({n}, torch::dtype(torch::kLong));
  const float* xp = xc.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, n, std::max<int64_t>(1, kGrain / v), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) op[r] = row_first_argmax(xp + r * row_stride, v);
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("counter_row_hash", &counter_row_hash,
        "seed ^ 0x5BD1E995 mod 2^32, step, prompt [n], sample [n], position [n] -> row hashes [n] int64");
  m.def("first_argmax", &first_argmax, "x [n, V] float32 -> the first maximal index of each row [n] int64");
  m.def("counter_uniform", &counter_uniform, "row hashes [n], ids [1 or n, s] -> uniforms [n, s] float64");
}
