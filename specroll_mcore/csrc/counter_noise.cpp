// The counter-based sampler's uniforms on CPU: see specroll_mcore/sampling.py.
//
// u[r, j] = (fmix32(row_hash[r] ^ (ids[j] * 0x9E3779B1 mod 2^32)) + 0.5) / 2^32
//
// in uint32 arithmetic, one pass over the output. Torch's reference computes the same integers on
// int64 tensors (about a dozen passes, each with its own temporary), and the same float64 value from
// them: an integer below 2^32 plus 0.5, times a power of two, is exact in float64. The logarithms
// that turn u into Gumbel noise stay torch's, so the noise is bit for bit the reference's.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>

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

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("counter_uniform", &counter_uniform, "row hashes [n], ids [1 or n, s] -> uniforms [n, s] float64");
}
