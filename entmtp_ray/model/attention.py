"""Fixed-order attention on CPU: each query row's result depends only on its own keys and values, never on how many
rows or keys share the call (docs/design.md §7). Knows nothing about trees or caches.

SDPA's CPU kernel reduces a row's softmax and weighted sum over all the keys of the call, the masked ones included
(exact zeros, but in another blocking), so a tree row that sees the prefix and its ancestors rounds unlike the
one-token step at its position, which sees the same keys alone (`jobs/first_parting.py` finds it: the first
parting of every bf16 row on an AVX2 host). Here every row's scores are accumulated over the head dimension in
order (a vector lane per key), and its softmax sum and weighted sum run over its unmasked keys in position order,
in fp32: a tree row's keys (the prefix, then its ancestors) are the one-token step's keys in the same order, so
where the products are row-invariant too (bf16 on CPU, §8) the tree's rows are the steps' bit for bit.

The kernel is C++ built on first use by torch's extension loader (a C++ compiler and ninja; about 40 s, cached per
machine in torch's extensions folder, TORCH_EXTENSIONS_DIR when set; a build lock a killed build left is removed once
stale). Where it cannot be built, `fixed_order_ready()` is False, a warning says why once, and the forward keeps
SDPA (greedy output then equals AR's up to float ties, as before); ENTMTP_FIXED_ORDER_ATTENTION=0 keeps SDPA by
choice (a host where SDPA is faster and ties are acceptable).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# fp32 stays on SDPA: its products are not row-invariant on CPU anyway (MKL blocks by row count, §7), and fp32
# ties are rare enough that the tie rule covers them
DTYPES = (torch.bfloat16, torch.float16)
_NAME = "entmtp_fixed_order_attention_v3"  # a new kernel text needs a new name: the loader caches builds by name
# torch's loader holds a `lock` file in the build folder while it compiles and waits, with no time limit, for any
# lock it finds; a process killed mid-build (a Ray actor at the end of its job) leaves one behind, and every later
# process on the machine then hung at its first bf16 forward. A build takes about 40 s: a lock older than this was
# left by a dead build and is removed
STALE_BUILD_LOCK_S = 600.0

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <vector>

constexpr int64_t KEY_BLOCK = 64;

// q [kv, R, hd]; k, v [kv, L, hd] (views of a cache: unit stride in hd); mask [R, L] bool, or empty for every key.
template <typename T>
static void attend(const T* q, const T* k, const T* v, const bool* mask, T* out, int64_t kv, int64_t R,
                   int64_t hd, int64_t L, int64_t ks0, int64_t ks1, int64_t vs0, int64_t vs1, float scale) {
  // each head's keys transposed to fp32, once per call, into this thread's buffer (kept: a fresh one per call
  // would be mapped and faulted in by the allocator every time)
  thread_local std::vector<float> kt;
  if (kt.size() < static_cast<size_t>(kv * hd * L)) kt.resize(kv * hd * L);
  at::parallel_for(0, kv * L, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      int64_t h = i / L, j = i % L;
      const T* kj = k + h * ks0 + j * ks1;
      for (int64_t d = 0; d < hd; ++d) kt[(h * hd + d) * L + j] = static_cast<float>(kj[d]);
    }
  });
  at::parallel_for(0, kv * R, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s(L), acc(hd), qf(hd);
    for (int64_t i = begin; i < end; ++i) {
      int64_t h = i / R, r = i % R;
      const T* qr = q + (h * R + r) * hd;
      const float* kh = kt.data() + h * hd * L;
      // scores: one lane per key, each summed over d in order (no reassociation: -ffp-contract=off, no fast-math)
      for (int64_t d = 0; d < hd; ++d) qf[d] = static_cast<float>(qr[d]);
      for (int64_t j0 = 0; j0 < L; j0 += KEY_BLOCK) {  // a block of keys' scores held in registers over d
        int64_t w = std::min<int64_t>(KEY_BLOCK, L - j0);
        float acc[KEY_BLOCK] = {0.f};
        for (int64_t d = 0; d < hd; ++d) {
          float qd = qf[d];
          const float* kd = kh + d * L + j0;
          for (int64_t t = 0; t < w; ++t) acc[t] += qd * kd[t];
        }
        for (int64_t t = 0; t < w; ++t) s[j0 + t] = acc[t];
      }
      const bool* mr = mask ? mask + r * L : nullptr;
      float m = -INFINITY;
      for (int64_t j = 0; j < L; ++j) {
        if (mr && !mr[j]) continue;
        s[j] *= scale;
        m = s[j] > m ? s[j] : m;
      }
      // the softmax sum and the weighted sum over the row's own keys, in position order
      float l = 0.f;
      for (int64_t d = 0; d < hd; ++d) acc[d] = 0.f;
      for (int64_t j = 0; j < L; ++j) {
        if (mr && !mr[j]) continue;
        float p = std::exp(s[j] - m);
        l += p;
        const T* vj = v + h * vs0 + j * vs1;
        for (int64_t d = 0; d < hd; ++d) acc[d] += p * static_cast<float>(vj[d]);
      }
      T* o = out + (h * R + r) * hd;
      for (int64_t d = 0; d < hd; ++d) o[d] = static_cast<T>(acc[d] / l);
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
"""

_DISABLED = os.environ.get("ENTMTP_FIXED_ORDER_ATTENTION", "1") == "0"  # read once: uses_fixed_order runs per layer
_lock = threading.Lock()
_kernel = None  # the built module; False once a build failed
_off = threading.local()  # sdpa_only() inside this thread
_NO_MASK = torch.empty(0, dtype=torch.bool)


def _build():
    global _kernel
    with _lock:
        if _kernel is None:
            try:
                from torch.utils.cpp_extension import load_inline

                folder = build_folder()
                folder.mkdir(parents=True, exist_ok=True)
                wait_for_build_lock(folder / "lock", STALE_BUILD_LOCK_S)
                _kernel = load_inline(_NAME, cpp_sources=[_SOURCE], functions=["fixed_order_attention"],
                                      extra_cflags=["-O3", "-march=native", "-ffp-contract=off"],
                                      build_directory=str(folder))
            except Exception as exc:  # noqa: BLE001 - no compiler, no ninja, no headers: SDPA serves instead
                log.warning("fixed-order attention could not be built (%s: %s); bf16/fp16 on CPU keeps SDPA, whose "
                            "greedy output equals AR's up to float ties. Install a C++ compiler and ninja for "
                            "bit-for-bit output", type(exc).__name__, str(exc).splitlines()[-1][:300] if str(exc)
                            else "")
                _kernel = False
    return _kernel


def build_folder() -> Path:
    """Where the kernel is built and cached: torch's extensions folder (TORCH_EXTENSIONS_DIR when set, else
    ~/.cache/torch_extensions), one folder per kernel and torch version, shared by every process of the machine."""
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    return Path(root) / f"{_NAME}-torch{torch.__version__}"


def wait_for_build_lock(lock: Path, stale_s: float, poll_s: float = 1.0) -> None:
    """Wait while another process's build holds `lock`; remove it, with a warning, once it is older than `stale_s`
    (its build died), so that torch's loader, which would wait on it forever, builds instead."""
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return
        if age > stale_s:
            log.warning("removing %s, left %.0f s ago by a kernel build that did not finish", lock, age)
            lock.unlink(missing_ok=True)
            return
        time.sleep(poll_s)


def fixed_order_ready() -> bool:
    """Whether the kernel is built (building it on the first call); ENTMTP_FIXED_ORDER_ATTENTION=0 keeps SDPA."""
    if _DISABLED:
        return False
    return bool(_kernel if _kernel is not None else _build())


@contextlib.contextmanager
def sdpa_only() -> Iterator[None]:
    """Forwards inside (on this thread) keep SDPA: for benchmarks that time both attentions side by side."""
    previous, _off.on = getattr(_off, "on", False), True
    try:
        yield
    finally:
        _off.on = previous


def uses_fixed_order(q: torch.Tensor) -> bool:
    """Whether a forward on q's device and dtype takes the fixed-order attention: CPU, bf16/fp16, no autograd (the
    kernel has no backward; training keeps SDPA), kernel built."""
    return (q.device.type == "cpu" and q.dtype in DTYPES and not torch.is_grad_enabled()
            and not getattr(_off, "on", False) and fixed_order_ready())


def fixed_order_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                          scale: float) -> torch.Tensor:
    """Attention of q [kv, R, hd] over k, v [kv, L, hd] (each kv head's R query rows), mask [R, L] (True = attend;
    None = every key): [kv, R, hd], each row a function of its own unmasked keys alone."""
    return _kernel.fixed_order_attention(q.contiguous(), k, v, _NO_MASK if mask is None else mask, scale)
