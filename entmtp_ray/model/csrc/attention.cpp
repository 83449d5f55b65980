#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <vector>

// GCC/Clang vector types: one lane per key (scores) or per d (weighted sum), elementwise arithmetic only, so every
// lane rounds as a scalar would; 8 floats (AVX2; split in two on SSE-only or NEON hosts)
constexpr int64_t W = 8;
typedef float vec __attribute__((vector_size(W * sizeof(float))));
typedef float vec_unaligned __attribute__((vector_size(W * sizeof(float)), aligned(alignof(float))));
static inline vec load(const float* p) { return *reinterpret_cast<const vec_unaligned*>(p); }
static inline void store(float* p, vec x) { *reinterpret_cast<vec_unaligned*>(p) = x; }
static_assert(W == 8, "splat lists W lanes");
static inline vec splat(float x) { return vec{x, x, x, x, x, x, x, x}; }  // not vec{} + x: an add per use
typedef int32_t ivec __attribute__((vector_size(W * sizeof(int32_t))));
typedef int32_t ivec_unaligned __attribute__((vector_size(W * sizeof(int32_t)), aligned(alignof(int32_t))));
static inline ivec loadi(const int32_t* p) { return *reinterpret_cast<const ivec_unaligned*>(p); }

// e^x lane by lane, for the softmax's x = score - max (<= 0 on a row's own keys; a masked key's lane may be
// anything, and is zeroed after): x = n ln2 + r with |r| <= ln2/2 (ln2 split in two for an exact n ln2), e^r by a
// degree-7 polynomial (Cephes' expf coefficients, within 2 ulp), 2^n in the exponent bits. Below -87 (e^x <
// 1.7e-38) it gives 0, above 0 it gives 1: a softmax weight that small adds nothing a bf16 output keeps
static inline vec exp_nonpositive(vec x) {
  const ivec under = x < splat(-87.f);
  x = under ? splat(-87.f) : x;
  x = x > splat(0.f) ? splat(0.f) : x;
  vec t = x * splat(1.44269504088896341f) + splat(0.5f);
  vec n = __builtin_convertvector(__builtin_convertvector(t, ivec), vec);  // toward zero: floor for t < 0
  n = n > t ? n - splat(1.f) : n;
  vec r = x - n * splat(0.693359375f);
  r = r - n * splat(-2.12194440e-4f);
  vec y = splat(1.9875691500e-4f);
  y = y * r + splat(1.3981999507e-3f);
  y = y * r + splat(8.3334519073e-3f);
  y = y * r + splat(4.1665795894e-2f);
  y = y * r + splat(1.6666665459e-1f);
  y = y * r + splat(5.0000001201e-1f);
  y = y * (r * r) + r + splat(1.f);
  ivec bits = (__builtin_convertvector(n, ivec) + 127) << 23;
  y = y * reinterpret_cast<vec&>(bits);
  return under ? splat(0.f) : y;
}

constexpr int64_t RB = 4;   // query rows of one head per block: they share every key and value they load
constexpr int64_t KB = 16;  // keys per block of scores held in registers
constexpr int64_t DB = 16;  // head-dimension lanes per block of the weighted sum held in registers

static float* grown(std::vector<float>& buffer, int64_t n) {
  if (buffer.size() < static_cast<size_t>(n)) buffer.resize(n);
  return buffer.data();
}

// One step of a register block: a[rr] += x[rr * stride] * y, lane by lane, for each of the block's RB rows (its
// scalar x broadcast over N vectors of y): the scores' step over d, and the weighted sum's step over keys
template <int64_t N>
static inline void accumulate(vec (&a)[RB][N], const float* x, int64_t stride, const float* y) {
  vec ys[N];
  for (int64_t u = 0; u < N; ++u) ys[u] = load(y + u * W);
  for (int64_t rr = 0; rr < RB; ++rr) {
    vec xr = splat(x[rr * stride]);
    for (int64_t u = 0; u < N; ++u) a[rr][u] = a[rr][u] + xr * ys[u];
  }
}

// q [kv, R, hd]; k, v [kv, L, hd] (views of a cache: unit stride in hd); mask [R, L] bool, or null for every key.
// Three passes, each split across threads by blocks whose arithmetic per row is the same whatever the split: scores
// (a row's sum over d in order, one lane per key), the softmax (a row's keys in position order), the weighted sum
// (one lane per d, a row's keys in position order). A masked key adds an exact zero to a row's weighted sum (its
// sum starts at +0 and stays off -0, so adding +-0 leaves it as it was): no branch in the vector loop.
template <typename T>
static void attend(const T* q, const T* k, const T* v, const bool* mask, T* out, int64_t kv, int64_t R,
                   int64_t hd, int64_t L, int64_t ks0, int64_t ks1, int64_t vs0, int64_t vs1, float scale) {
  const int64_t Lp = (L + KB - 1) / KB * KB, nb = (R + RB - 1) / RB, Rp = nb * RB, hp = (hd + DB - 1) / DB * DB;
  // fp32 operands in this (calling) thread's buffers, kept between calls: a fresh one per call would be mapped and
  // faulted in by the allocator every time. Workers see them through these pointers (their own thread_local
  // copies would be empty)
  thread_local std::vector<float> kb, vb, qb, sb, mb;
  float* kt = grown(kb, kv * hd * Lp);  // keys transposed, [kv, hd, Lp], zero past L
  float* vf = grown(vb, kv * L * hp);   // values [kv, L, hp], zero past hd
  float* qf = grown(qb, kv * Rp * hd);  // queries [kv, Rp, hd], zero past R
  float* s = grown(sb, kv * Rp * Lp);   // scores, then probabilities (zero where masked), [kv, Rp, Lp]
  at::parallel_for(0, kv * Lp, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      int64_t h = i / Lp, j = i % Lp;
      if (j >= L) {
        for (int64_t d = 0; d < hd; ++d) kt[(h * hd + d) * Lp + j] = 0.f;
        continue;
      }
      const T* kj = k + h * ks0 + j * ks1;
      const T* vj = v + h * vs0 + j * vs1;
      float* vo = vf + (h * L + j) * hp;
      for (int64_t d = 0; d < hd; ++d) {
        kt[(h * hd + d) * Lp + j] = static_cast<float>(kj[d]);
        vo[d] = static_cast<float>(vj[d]);
      }
      for (int64_t d = hd; d < hp; ++d) vo[d] = 0.f;
    }
  });
  for (int64_t h = 0; h < kv; ++h)
    for (int64_t r = 0; r < Rp; ++r)
      for (int64_t d = 0; d < hd; ++d)
        qf[(h * Rp + r) * hd + d] = r < R ? static_cast<float>(q[(h * R + r) * hd + d]) : 0.f;

  const int64_t nk = Lp / KB;
  at::parallel_for(0, kv * nb * nk, 4, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      int64_t h = i / (nb * nk), b = i / nk % nb, j0 = i % nk * KB;
      const float* qr = qf + (h * Rp + b * RB) * hd;
      const float* kh = kt + h * hd * Lp + j0;
      vec a[RB][KB / W] = {};
      // each score summed over d in order, one multiply then one add (no contraction: -ffp-contract=off)
      for (int64_t d = 0; d < hd; ++d) {
        accumulate(a, qr + d, hd, kh + d * Lp);
      }
      for (int64_t rr = 0; rr < RB; ++rr)
        for (int64_t u = 0; u < KB / W; ++u) store(s + (h * Rp + b * RB + rr) * Lp + j0 + u * W, a[rr][u]);
    }
  });

  // which keys each row sees, as vector lanes: -1 for a key of its own, 0 for a masked key, a padding key or row
  int32_t* keep = reinterpret_cast<int32_t*>(grown(mb, Rp * Lp));
  for (int64_t r = 0; r < Rp; ++r)
    for (int64_t j = 0; j < Lp; ++j) keep[r * Lp + j] = r < R && j < L && (!mask || mask[r * L + j]) ? -1 : 0;
  std::vector<float> total(kv * Rp, 1.f);
  const vec sv = splat(scale);
  at::parallel_for(0, kv * nb, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      int64_t h = i / nb, r0 = i % nb * RB;
      for (int64_t rr = 0; rr < RB; ++rr) {
        float* sr = s + (h * Rp + r0 + rr) * Lp;
        const int32_t* on = keep + (r0 + rr) * Lp;
        vec most = splat(-INFINITY);  // the row's largest scaled score (a max: exact in any order)
        for (int64_t j = 0; j < Lp; j += W) {
          vec x = load(sr + j) * sv;
          most = (loadi(on + j) & (x > most)) ? x : most;
        }
        float m = -INFINITY;
        for (int64_t w = 0; w < W; ++w) m = std::max(m, most[w]);
        const vec mv = splat(m);
        for (int64_t j = 0; j < Lp; j += W)
          store(sr + j, loadi(on + j) ? exp_nonpositive(load(sr + j) * sv - mv) : splat(0.f));
      }
      // the softmax sums over each row's keys in position order (a masked key adds +0: no change), the block's
      // rows as independent chains
      float l[RB] = {};
      const float* pb = s + (h * Rp + r0) * Lp;
      for (int64_t j = 0; j < L; ++j)
        for (int64_t rr = 0; rr < RB; ++rr) l[rr] += pb[rr * Lp + j];
      for (int64_t rr = 0; rr < RB; ++rr) total[h * Rp + r0 + rr] = l[rr];
    }
  });

  const int64_t nd = hp / DB;
  at::parallel_for(0, kv * nb * nd, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      int64_t h = i / (nb * nd), b = i / nd % nb, d0 = i % nd * DB;
      const float* pb = s + (h * Rp + b * RB) * Lp;
      const float* vh = vf + h * L * hp + d0;
      vec a[RB][DB / W] = {};
      for (int64_t j = 0; j < L; ++j) {  // the weighted sum over keys in position order
        accumulate(a, pb + j, Lp, vh + j * hp);
      }
      float lanes[RB][DB];
      for (int64_t rr = 0; rr < RB; ++rr)
        for (int64_t u = 0; u < DB / W; ++u) store(lanes[rr] + u * W, a[rr][u]);
      for (int64_t rr = 0; rr < RB && b * RB + rr < R; ++rr) {
        int64_t r = b * RB + rr;
        T* o = out + (h * R + r) * hd;
        float l = total[h * Rp + r];
        for (int64_t t = 0; t < DB && d0 + t < hd; ++t) o[d0 + t] = static_cast<T>(lanes[rr][t] / l);
      }
    }
  });
}

torch::Tensor fixed_order_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor mask,
                                    double scale) {
  TORCH_CHECK(q.is_contiguous() && k.stride(2) == 1 && v.stride(2) == 1, "q contiguous, k and v unit-stride in hd");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type(), "one dtype");
  auto out = torch::empty_like(q);
  int64_t kv = q.size(0), R = q.size(1), hd = q.size(2), L = k.size(1);
  auto m = mask.numel() ? mask.contiguous() : mask;
  TORCH_CHECK(!mask.numel() || (m.size(0) == R && m.size(1) == L), "mask [rows, keys]");
  const bool* mp = mask.numel() ? m.data_ptr<bool>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "fixed_order_attention", [&] {
    attend<scalar_t>(q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(), mp,
                     out.data_ptr<scalar_t>(), kv, R, hd, L, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                     static_cast<float>(scale));
  });
  return out;
}
