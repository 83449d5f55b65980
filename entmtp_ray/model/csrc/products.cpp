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


constexpr int64_t NB = 4;  // outputs per block

#if defined(__AVX2__)
// a block reads its NB outputs' rows side by side, more streams than the hardware prefetchers follow well: each row
// asks for its weights and scales a fixed distance ahead (on the AVX512-BF16 EPYC, one to eight rows of int4 blocks
// 4-11% faster; a prefetch changes no value). Past a row's end it touches the next row's, or nothing
static inline void prefetch(const void* weights, const float* scales, int64_t ahead, int64_t scales_ahead) {
  _mm_prefetch(static_cast<const char*>(weights) + ahead, _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(scales) + scales_ahead, _MM_HINT_T0);
}
#endif

// the 32 weights of group g of output o widened to fp32 in 4 vectors: the same values `widen` writes
template <int KIND>
static inline void widen_group(const void* w, const float* sc, int64_t o, int64_t g, int64_t K, vec* out) {
#if defined(__AVX2__)
  if (KIND == 3) {
    // a group's 16 bytes as 4 words, word i holding values 8i..8i+7 in its nibbles from the lowest: each word
    // broadcast, shifted per lane and masked is 8 values, with no shuffle across lanes
    const uint8_t* bytes = static_cast<const uint8_t*>(w) + o * (K / 2) + g * 16;
    const float* dm = sc + (o * (K / 32) + g) * 2;
    if ((g & 3) == 0) prefetch(bytes, dm, 1024, 512);
    const __m256 d = _mm256_set1_ps(dm[0]), m = _mm256_set1_ps(dm[1]);
    const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28), mask = _mm256_set1_epi32(15);
    for (int i = 0; i < 4; ++i) {
      int32_t word;
      std::memcpy(&word, bytes + 4 * i, 4);  // one broadcast load; a memcpy, not an int32_t* over the bytes
      const __m256i q = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(word), shifts), mask);
      // d * q is exact in fp32 (d has at most 11 significant bits, q 4: quant.quantize_int4, exact_blocks), so
      // d * q + m rounds once, with FMA or without: the generic code's values
      out[i] = fmadd((vec)d, (vec)_mm256_cvtepi32_ps(q), (vec)m);
    }
    return;
  }
  if (KIND == 4) {
    const int8_t* src = static_cast<const int8_t*>(w) + o * K + g * 32;
    if ((g & 1) == 0) prefetch(src, sc + o * (K / 32) + g, 2048, 256);
    const __m256 d = _mm256_set1_ps(sc[o * (K / 32) + g]);
    for (int i = 0; i < 4; ++i) {
      const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + 8 * i));
      out[i] = (vec)_mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
    }
    return;
  }
#endif
  if (KIND == 0) {
    const float* src = static_cast<const float*>(w) + o * K + g * 32;
    for (int i = 0; i < 4; ++i) out[i] = load(src + 8 * i);
    return;
  }
  float buf[32];
  if (KIND == 1) {
    const uint16_t* src = static_cast<const uint16_t*>(w) + o * K + g * 32;
    for (int k = 0; k < 32; ++k) {
      uint32_t bits = static_cast<uint32_t>(src[k]) << 16;
      std::memcpy(buf + k, &bits, 4);
    }
  } else if (KIND == 2) {
    const int8_t* src = static_cast<const int8_t*>(w) + o * K + g * 32;
    for (int k = 0; k < 32; ++k) buf[k] = static_cast<float>(src[k]);
  } else if (KIND == 4) {
    const int8_t* src = static_cast<const int8_t*>(w) + o * K + g * 32;
    const float d = sc[o * (K / 32) + g];
    for (int k = 0; k < 32; ++k) buf[k] = d * static_cast<float>(src[k]);
  } else {  // int4: byte k of the group holds value 2k in its low nibble, 2k + 1 in its high one
    const uint8_t* src = static_cast<const uint8_t*>(w) + o * (K / 2) + g * 16;
    const float d = sc[(o * (K / 32) + g) * 2], m = sc[(o * (K / 32) + g) * 2 + 1];
    for (int k = 0; k < 16; ++k) {
      buf[2 * k] = d * static_cast<float>(src[k] & 15) + m;
      buf[2 * k + 1] = d * static_cast<float>(src[k] >> 4) + m;
    }
  }
  for (int i = 0; i < 4; ++i) out[i] = load(buf + 8 * i);
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

// ROWS (1-8) rows against the block's NB outputs, each group of 32 weights widened in registers as it is used (no
// buffer: the widening costs about what two rows' sums do), JB outputs at a time so that the JB * ROWS sums stay in
// registers (at most 8, beside the 4 widened vectors). Every (row, output) sums in the order block_rows does:
// part[r * NB + j]
template <int KIND, int ROWS>
static inline void block_few(const float* x, const void* w, const float* sc, int64_t o, int64_t K, float* part) {
  constexpr int JB = ROWS <= 2 ? NB : ROWS <= 4 ? 2 : 1;
  for (int64_t j0 = 0; j0 < NB; j0 += JB) {
    vec acc[JB][ROWS] = {};
    for (int64_t g = 0; g < K / 32; ++g)
      for (int64_t j = 0; j < JB; ++j) {
        vec wv[4];
        widen_group<KIND>(w, sc, o + j0 + j, g, K, wv);
        for (int r = 0; r < ROWS; ++r)
          for (int i = 0; i < 4; ++i) acc[j][r] = fmadd(load(x + r * K + g * 32 + 8 * i), wv[i], acc[j][r]);
      }
    for (int r = 0; r < ROWS; ++r)
      for (int64_t j = 0; j < JB; ++j) part[r * NB + j0 + j] = lanes(acc[j][r]);
  }
}

template <int KIND>
static void run(const float* x, const void* w, const float* sc, const float* bias, float* y, int64_t R, int64_t K,
                int64_t O) {
  at::parallel_for(0, O / NB, 1, [&](int64_t begin, int64_t end) {
    // fp32 is read in place, two rows at a time; the other kinds widen each group in registers as it is used, for
    // up to eight rows at a time (a widening costs about two rows' FMAs, so eight rows share it)
    std::vector<float> part(R * NB);
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t o = blk * NB;
      if (KIND == 0) {
        const float* rows[NB];
        for (int64_t j = 0; j < NB; ++j) rows[j] = static_cast<const float*>(w) + (o + j) * K;
        for (int64_t r = 0; r < R; r += 2) {
          if (r + 1 < R) block_rows<true>(x + r * K, x + (r + 1) * K, rows, K, &part[r * NB], &part[(r + 1) * NB]);
          else block_rows<false>(x + r * K, nullptr, rows, K, &part[r * NB], nullptr);
        }
      } else {
        for (int64_t r = 0; r < R; r += 8) {
          const float* xr = x + r * K;
          float* pr = &part[r * NB];
          switch (std::min<int64_t>(R - r, 8)) {
            case 1: block_few<KIND, 1>(xr, w, sc, o, K, pr); break;
            case 2: block_few<KIND, 2>(xr, w, sc, o, K, pr); break;
            case 3: block_few<KIND, 3>(xr, w, sc, o, K, pr); break;
            case 4: block_few<KIND, 4>(xr, w, sc, o, K, pr); break;
            case 5: block_few<KIND, 5>(xr, w, sc, o, K, pr); break;
            case 6: block_few<KIND, 6>(xr, w, sc, o, K, pr); break;
            case 7: block_few<KIND, 7>(xr, w, sc, o, K, pr); break;
            default: block_few<KIND, 8>(xr, w, sc, o, K, pr); break;
          }
        }
      }
      for (int64_t r = 0; r < R; ++r) {
        float* out = y + r * O + o;
        for (int64_t j = 0; j < NB; ++j) {
          float v = part[r * NB + j];
          if (KIND == 2) v = v * sc[o + j];
          out[j] = bias ? v + bias[o + j] : v;
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
    case 4: run<4>(xp, wp, sc, b, yp, R, K, O); break;
    default: TORCH_CHECK(false, "rows_linear: kind 0..4");
  }
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}
