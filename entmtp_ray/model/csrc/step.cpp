namespace step {

static inline void linear(int64_t kind, const float* x, const torch::Tensor& w, const torch::Tensor& sc,
                          const float* bias, float* y, int64_t R, int64_t K, int64_t O) {
  const float* s = sc.numel() ? sc.data_ptr<float>() : nullptr;
  const void* wp = w.data_ptr();
  switch (kind) {
    case 0: rp::run<0>(x, wp, s, bias, y, R, K, O); break;
    case 1: rp::run<1>(x, wp, s, bias, y, R, K, O); break;
    case 2: rp::run<2>(x, wp, s, bias, y, R, K, O); break;
    case 3: rp::run<3>(x, wp, s, bias, y, R, K, O); break;
    case 4: rp::run<4>(x, wp, s, bias, y, R, K, O); break;
    case 5: rp::run_q<5>(x, wp, s, bias, y, R, K, O); break;
    default: rp::run_q<6>(x, wp, s, bias, y, R, K, O); break;
  }
}

// y = x / sqrt(mean(x^2) + eps) * w, row by row: the squares summed in 8 lanes over the row in order, then the lanes
static void rms_norm(const float* x, const float* w, float* y, int64_t R, int64_t H, float eps) {
  for (int64_t r = 0; r < R; ++r) {
    const float* xr = x + r * H;
    rp::vec a = {};
    for (int64_t k = 0; k < H; k += 8) { rp::vec u = rp::load(xr + k); a = a + u * u; }
    const float scale = 1.f / std::sqrt(rp::lanes(a) / static_cast<float>(H) + eps);
    for (int64_t k = 0; k < H; ++k) y[r * H + k] = (xr[k] * scale) * w[k];
  }
}

// x * sigmoid(x) lane by lane, through the attention's e^x of a non-positive argument
static inline fo::vec silu(fo::vec x) {
  const fo::vec zero = fo::splat(0.f), one = fo::splat(1.f);
  const fo::vec t = fo::exp_nonpositive(x < zero ? x : zero - x);  // e^-|x|
  const fo::vec sig = x < zero ? t / (one + t) : one / (one + t);
  return x * sig;
}

struct Layer {
  torch::Tensor in_norm, post_norm, qkv, qkv_s, qkv_b, o, o_s, gate_up, gate_up_s, down, down_s;
  int64_t qkv_kind, o_kind, gate_up_kind, down_kind;  // products.py's KINDS
};

struct Model {
  std::vector<Layer> layers;
  int64_t H, I, heads, kv, hd;
  double eps, scaling;

  // per layer, 11 tensors in Layer's order (an empty tensor for no scales or no bias) and 4 kinds (q/k/v, o,
  // gate/up, down)
  Model(std::vector<torch::Tensor> t, std::vector<int64_t> kinds, int64_t heads, int64_t kv, int64_t hd, double eps,
        double scaling)
      : heads(heads), kv(kv), hd(hd), eps(eps), scaling(scaling) {
    TORCH_CHECK(t.size() % 11 == 0 && kinds.size() * 11 == t.size() * 4, "11 tensors and 4 kinds a layer");
    for (size_t i = 0, l = 0; i < t.size(); i += 11, l += 4)
      layers.push_back(Layer{t[i], t[i + 1], t[i + 2], t[i + 3], t[i + 4], t[i + 5], t[i + 6], t[i + 7], t[i + 8],
                             t[i + 9], t[i + 10], kinds[l], kinds[l + 1], kinds[l + 2], kinds[l + 3]});
    H = layers[0].in_norm.numel();
    I = layers[0].down.size(1) * (layers[0].down_kind == 3 || layers[0].down_kind == 5 ? 2 : 1);
  }

  // x [n, H] fp32 (the embeddings): the last layer's output [n, H]. cos, ssin [n, hd]: `llama.rotary_tables`'.
  // k, v: the request's cache [layers, kv, capacity, hd] fp32, the new rows written at [length, length + n).
  // mask [groups * n, length + n] bool (True = attend), or empty: every key
  torch::Tensor forward(torch::Tensor x, torch::Tensor cos, torch::Tensor ssin, torch::Tensor k, torch::Tensor v,
                        int64_t length, torch::Tensor mask) {
    TORCH_CHECK(x.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && x.is_contiguous() &&
                k.is_contiguous() && v.is_contiguous() && cos.is_contiguous() && ssin.is_contiguous(),
                "decoder step: contiguous fp32 operands");
    const int64_t n = x.size(0), groups = heads / kv, cap = k.size(2), L = length + n, half = hd / 2;
    const int64_t width = (heads + 2 * kv) * hd;
    TORCH_CHECK(L <= cap, "decoder step: cache overflow");
    auto h = x.clone();
    std::vector<float> normed(n * H), qkv(n * width), q(heads * n * hd), att(heads * n * hd), flat(n * heads * hd),
        out(n * H), gu(n * 2 * I), mixed(n * I);
    float* hp = h.data_ptr<float>();
    const float* cp = cos.data_ptr<float>();
    const float* sp = ssin.data_ptr<float>();
    const bool* mp = mask.numel() ? mask.data_ptr<bool>() : nullptr;
    for (size_t l = 0; l < layers.size(); ++l) {
      const Layer& y = layers[l];
      float* kl = k.data_ptr<float>() + l * kv * cap * hd;
      float* vl = v.data_ptr<float>() + l * kv * cap * hd;
      rms_norm(hp, y.in_norm.data_ptr<float>(), normed.data(), n, H, eps);
      linear(y.qkv_kind, normed.data(), y.qkv, y.qkv_s, y.qkv_b.numel() ? y.qkv_b.data_ptr<float>() : nullptr, qkv.data(),
             n, H, width);
      // rotary on q (into [heads, n, hd]: a key/value group's query heads folded into its rows) and k (into the
      // cache); v copied
      for (int64_t r = 0; r < n; ++r) {
        const float* row = qkv.data() + r * width;
        const float* c = cp + r * hd;
        const float* s = sp + r * hd;
        for (int64_t head = 0; head < heads + kv; ++head) {
          const float* src = row + head * hd;
          float* dst = head < heads ? q.data() + (head * n + r) * hd : kl + ((head - heads) * cap + length + r) * hd;
          for (int64_t d = 0; d < hd; ++d) dst[d] = src[d] * c[d] + src[(d + half) % hd] * s[d];
        }
        for (int64_t g = 0; g < kv; ++g)
          std::memcpy(vl + (g * cap + length + r) * hd, row + (heads + kv + g) * hd, hd * sizeof(float));
      }
      fo::attend<float>(q.data(), kl, vl, mp, att.data(), kv, groups * n, hd, L, cap * hd, hd, cap * hd, hd,
                        static_cast<float>(scaling));
      for (int64_t head = 0; head < heads; ++head)  // [heads, n, hd] -> [n, heads * hd]
        for (int64_t r = 0; r < n; ++r)
          std::memcpy(flat.data() + (r * heads + head) * hd, att.data() + (head * n + r) * hd, hd * sizeof(float));
      linear(y.o_kind, flat.data(), y.o, y.o_s, nullptr, out.data(), n, heads * hd, H);
      for (int64_t i = 0; i < n * H; ++i) hp[i] = hp[i] + out[i];
      rms_norm(hp, y.post_norm.data_ptr<float>(), normed.data(), n, H, eps);
      linear(y.gate_up_kind, normed.data(), y.gate_up, y.gate_up_s, nullptr, gu.data(), n, H, 2 * I);
      for (int64_t r = 0; r < n; ++r) {
        const float* g = gu.data() + r * 2 * I;
        float* m = mixed.data() + r * I;
        for (int64_t i = 0; i < I; i += 8) fo::store(m + i, silu(fo::load(g + i)) * fo::load(g + I + i));
      }
      linear(y.down_kind, mixed.data(), y.down, y.down_s, nullptr, out.data(), n, I, H);
      for (int64_t i = 0; i < n * H; ++i) hp[i] = hp[i] + out[i];
    }
    return h;
  }
};

}  // namespace step

