// Attention of a decoding or verification step on CPU, AVX-512: see specroll_mcore/model/attention.py.
//
// A step appends s new tokens to each of b rows whose committed keys/values sit in a KV cache. New
// token i of row r sees the row's committed context (cache positions 0 .. L_r - 1) and the new
// tokens t allowed by new_mask[r, i, t] (its tree ancestors and itself, at positions L_r + t).
//
// Each token is computed as a one-token forward of it would compute it, bit for bit, whatever the
// other tokens, rows and heads of the call:
//   * score(i, j) = sum over e of q_i[e] * scale * k_j[e], one fused multiply-add chain over
//     e = 0 .. d - 1 in order (keys stored position-major, [.., d, positions]: one vector load holds
//     16 keys' e-th element, so 16 scores build side by side, lane by lane, with no horizontal sums);
//   * its visible scores are gathered in one-token order (context, then ancestors by depth, then
//     itself: tree ancestors precede their descendants), so the softmax's sum runs over the same
//     list at the same positions as in a one-token forward, in float32 in 16 lanes, then summed in
//     a fixed pattern;
//   * its output is one multiply-add chain per element over that list in order, in float32,
//     divided by the sum and rounded to the cache's dtype.
// (Ancestors before descendants is the order tree/builder lays trees out in; a mask that broke it
// would still give each token its attention, only not the one-token forward's roundings.)
//
// A task is one (row, key group) with all of its queries (heads of the group x new tokens), or a
// part of them where there are fewer rows and groups than twice the threads: the group's keys and
// values are read once per block of 12 queries (scores) and of 6 or 12 (values, in d-chunks)
// rather than once per head and token.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

constexpr int64_t kLanes = 16;
constexpr int64_t kScoreBlock = 12;  // queries per register block of scores

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const at::BFloat16* p, __mmask16 m) {
  const __m256i raw = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// exp(x) for x <= 0 (scores minus their maximum), ~1 ulp: x = n ln2 + r, |r| <= ln2 / 2, a degree-7
// polynomial in r (Cephes' expf coefficients), scaled by 2^n. Lane by lane: the same x gives the same
// result in any lane, in any call.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// Scores of queries q[0 .. m) (each d floats, pre-scaled, stride d) against keys at positions
// [0, n) of one (row, group): key j's element e at key[j + e * ke] (positions contiguous).
// Writes scores[mi * lds + j]. Each 16-key block reads d cache lines ke apart, more streams than
// the hardware prefetchers follow: the lines two blocks ahead are prefetched.
template <typename T, int M>
void score_block(const float* q, int64_t d, const T* key, int64_t ke, int64_t n, float* scores, int64_t lds) {
  constexpr int64_t ahead = 128 / sizeof(T);
  for (int64_t j0 = 0; j0 < n; j0 += kLanes) {
    const int64_t w = std::min<int64_t>(kLanes, n - j0);
    const __mmask16 mask = w == kLanes ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << w) - 1);
    const bool prefetch = j0 + ahead < n && (j0 * sizeof(T)) % 64 == 0;
    __m512 acc[M];
    for (int mi = 0; mi < M; ++mi) acc[mi] = _mm512_setzero_ps();
    for (int64_t e = 0; e < d; ++e) {
      if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(key + e * ke + j0 + ahead), _MM_HINT_T0);
      const __m512 kv = load16(key + e * ke + j0, mask);
      for (int mi = 0; mi < M; ++mi) acc[mi] = _mm512_fmadd_ps(_mm512_set1_ps(q[mi * d + e]), kv, acc[mi]);
    }
    for (int mi = 0; mi < M; ++mi) _mm512_mask_storeu_ps(scores + mi * lds + j0, mask, acc[mi]);
  }
}

template <typename T>
void scores_for(const float* q, int64_t m, int64_t d, const T* key, int64_t ke, int64_t n, float* scores,
                int64_t lds) {
  for (int64_t m0 = 0; m0 < m; m0 += kScoreBlock) {
    const float* qb = q + m0 * d;
    float* sb = scores + m0 * lds;
    switch (std::min<int64_t>(kScoreBlock, m - m0)) {
      case 12: score_block<T, 12>(qb, d, key, ke, n, sb, lds); break;
      case 11: score_block<T, 11>(qb, d, key, ke, n, sb, lds); break;
      case 10: score_block<T, 10>(qb, d, key, ke, n, sb, lds); break;
      case 9: score_block<T, 9>(qb, d, key, ke, n, sb, lds); break;
      case 8: score_block<T, 8>(qb, d, key, ke, n, sb, lds); break;
      case 7: score_block<T, 7>(qb, d, key, ke, n, sb, lds); break;
      case 6: score_block<T, 6>(qb, d, key, ke, n, sb, lds); break;
      case 5: score_block<T, 5>(qb, d, key, ke, n, sb, lds); break;
      case 4: score_block<T, 4>(qb, d, key, ke, n, sb, lds); break;
      case 3: score_block<T, 3>(qb, d, key, ke, n, sb, lds); break;
      case 2: score_block<T, 2>(qb, d, key, ke, n, sb, lds); break;
      default: score_block<T, 1>(qb, d, key, ke, n, sb, lds); break;
    }
  }
}

// Output vectors out[mi][c0 .. c0 + C) += sum over keys j < n of p[mi * ldp + j] * v_j's 16-lane chunks
// c0 .. c0 + C, j in order, for M queries sharing the keys (M x C accumulators in registers).
template <typename T, int M, int C>
void value_block(const float* p, int64_t ldp, const T* value, int64_t vs, int64_t n, int64_t c0, __m512 (*out)[4]) {
  for (int64_t j = 0; j < n; ++j) {
    __m512 v[C];
    for (int c = 0; c < C; ++c) v[c] = load16(value + j * vs + (c0 + c) * kLanes);
    for (int mi = 0; mi < M; ++mi) {
      const __m512 pj = _mm512_set1_ps(p[mi * ldp + j]);
      for (int c = 0; c < C; ++c) out[mi][c0 + c] = _mm512_fmadd_ps(pj, v[c], out[mi][c0 + c]);
    }
  }
}

template <typename T, int C, int MAX>
void value_blocks(const float* p, int64_t m, int64_t ldp, const T* value, int64_t vs, int64_t n, int64_t c0,
                  __m512 (*out)[4]) {
  for (int64_t m0 = 0; m0 < m; m0 += MAX) {
    const float* pb = p + m0 * ldp;
    __m512 (*ob)[4] = out + m0;
    switch (std::min<int64_t>(MAX, m - m0)) {
      case 12: if constexpr (12 <= MAX) value_block<T, 12, C>(pb, ldp, value, vs, n, c0, ob); break;
      case 11: if constexpr (11 <= MAX) value_block<T, 11, C>(pb, ldp, value, vs, n, c0, ob); break;
      case 10: if constexpr (10 <= MAX) value_block<T, 10, C>(pb, ldp, value, vs, n, c0, ob); break;
      case 9: if constexpr (9 <= MAX) value_block<T, 9, C>(pb, ldp, value, vs, n, c0, ob); break;
      case 8: if constexpr (8 <= MAX) value_block<T, 8, C>(pb, ldp, value, vs, n, c0, ob); break;
      case 7: if constexpr (7 <= MAX) value_block<T, 7, C>(pb, ldp, value, vs, n, c0, ob); break;
      case 6: if constexpr (6 <= MAX) value_block<T, 6, C>(pb, ldp, value, vs, n, c0, ob); break;
      case 5: if constexpr (5 <= MAX) value_block<T, 5, C>(pb, ldp, value, vs, n, c0, ob); break;
      case 4: if constexpr (4 <= MAX) value_block<T, 4, C>(pb, ldp, value, vs, n, c0, ob); break;
      case 3: if constexpr (3 <= MAX) value_block<T, 3, C>(pb, ldp, value, vs, n, c0, ob); break;
      case 2: if constexpr (2 <= MAX) value_block<T, 2, C>(pb, ldp, value, vs, n, c0, ob); break;
      default: value_block<T, 1, C>(pb, ldp, value, vs, n, c0, ob); break;
    }
  }
}

// The queries' outputs over keys [0, n): all of d in one pass for up to 6 queries, else in passes
// over pairs of chunks (single chunks for an odd count) for up to 12 queries each, so that a value
// row is read once per pass for as many queries as the registers hold.
template <typename T>
void values_for(const float* p, int64_t m, int64_t ldp, const T* value, int64_t vs, int64_t n, int64_t d,
                __m512 (*out)[4]) {
  const int64_t dv = d / kLanes;
  if (dv == 4 && m <= 6) {
    value_blocks<T, 4, 6>(p, m, ldp, value, vs, n, 0, out);
  } else if (dv % 2 == 0) {
    for (int64_t c0 = 0; c0 < dv; c0 += 2) value_blocks<T, 2, 12>(p, m, ldp, value, vs, n, c0, out);
  } else {
    for (int64_t c0 = 0; c0 < dv; ++c0) value_blocks<T, 1, 12>(p, m, ldp, value, vs, n, c0, out);
  }
}

inline void store16(float* p, __m512 x) { _mm512_storeu_ps(p, x); }
inline void store16(at::BFloat16* p, __m512 x) {  // round to nearest even, as torch's float -> bfloat16
  alignas(64) float buf[kLanes];
  _mm512_store_ps(buf, x);
  for (int64_t i = 0; i < kLanes; ++i) p[i] = static_cast<at::BFloat16>(buf[i]);
}

template <typename T>
void run(const torch::Tensor& query, const torch::Tensor& key, const torch::Tensor& value, const int64_t* committed,
         const bool* new_mask, double scale, torch::Tensor& out) {
  const int64_t s = query.size(0), b = query.size(1), heads = query.size(2), d = query.size(3);
  const int64_t groups = key.size(2), per_group = heads / groups, queries = per_group * s;
  const T* qp = query.data_ptr<T>();
  const T* kp = key.data_ptr<T>();
  const T* vp = value.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t kb = key.stride(1), kg = key.stride(2), ke = key.stride(3);  // key.stride(0) == 1
  const int64_t vpos = value.stride(0), vb = value.stride(1), vg = value.stride(2);  // value.stride(3) == 1
  // A task: some of the queries (head, new token) of one (row, key group), which read the group's keys
  // and values once for all of them; a row's queries split into parts where there are few rows.
  const int64_t threads = at::get_num_threads();
  const int64_t parts = std::min<int64_t>(queries, std::max<int64_t>(1, (2 * threads + b * groups - 1) / (b * groups)));
  const int64_t per_part = (queries + parts - 1) / parts;
  at::parallel_for(0, b * groups * parts, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q, scores, probs, total;
    std::vector<int64_t> visible, count;
    std::vector<__m512> acc_store;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / (groups * parts), g = task / parts % groups, part = task % parts;
      const int64_t m0 = part * per_part, m = std::min(queries, m0 + per_part) - m0;
      if (m <= 0) continue;
      const int64_t L = committed[r], n = L + s;
      q.resize(m * d);
      for (int64_t mi = 0; mi < m; ++mi) {  // query (head h, token i) * scale, in float32
        const int64_t h = g * per_group + (m0 + mi) / s, i = (m0 + mi) % s;
        const T* src = qp + ((i * b + r) * heads + h) * d;
        for (int64_t e = 0; e < d; ++e) q[mi * d + e] = static_cast<float>(src[e]) * static_cast<float>(scale);
      }
      scores.resize(m * n);
      scores_for<T>(q.data(), m, d, kp + r * kb + g * kg, ke, n, scores.data(), n);
      // each query's visible scores in one-token order: committed context, then its new tokens
      const int64_t width = (n + kLanes - 1) / kLanes * kLanes;
      probs.assign(m * width, 0.0f);
      visible.resize(m * s);
      count.resize(m);
      total.resize(m);
      for (int64_t mi = 0; mi < m; ++mi) {
        const int64_t i = (m0 + mi) % s;
        const bool* sees = new_mask + (r * s + i) * s;
        float* row = probs.data() + mi * width;
        const float* sc = scores.data() + mi * n;
        std::copy(sc, sc + L, row);
        int64_t c = L;
        for (int64_t t = 0; t < s; ++t) {
          if (sees[t]) {
            visible[mi * s + c - L] = t;
            row[c++] = sc[L + t];
          }
        }
        count[mi] = c;
        float top = -INFINITY;
        for (int64_t j = 0; j < c; ++j) top = std::max(top, row[j]);
        const __m512 topv = _mm512_set1_ps(top);
        __m512 sum = _mm512_setzero_ps();
        for (int64_t j0 = 0; j0 < c; j0 += kLanes) {
          const int64_t w = std::min<int64_t>(kLanes, c - j0);
          const __mmask16 mask = w == kLanes ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << w) - 1);
          const __m512 e = _mm512_maskz_mov_ps(mask, exp16(_mm512_sub_ps(_mm512_loadu_ps(row + j0), topv)));
          _mm512_storeu_ps(row + j0, e);
          sum = _mm512_add_ps(sum, e);
        }
        total[mi] = _mm512_reduce_add_ps(sum);
      }
      // outputs: the committed context, shared by all the task's queries, then each one's new tokens
      acc_store.assign(m * 4, _mm512_setzero_ps());
      __m512 (*acc)[4] = reinterpret_cast<__m512 (*)[4]>(acc_store.data());
      const T* vrow = vp + r * vb + g * vg;
      values_for<T>(probs.data(), m, width, vrow, vpos, L, d, acc);
      const int64_t dv = d / kLanes;
      for (int64_t mi = 0; mi < m; ++mi) {
        const float* row = probs.data() + mi * width;
        for (int64_t a = 0; a < count[mi] - L; ++a) {
          const T* v = vrow + (L + visible[mi * s + a]) * vpos;
          const __m512 pj = _mm512_set1_ps(row[L + a]);
          for (int64_t c = 0; c < dv; ++c) acc[mi][c] = _mm512_fmadd_ps(pj, load16(v + c * kLanes), acc[mi][c]);
        }
        const int64_t h = g * per_group + (m0 + mi) / s, i = (m0 + mi) % s;
        const __m512 sum = _mm512_set1_ps(total[mi]);
        T* dst = op + ((i * b + r) * heads + h) * d;
        for (int64_t c = 0; c < dv; ++c) store16(dst + c * kLanes, _mm512_div_ps(acc[mi][c], sum));
      }
    }
  });
}

}  // namespace

// query [s, b, heads, d] (contiguous); key, value [positions, b, groups, d] views of the cache
// (key positions contiguous: stride 1; value's d contiguous); committed [b] int64; new_mask
// [b, s, s] bool -> [s, b, heads * d] in the query's dtype (float32 or bfloat16).
torch::Tensor step_attention(torch::Tensor query, torch::Tensor key, torch::Tensor value, torch::Tensor committed,
                             torch::Tensor new_mask, double scale) {
  TORCH_CHECK(query.device().is_cpu() && key.device().is_cpu() && value.device().is_cpu(),
              "step_attention: CPU tensors only");
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.dim() == 4,
              "step_attention: query [s, b, heads, d], key/value [positions, b, groups, d]");
  TORCH_CHECK(query.scalar_type() == key.scalar_type() && key.scalar_type() == value.scalar_type(),
              "step_attention: query, key and value must share a dtype");
  TORCH_CHECK(query.scalar_type() == torch::kFloat || query.scalar_type() == torch::kBFloat16,
              "step_attention: float32 or bfloat16 only, got ", query.scalar_type());
  const int64_t s = query.size(0), b = query.size(1), heads = query.size(2), d = query.size(3);
  TORCH_CHECK(d % kLanes == 0 && d <= 4 * kLanes, "step_attention: head dim must be a multiple of 16, at most 64; got ",
              d);
  TORCH_CHECK(key.sizes() == value.sizes() && key.size(1) == b && key.size(3) == d,
              "step_attention: key/value must be [positions, b, groups, d] with b = ", b, " and d = ", d);
  TORCH_CHECK(heads % key.size(2) == 0, "step_attention: ", key.size(2), " key groups do not divide ", heads, " heads");
  TORCH_CHECK(key.stride(0) == 1, "step_attention: keys must be stored position-major (key.stride(0) == 1)");
  TORCH_CHECK(value.stride(3) == 1, "step_attention: values must have contiguous head dims");
  TORCH_CHECK(committed.scalar_type() == torch::kLong && committed.dim() == 1 && committed.size(0) == b,
              "step_attention: committed must be int64 [b]");
  TORCH_CHECK(new_mask.scalar_type() == torch::kBool && new_mask.dim() == 3 && new_mask.size(0) == b &&
                  new_mask.size(1) == s && new_mask.size(2) == s,
              "step_attention: new_mask must be bool [b, s, s]");
  const auto q = query.contiguous();
  const auto lengths = committed.contiguous();
  const auto mask = new_mask.contiguous();
  const int64_t* lp = lengths.data_ptr<int64_t>();
  for (int64_t r = 0; r < b; ++r)
    TORCH_CHECK(lp[r] >= 0 && lp[r] + s <= key.size(0), "step_attention: row ", r, " needs ", lp[r] + s,
                " key positions, the keys hold ", key.size(0));
  auto out = torch::empty({s, b, heads * d}, query.options());
  if (query.scalar_type() == torch::kFloat)
    run<float>(q, key, value, lp, mask.data_ptr<bool>(), scale, out);
  else
    run<at::BFloat16>(q, key, value, lp, mask.data_ptr<bool>(), scale, out);
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("step_attention", &step_attention,
        "attention of s new tokens per row over a KV cache's committed keys and their visible new tokens");
}
