#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cstring>
#if defined(__AVX__)
#include <immintrin.h>
#endif

typedef float vec __attribute__((vector_size(32)));
typedef float vec_u __attribute__((vector_size(32), aligned(4)));
static inline vec load(const float* p) { return *reinterpret_cast<const vec_u*>(p); }
static inline vec fmadd(vec a, vec b, vec c) {
#if defined(__FMA__) && defined(__AVX__)
  return (vec)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  return a * b + c;  // two roundings, the same for every row (-ffp-contract=off)
#endif
}
// the 8 lanes in one fixed order
static inline float lanes(vec a) {
  return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
}

typedef uint8_t bytes16 __attribute__((vector_size(16)));
typedef float vec16 __attribute__((vector_size(64)));
static inline vec16 splat16(float x) { return vec16{} + x; }
static inline void store16(float* p, vec16 x) { std::memcpy(p, &x, 64); }

constexpr int64_t NB = 4;  // outputs per block

// widen outputs [o, o + NB) of the weight to fp32 rows of `buf` ([NB, K]); returns pointers to the NB rows
template <int KIND>
static void widen(const void* w, const float* sc, int64_t o, int64_t K, float* buf, const float** rows) {
  for (int64_t j = 0; j < NB; ++j) {
    float* dst = buf + j * K;
    if (KIND == 0) {
      rows[j] = static_cast<const float*>(w) + (o + j) * K;
      continue;
    }
    rows[j] = dst;
    if (KIND == 1) {
      const uint16_t* src = static_cast<const uint16_t*>(w) + (o + j) * K;
      for (int64_t k = 0; k < K; ++k) {
        uint32_t bits = static_cast<uint32_t>(src[k]) << 16;
        std::memcpy(dst + k, &bits, 4);
      }
    } else if (KIND == 2) {
      const int8_t* src = static_cast<const int8_t*>(w) + (o + j) * K;
      for (int64_t k = 0; k < K; ++k) dst[k] = static_cast<float>(src[k]);
    } else {  // int4: [O, K / 2] bytes, a group of 32 in 16 bytes (low nibbles the first 16); sc [O, K / 32, 2]
      const uint8_t* src = static_cast<const uint8_t*>(w) + (o + j) * (K / 2);
      const float* dm = sc + (o + j) * (K / 32) * 2;
      for (int64_t g = 0; g < K / 32; ++g) {
#if defined(__AVX2__)
        const __m256 d = _mm256_set1_ps(dm[2 * g]), m = _mm256_set1_ps(dm[2 * g + 1]);
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + g * 16)), mask = _mm_set1_epi8(15);
        const __m128i nib[2] = {_mm_and_si128(b, mask), _mm_and_si128(_mm_srli_epi16(b, 4), mask)};
        for (int h = 0; h < 2; ++h)
          for (int e = 0; e < 2; ++e) {
            const __m128i part = e ? _mm_srli_si128(nib[h], 8) : nib[h];
            const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(part));
            _mm256_storeu_ps(dst + g * 32 + h * 16 + e * 8, _mm256_add_ps(_mm256_mul_ps(d, q), m));
          }
#else
        const vec16 d = splat16(dm[2 * g]), m = splat16(dm[2 * g + 1]);
        bytes16 b;
        std::memcpy(&b, src + g * 16, 16);
        const vec16 low = __builtin_convertvector(b & 15, vec16), high = __builtin_convertvector(b >> 4, vec16);
        store16(dst + g * 32, d * low + m);
        store16(dst + g * 32 + 16, d * high + m);
#endif
      }
    }
  }
}

// sums of rows r (and r + 1 when two) against the block's NB weight rows, written to y[r, o..o+NB)
template <bool TWO>
static inline void block_rows(const float* x0, const float* x1, const float* const* w, int64_t K, float* y0,
                              float* y1) {
  vec a0 = {}, a1 = {}, a2 = {}, a3 = {}, b0 = {}, b1 = {}, b2 = {}, b3 = {};
  for (int64_t k = 0; k < K; k += 8) {
    const vec u = load(x0 + k);
    const vec w0 = load(w[0] + k), w1 = load(w[1] + k), w2 = load(w[2] + k), w3 = load(w[3] + k);
    a0 = fmadd(u, w0, a0); a1 = fmadd(u, w1, a1); a2 = fmadd(u, w2, a2); a3 = fmadd(u, w3, a3);
    if (TWO) {
      const vec v = load(x1 + k);
      b0 = fmadd(v, w0, b0); b1 = fmadd(v, w1, b1); b2 = fmadd(v, w2, b2); b3 = fmadd(v, w3, b3);
    }
  }
  y0[0] = lanes(a0); y0[1] = lanes(a1); y0[2] = lanes(a2); y0[3] = lanes(a3);
  if (TWO) { y1[0] = lanes(b0); y1[1] = lanes(b1); y1[2] = lanes(b2); y1[3] = lanes(b3); }
}

template <int KIND>
static void run(const float* x, const void* w, const float* sc, const float* bias, float* y, int64_t R, int64_t K,
                int64_t O) {
  at::parallel_for(0, O / NB, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(KIND == 0 ? 0 : NB * K);
    const float* rows[NB];
    float part[2][NB];
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t o = blk * NB;
      widen<KIND>(w, sc, o, K, buf.data(), rows);
      for (int64_t r = 0; r < R; r += 2) {
        if (r + 1 < R) block_rows<true>(x + r * K, x + (r + 1) * K, rows, K, part[0], part[1]);
        else block_rows<false>(x + r * K, nullptr, rows, K, part[0], nullptr);
        for (int64_t i = 0; i < 2 && r + i < R; ++i) {
          float* out = y + (r + i) * O + o;
          for (int64_t j = 0; j < NB; ++j) {
            float s = part[i][j];
            if (KIND == 2) s = s * sc[o + j];
            out[j] = bias ? s + bias[o + j] : s;
          }
        }
      }
    }
  });
}

torch::Tensor rows_linear(torch::Tensor x, torch::Tensor w, int64_t kind, torch::Tensor scales, torch::Tensor bias) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && w.is_contiguous(), "rows_linear: x [R, K] and w contiguous");
  const int64_t R = x.size(0), K = x.size(1), O = w.size(0);
  TORCH_CHECK(K % 32 == 0 && O % NB == 0, "rows_linear: K % 32 and O % 4");
  auto xf = x.scalar_type() == at::kFloat ? x : x.to(at::kFloat);
  auto y = torch::empty({R, O}, xf.options());
  auto bf = bias.numel() ? bias.to(at::kFloat).contiguous() : bias;
  const float* b = bias.numel() ? bf.data_ptr<float>() : nullptr;
  const float* sc = scales.numel() ? scales.data_ptr<float>() : nullptr;
  const float* xp = xf.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const void* wp = w.data_ptr();
  switch (kind) {
    case 0: run<0>(xp, wp, sc, b, yp, R, K, O); break;
    case 1: run<1>(xp, wp, sc, b, yp, R, K, O); break;
    case 2: run<2>(xp, wp, sc, b, yp, R, K, O); break;
    case 3: run<3>(xp, wp, sc, b, yp, R, K, O); break;
    default: TORCH_CHECK(false, "rows_linear: kind 0..3");
  }
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}
