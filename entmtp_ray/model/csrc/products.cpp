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

// ---- integer products: the activations rounded to int8 per group of 32 inputs, as llama.cpp's Q8 activations ----
// A row's group: dx = max |x| / 127, q = nearest(x / dx) in -127..127, s = dx * sum(q). A weight group (int4: w = d *
// qw + m; q8_0: w = d * qw) against it: d * dx * sum(qw * q) + m * s, the integer sum exact, so only the scaling and
// the adding of groups round, in one fixed order per row whatever the row count (§7). KIND 5 takes int4 blocks (kind
// 3's data), KIND 6 q8_0 blocks (kind 4's); x of an int4 product keeps each group's even inputs then its odd ones, as a
// group's bytes hold them (low nibbles, high nibbles).

struct Quantized {
  std::vector<int8_t> q;   // [R, K], a group's order as its weights' (above)
  std::vector<float> ds;   // [R, K / 32, 2]: (dx, s)
  std::vector<float> dx;   // [R, K / 32, 8]: dx in 8 lanes, a vector's lanes of its group (AVX512)
};

template <int KIND>
static Quantized quantize_rows(const float* x, int64_t R, int64_t K) {
  Quantized out{std::vector<int8_t>(R * K), std::vector<float>(R * (K / 32) * 2), std::vector<float>(R * (K / 32) * 8)};
  for (int64_t r = 0; r < R; ++r)
    for (int64_t g = 0; g < K / 32; ++g) {
      const float* src = x + r * K + g * 32;
      int8_t* dst = out.q.data() + r * K + g * 32;
      float amax = 0.f;
      int32_t sum = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
      const __m512 a = _mm512_loadu_ps(src), b = _mm512_loadu_ps(src + 16);
      amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
      const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
      // nearest, ties to even (the default rounding): std::nearbyint's values, within -127..127 by construction
      const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv)), qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inv));
      sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
      if (KIND == 5) {  // even inputs, then odd
        const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
        const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtepi32_epi8(_mm512_permutex2var_epi32(qa, even, qb)));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16), _mm512_cvtepi32_epi8(_mm512_permutex2var_epi32(qa, odd, qb)));
      } else {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtepi32_epi8(qa));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16), _mm512_cvtepi32_epi8(qb));
      }
#else
      for (int k = 0; k < 32; ++k) amax = std::max(amax, std::fabs(src[k]));
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      for (int k = 0; k < 32; ++k) {
        const int32_t c = std::min(127, std::max(-127, static_cast<int32_t>(std::nearbyint(src[k] * inv))));
        dst[KIND == 5 ? (k & 1) * 16 + k / 2 : k] = static_cast<int8_t>(c);
        sum += c;
      }
#endif
      const float dx = amax / 127.f;
      out.ds[(r * (K / 32) + g) * 2] = dx;
      out.ds[(r * (K / 32) + g) * 2 + 1] = dx * static_cast<float>(sum);
      std::fill_n(out.dx.data() + (r * (K / 32) + g) * 8, 8, dx);
    }
  return out;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// a pair of groups' weights as 64 unsigned bytes (int4: each group's low nibbles then its high ones; q8_0: |w|) and,
// for q8_0, which are negative; `one`: the row's last group alone (an odd count), the second half zero
template <int KIND>
static inline __m512i pair_weights(const void* w, int64_t o, int64_t g, int64_t K, bool one, __mmask64* negative) {
  if (KIND == 5) {
    const uint8_t* p = static_cast<const uint8_t*>(w) + o * (K / 2) + g * 16;
    const __m256i b = one ? _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))
                          : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m256i f = _mm256_set1_epi8(15);
    const __m256i lo = _mm256_and_si256(b, f), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), f);
    const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);  // [g lo, g1 lo, g hi, g1 hi]
    return _mm512_shuffle_i64x2(both, both, _MM_SHUFFLE(3, 1, 2, 0));            // [g lo, g hi, g1 lo, g1 hi]
  }
  const int8_t* p = static_cast<const int8_t*>(w) + o * K + g * 32;
  const __m512i v = one ? _mm512_maskz_loadu_epi8(0xFFFFFFFFull, p) : _mm512_loadu_si512(p);
  *negative = _mm512_movepi8_mask(v);
  return _mm512_abs_epi8(v);
}

constexpr int64_t QROWS = 8;  // rows per unpacking of a pair of groups: their sums in 16 of the 32 registers
// ROWS rows against the block's NB outputs, two groups a vector: 16 lanes of integer sums (vpdpbusd: 4 products
// each, exact), each scaled by its group's d dx into its lane's fp32 sum; the m s of int4 in 4 lanes beside; the
// lanes added in one fixed order
template <int KIND, int ROWS>
static inline void q_block(const Quantized& xq, int64_t r0, const void* w, const float* sc, int64_t o, int64_t K,
                           float* part) {
  const int64_t G = K / 32;
  const __m512i idx = KIND == 5 ? _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2)
                                : _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  for (int64_t j = 0; j < NB; ++j) {
    __m512 acc[ROWS];
    __m128 macc[ROWS];
    for (int r = 0; r < ROWS; ++r) { acc[r] = _mm512_setzero_ps(); macc[r] = _mm_setzero_ps(); }
    for (int64_t g = 0; g < G; g += 2) {
      const bool one = g + 1 == G;
      __mmask64 negative = 0;
      if ((g & 3) == 0) {
        // further ahead than the float kinds, whose widening hides more latency; q8_0 asks for both lines of its
        // two groups (AVX512-BF16 EPYC, one process per side, 6 pairs: 1-8 rows 0.87-0.95x the time at 1 KB ahead)
        if (KIND == 5) {
          prefetch(static_cast<const uint8_t*>(w) + (o + j) * (K / 2) + g * 16, sc + ((o + j) * G + g) * 2, 4096, 2048);
        } else {
          const int8_t* p = static_cast<const int8_t*>(w) + (o + j) * K + g * 32;
          prefetch(p, sc + (o + j) * G + g, 4096, 512);
          _mm_prefetch(reinterpret_cast<const char*>(p) + 4096 + 64, _MM_HINT_T0);
        }
      }
      const __m512i wv = pair_weights<KIND>(w, o + j, g, K, one, &negative);
      // int4: (d, m) of both groups; q8_0: d of both (the second zero when one)
      const float* ws = KIND == 5 ? sc + ((o + j) * G + g) * 2 : sc + (o + j) * G + g;
      const __m128 wd = KIND == 5 ? (one ? _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(ws))) : _mm_loadu_ps(ws))
                                  : (one ? _mm_load_ss(ws) : _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(ws))));
      const __m512 dw = _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(wd));  // d of a lane's group
      for (int r = 0; r < ROWS; ++r) {
        const int64_t row = r0 + r;
        const int8_t* xp = xq.q.data() + row * K + g * 32;
        const float* dxp = xq.dx.data() + (row * G + g) * 8;
        __m512i xv = one ? _mm512_maskz_loadu_epi8(0xFFFFFFFFull, xp) : _mm512_loadu_si512(xp);
        if (KIND == 6) xv = _mm512_mask_sub_epi8(xv, negative, _mm512_setzero_si512(), xv);
        const __m512 scale = _mm512_mul_ps(dw, one ? _mm512_maskz_loadu_ps(0x00FF, dxp) : _mm512_loadu_ps(dxp));
        const __m512i sums = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv, xv);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), scale, acc[r]);
        if (KIND == 5) {  // (d dx, m s) of both groups: m s in lanes 1 and 3
          const float* ds = xq.ds.data() + (row * G + g) * 2;
          const __m128 xs = one ? _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(ds))) : _mm_loadu_ps(ds);
          macc[r] = _mm_fmadd_ps(wd, xs, macc[r]);
        }
      }
    }
    for (int r = 0; r < ROWS; ++r) {
      alignas(64) float l[16];
      _mm512_store_ps(l, acc[r]);
      float a = 0.f;
      for (int i = 0; i < 16; i += 4) a += (l[i] + l[i + 2]) + (l[i + 1] + l[i + 3]);
      if (KIND == 5) {
        alignas(16) float m[4];
        _mm_store_ps(m, macc[r]);
        a += m[1] + m[3];
      }
      part[r * NB + j] = a;
    }
  }
}
#elif defined(__AVX2__)
constexpr int64_t QROWS = 4;  // rows per unpacking of a group: their sums and the rest fit 16 registers
template <int KIND, int ROWS>
static inline void q_block(const Quantized& xq, int64_t r0, const void* w, const float* sc, int64_t o, int64_t K,
                           float* part) {
  const int64_t G = K / 32;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t j = 0; j < NB; ++j) {
    __m256 acc[ROWS];
    float macc[ROWS];
    for (int r = 0; r < ROWS; ++r) { acc[r] = _mm256_setzero_ps(); macc[r] = 0.f; }
    for (int64_t g = 0; g < G; ++g) {
      __m256i wv;
      if (KIND == 5) {
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(w) + (o + j) * (K / 2) + g * 16));
        const __m128i m4 = _mm_set1_epi8(15);
        wv = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), m4), _mm_and_si128(b, m4));
      } else {
        wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const int8_t*>(w) + (o + j) * K + g * 32));
      }
      const __m256 d = _mm256_set1_ps(KIND == 5 ? sc[((o + j) * G + g) * 2] : sc[(o + j) * G + g]);
      const float m = KIND == 5 ? sc[((o + j) * G + g) * 2 + 1] : 0.f;
      const __m256i wabs = KIND == 5 ? wv : _mm256_sign_epi8(wv, wv);
      for (int r = 0; r < ROWS; ++r) {
        const int64_t row = r0 + r;
        __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq.q.data() + row * K + g * 32));
        if (KIND == 6) xv = _mm256_sign_epi8(xv, wv);
        const __m256 scale = _mm256_mul_ps(d, _mm256_loadu_ps(xq.dx.data() + (row * G + g) * 8));  // d dx
        // 16-bit pair sums of at most 2 * 127 * 127 (|q8_0| or a nibble times |x|): no saturation
        const __m256i sums = _mm256_madd_epi16(_mm256_maddubs_epi16(wabs, xv), ones);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, acc[r]);
        if (KIND == 5) macc[r] = macc[r] + m * xq.ds[(row * G + g) * 2 + 1];
      }
    }
    for (int r = 0; r < ROWS; ++r) part[r * NB + j] = lanes((vec)acc[r]) + macc[r];
  }
}
#else
constexpr int64_t QROWS = 8;
template <int KIND, int ROWS>
static inline void q_block(const Quantized& xq, int64_t r0, const void* w, const float* sc, int64_t o, int64_t K,
                           float* part) {
  const int64_t G = K / 32;
  for (int64_t j = 0; j < NB; ++j)
    for (int r = 0; r < ROWS; ++r) {
      const int64_t row = r0 + r;
      float acc = 0.f, macc = 0.f;
      for (int64_t g = 0; g < G; ++g) {
        const int8_t* xv = xq.q.data() + row * K + g * 32;
        int32_t sum = 0;
        for (int k = 0; k < 32; ++k) {
          int32_t wq;
          if (KIND == 5) {
            const uint8_t byte = static_cast<const uint8_t*>(w)[(o + j) * (K / 2) + g * 16 + k % 16];
            wq = k < 16 ? byte & 15 : byte >> 4;
          } else {
            wq = static_cast<const int8_t*>(w)[(o + j) * K + g * 32 + k];
          }
          sum += wq * xv[k];
        }
        const float* xs = xq.ds.data() + (row * G + g) * 2;
        const float d = KIND == 5 ? sc[((o + j) * G + g) * 2] : sc[(o + j) * G + g];
        acc = acc + static_cast<float>(sum) * (d * xs[0]);
        if (KIND == 5) macc = macc + sc[((o + j) * G + g) * 2 + 1] * xs[1];
      }
      part[r * NB + j] = acc + macc;
    }
}
#endif

template <int KIND>
static void run_q(const float* x, const void* w, const float* sc, const float* bias, float* y, int64_t R, int64_t K,
                  int64_t O) {
  const Quantized xq = quantize_rows<KIND>(x, R, K);
  at::parallel_for(0, O / NB, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> part(R * NB);
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t o = blk * NB;
      for (int64_t r = 0; r < R; r += QROWS) {
        float* pr = &part[r * NB];
        switch (std::min<int64_t>(R - r, QROWS)) {
          case 1: q_block<KIND, 1>(xq, r, w, sc, o, K, pr); break;
          case 2: q_block<KIND, 2>(xq, r, w, sc, o, K, pr); break;
          case 3: q_block<KIND, 3>(xq, r, w, sc, o, K, pr); break;
          case 4: q_block<KIND, 4>(xq, r, w, sc, o, K, pr); break;
          case 5: q_block<KIND, 5>(xq, r, w, sc, o, K, pr); break;
          case 6: q_block<KIND, 6>(xq, r, w, sc, o, K, pr); break;
          case 7: q_block<KIND, 7>(xq, r, w, sc, o, K, pr); break;
          default: q_block<KIND, 8>(xq, r, w, sc, o, K, pr); break;
        }
      }
      for (int64_t r = 0; r < R; ++r)
        for (int64_t j = 0; j < NB; ++j) y[r * O + o + j] = bias ? part[r * NB + j] + bias[o + j] : part[r * NB + j];
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
    case 5: run_q<5>(xp, wp, sc, b, yp, R, K, O); break;
    case 6: run_q<6>(xp, wp, sc, b, yp, R, K, O); break;
    default: TORCH_CHECK(false, "rows_linear: kind 0..6");
  }
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}
