#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <type_traits>
#if defined(__AVX__)
#include <immintrin.h>
#endif
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

// W consecutive operands widened to fp32, exactly
template <typename T>
static inline vec load_wide(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return load(p);
  } else {
#if defined(__AVX2__)
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
      return (vec)_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
#endif
#if defined(__F16C__)
    if constexpr (std::is_same_v<T, c10::Half>) {
      return (vec)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    }
#endif
    vec out;
    for (int64_t w = 0; w < W; ++w) out[w] = static_cast<float>(p[w]);
    return out;
  }
}

// r[i] holds lanes d..d+7 of key i; after, r[d'] holds key 0..7's lane d + d' (a move of values, no arithmetic)
static inline void transpose8(vec (&r)[W]) {
#if defined(__AVX__)
  const __m256 t0 = _mm256_unpacklo_ps((__m256)r[0], (__m256)r[1]), t1 = _mm256_unpackhi_ps((__m256)r[0], (__m256)r[1]);
  const __m256 t2 = _mm256_unpacklo_ps((__m256)r[2], (__m256)r[3]), t3 = _mm256_unpackhi_ps((__m256)r[2], (__m256)r[3]);
  const __m256 t4 = _mm256_unpacklo_ps((__m256)r[4], (__m256)r[5]), t5 = _mm256_unpackhi_ps((__m256)r[4], (__m256)r[5]);
  const __m256 t6 = _mm256_unpacklo_ps((__m256)r[6], (__m256)r[7]), t7 = _mm256_unpackhi_ps((__m256)r[6], (__m256)r[7]);
  const __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  r[0] = (vec)_mm256_permute2f128_ps(s0, s4, 0x20); r[1] = (vec)_mm256_permute2f128_ps(s1, s5, 0x20);
  r[2] = (vec)_mm256_permute2f128_ps(s2, s6, 0x20); r[3] = (vec)_mm256_permute2f128_ps(s3, s7, 0x20);
  r[4] = (vec)_mm256_permute2f128_ps(s0, s4, 0x31); r[5] = (vec)_mm256_permute2f128_ps(s1, s5, 0x31);
  r[6] = (vec)_mm256_permute2f128_ps(s2, s6, 0x31); r[7] = (vec)_mm256_permute2f128_ps(s3, s7, 0x31);
#else
  vec t[W];
  for (int64_t i = 0; i < W; ++i)
    for (int64_t j = 0; j < W; ++j) t[i][j] = r[j][i];
  for (int64_t i = 0; i < W; ++i) r[i] = t[i];
#endif
}

// q [kv, R, hd]; k, v [kv, L, hd] (views of a cache: unit stride in hd); mask [R, L] bool, or null for every key.
// Three passes, each split across threads by blocks whose arithmetic per row is the same whatever the split: scores
// (a row's sum over d in order, one lane per key), the softmax (a row's keys in position order), the weighted sum
// (one lane per d, a row's keys in position order). A masked key adds an exact zero to a row's weighted sum (its
// sum starts at +0 and stays off -0, so adding +-0 leaves it as it was): no branch in the vector loop. Keys and
// values are read where they lie (the cache): the scores take each block of 8 keys x 8 lanes of d transposed in
// registers, the weighted sum reads value rows as they are; only a head dimension that is not a multiple of 16 (or
// of 8 for the keys) copies its operands, zero-padded.
template <typename T>
static void attend(const T* q, const T* k, const T* v, const bool* mask, T* out, int64_t kv, int64_t R,
                   int64_t hd, int64_t L, int64_t ks0, int64_t ks1, int64_t vs0, int64_t vs1, float scale) {
  const int64_t Lp = (L + KB - 1) / KB * KB, nb = (R + RB - 1) / RB, Rp = nb * RB, hp = (hd + DB - 1) / DB * DB;
  // fp32 operands in this (calling) thread's buffers, kept between calls: a fresh one per call would be mapped and
  // faulted in by the allocator every time. Workers see them through these pointers (their own thread_local
  // copies would be empty)
  thread_local std::vector<float> kb, vb, qb, sb, mb;
  const bool keys_in_place = hd % W == 0, values_in_place = hd % DB == 0 && std::is_same_v<T, float>;
  const int64_t hk = (hd + W - 1) / W * W;
  // keys padded to a multiple of 8 lanes ([kv, L, hk]) where hd is not one; values [kv, L, hp] where they are not
  // fp32 rows of a multiple of 16: both zero past hd
  float* kp = keys_in_place ? nullptr : grown(kb, kv * L * hk);
  float* vf = values_in_place ? nullptr : grown(vb, kv * L * hp);
  float* qf = grown(qb, kv * Rp * hk);  // queries [kv, Rp, hk], zero past R and hd
  float* s = grown(sb, kv * Rp * Lp);   // scores, then probabilities (zero where masked), [kv, Rp, Lp]
  if (!keys_in_place || !values_in_place)
    at::parallel_for(0, kv * L, 64, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        int64_t h = i / L, j = i % L;
        if (!keys_in_place) {
          const T* kj = k + h * ks0 + j * ks1;
          float* ko = kp + (h * L + j) * hk;
          for (int64_t d = 0; d < hk; ++d) ko[d] = d < hd ? static_cast<float>(kj[d]) : 0.f;
        }
        if (!values_in_place) {
          const T* vj = v + h * vs0 + j * vs1;
          float* vo = vf + (h * L + j) * hp;
          for (int64_t d = 0; d < hp; ++d) vo[d] = d < hd ? static_cast<float>(vj[d]) : 0.f;
        }
      }
    });
  for (int64_t h = 0; h < kv; ++h)
    for (int64_t r = 0; r < Rp; ++r)
      for (int64_t d = 0; d < hk; ++d)
        qf[(h * Rp + r) * hk + d] = r < R && d < hd ? static_cast<float>(q[(h * R + r) * hd + d]) : 0.f;

  const int64_t nk = Lp / KB;
  at::parallel_for(0, kv * nb * nk, 4, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      int64_t h = i / (nb * nk), b = i / nk % nb, j0 = i % nk * KB;
      const float* qr = qf + (h * Rp + b * RB) * hk;
      vec a[RB][KB / W] = {};
      // each score summed over d in order, one multiply then one add (no contraction: -ffp-contract=off); the
      // block's keys 8 lanes of d at a time, transposed so that vector t[u][d'] holds lane d + d' of 8 keys
      for (int64_t d = 0; d < hk; d += W) {
        vec t[KB / W][W];
        for (int64_t u = 0; u < KB / W; ++u) {
          for (int64_t w = 0; w < W; ++w) {
            const int64_t j = j0 + u * W + w;
            if (j >= L) t[u][w] = splat(0.f);  // past the keys: a score of 0, masked
            else if (keys_in_place) t[u][w] = load_wide(k + h * ks0 + j * ks1 + d);
            else t[u][w] = load(kp + (h * L + j) * hk + d);
          }
          transpose8(t[u]);
        }
        for (int64_t e = 0; e < W; ++e) {
          vec ys[KB / W];
          for (int64_t u = 0; u < KB / W; ++u) ys[u] = t[u][e];
          for (int64_t rr = 0; rr < RB; ++rr) {
            const vec xr = splat(qr[rr * hk + d + e]);
            for (int64_t u = 0; u < KB / W; ++u) a[rr][u] = a[rr][u] + xr * ys[u];
          }
        }
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
      vec a[RB][DB / W] = {};
      if (values_in_place) {
        const float* vh = reinterpret_cast<const float*>(v) + h * vs0 + d0;
        for (int64_t j = 0; j < L; ++j) accumulate(a, pb + j, Lp, vh + j * vs1);  // keys in position order
      } else {
        const float* vh = vf + h * L * hp + d0;
        for (int64_t j = 0; j < L; ++j) accumulate(a, pb + j, Lp, vh + j * hp);
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
