"""Fixed-order attention on CPU: each query row's result depends only on its own keys and values, never on how many
rows or keys share the call (docs/design.md §7). Knows nothing about trees or caches.

SDPA's CPU kernel reduces a row's softmax and weighted sum over all the keys of the call, the masked ones included
(exact zeros, but in another blocking), so a tree row that sees the prefix and its ancestors rounds unlike the
one-token step at its position, which sees the same keys alone (`tools/first_parting.py` finds it: the first
parting of every bf16 row on an AVX2 host). Here every row's scores are accumulated over the head dimension in
order (a vector lane per key), and its softmax sum and weighted sum run over its unmasked keys in position order,
in fp32: a tree row's keys (the prefix, then its ancestors) are the one-token step's keys in the same order, so
where the products are row-invariant too (bf16 on CPU, §8) the tree's rows are the steps' bit for bit.

Speed without giving that up: keys are read where they lie in the cache (a block of 8 keys x 8 lanes of d
transposed in registers, bf16/fp16 widened as loaded), fp32 values too (bf16/fp16 values are widened into a copy
once per call); four rows of a head share every key and value load (scores in blocks of 4 rows x 16 keys, the
weighted sum in blocks of 4 rows x 16 lanes of d, held in vector registers); e^x is a polynomial evaluated lane by
lane; and the three passes split across torch's threads (OpenMP) by blocks that never split one row's ordered sums.
Lanes never mix: whatever the blocking, a row's arithmetic is the same sequence of one-rounding operations, with no
contraction into FMA (-ffp-contract=off), so neither the thread count nor the row count changes a bit.

The kernel is C++ built once per machine (native.py: by `make setup`, else on first use; about 40 s). Where it
cannot be built, `fixed_order_ready()` is False, a warning says why once, and the forward keeps SDPA (greedy output
then equals AR's up to float ties, as before); ENTMTP_FIXED_ORDER_ATTENTION=0 keeps SDPA by
choice (a host where SDPA is faster and ties are acceptable).
"""

from __future__ import annotations

import os

import torch

from entmtp_ray.model import native

# fp32 too: with the row products (products.py) its products are row-invariant on CPU, so its trees are bitwise too
DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# the kernel's C++ is csrc/attention.cpp, compiled with the others by native.kernel()

_DISABLED = os.environ.get("ENTMTP_FIXED_ORDER_ATTENTION", "1") == "0"  # read once: uses_fixed_order runs per layer
_switch = native.ThreadSwitch()  # sdpa_only()
_NO_MASK = torch.empty(0, dtype=torch.bool)
_kernel = None  # the built module, once fixed_order_ready() found it


def switched_on() -> bool:
    """Whether ENTMTP_FIXED_ORDER_ATTENTION leaves the kernel on (told without building it)."""
    return not _DISABLED


def fixed_order_ready() -> bool:
    """Whether the kernel is built (building it on the first call); ENTMTP_FIXED_ORDER_ATTENTION=0 keeps SDPA."""
    global _kernel
    if _DISABLED:
        return False
    if _kernel is None:
        _kernel = native.kernel()
    return _kernel is not None


def sdpa_only():
    """Forwards inside (on this thread) keep SDPA: for benchmarks that time both attentions side by side."""
    return _switch.off()


def uses_fixed_order(q: torch.Tensor) -> bool:
    """Whether a forward on q's device and dtype takes the fixed-order attention: CPU, bf16/fp16, no autograd (the
    kernel has no backward; training keeps SDPA), kernel built."""
    return (q.device.type == "cpu" and q.dtype in DTYPES and not torch.is_grad_enabled()
            and not _switch.is_off and fixed_order_ready())


def fixed_order_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                          scale: float) -> torch.Tensor:
    """Attention of q [kv, R, hd] over k, v [kv, L, hd] (each kv head's R query rows), mask [R, L] (True = attend;
    None = every key): [kv, R, hd], each row a function of its own unmasked keys alone."""
    return _kernel.fixed_order_attention(q.contiguous(), k, v, _NO_MASK if mask is None else mask, scale)
