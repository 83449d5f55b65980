"""Row products on CPU that read each weight once for all rows and round every row alike: y = x W^T (+ b) for the
weights in fp32, bf16, int8 (per output channel) or int4 (groups of 32 inputs, a scale and a minimum each: GGUF's
Q4_1 block). Knows nothing about layers or trees: kernels.Projection calls `NativeWeight`.

Why its own kernel (docs/design.md §8): MKL's fp32 products block by row count, so a tree's rows round unlike the
one-token step's (§7); ATen's int8 product is scalar for fp32 activations on x86 and its int4 one reads the weight
again per few rows, so a 64-node tree cost 8-10x a token where it should cost about the weight read.

The arithmetic: the outputs split into blocks of 4, across torch's threads; a block's weights are widened to fp32
once into a buffer in L1 (int4: d * q + m, int8: q, its scale applied to the sum), and every row's 4 sums run over
it, two rows at a time, in 8 lanes with FMA (where the CPU has it) over the inputs in order, then the lanes added in
one fixed order. Each (row, output) is the same sequence of roundings whatever the row count, the row's neighbours
or the thread count, so a row of a tree rounds as the one-token step's row does, bit for bit.

Built once per machine (native.py); ENTMTP_NATIVE_PRODUCTS=0 keeps torch's own products (oneDNN, MKL, ATen's
weight-only kernels).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from entmtp_ray.model import native
from entmtp_ray.model.quant import INT4_GROUP, quantized_values

KINDS = {(torch.float32, "none"): 0, (torch.bfloat16, "none"): 1, "int8": 2, "int4": 3}

# the kernel's C++ is csrc/products.cpp, compiled with the others by native.kernel()

_DISABLED = os.environ.get("ENTMTP_NATIVE_PRODUCTS", "1") == "0"
_NONE = torch.empty(0)
_switch = native.ThreadSwitch()  # switched_off()


def native_ready() -> bool:
    """Whether the kernel is built (building it on the first call); ENTMTP_NATIVE_PRODUCTS=0 keeps torch's own."""
    return not _DISABLED and not _switch.is_off and native.kernel() is not None


def switched_off():
    """Weights prepared inside (on this thread) keep torch's products: for benchmarks that time both side by side."""
    return _switch.off()


def takes(weight: torch.Tensor, scheme: str) -> bool:
    """Whether `weight` ([out, in]) with `scheme` can run here: CPU, fp32/bf16 or quantized, in % 32 (any out: the
    kernel's blocks of 4 outputs are filled with zero rows, `NativeWeight.of`)."""
    known = scheme != "none" or weight.dtype in (torch.float32, torch.bfloat16)
    return weight.device.type == "cpu" and known and weight.shape[1] % 32 == 0 and native_ready()


@dataclass(frozen=True)
class NativeWeight:
    """One weight [out, in] in the kernel's layout; called as x W^T (+ bias) for x [..., in]."""

    data: torch.Tensor  # fp32 / bf16 [out, in] (the weight itself), int8 [out, in], int4 bytes [out, in / 2]
    kind: int  # KINDS
    scales: torch.Tensor  # int8: fp32 [out]; int4: fp32 [out, in / 32, 2] (d, m) with w = d * q + m; else empty
    out_features: int  # the weight's; `data` and `scales` hold rows up to a multiple of 4 (zeros past it)
    scheme: str

    @classmethod
    def of(cls, weight: torch.Tensor, scheme: str) -> NativeWeight:
        """`weight` for the kernel: unquantized fp32/bf16 as it is (a view, no copy, where its rows fill the kernel's
        blocks of 4 outputs, else a copy with zero rows added), else quantized (quant.py's rounding: the same values
        ATen's kernels take)."""
        out_features = weight.shape[0]
        if scheme == "none":
            return cls(_fill(weight.detach()), KINDS[weight.dtype, "none"], _NONE, out_features, scheme)
        values, scales = quantized_values(weight, scheme)
        if scheme == "int8":
            return cls(_fill(values.to(torch.int8)), KINDS["int8"], _fill(scales.float()), out_features, scheme)
        scale, zero = scales[..., 0].float().t(), scales[..., 1].float().t()  # [out, in / 32] each
        minimum = zero - 8 * scale  # (q - 8) * scale + zero = scale * q + minimum
        return cls(_fill(pack_int4(values)), KINDS["int4"], _fill(torch.stack([scale, minimum], -1)), out_features,
                   scheme)

    @property
    def filled(self) -> bool:
        """Whether zero rows were added to fill the last block of outputs (the step takes no such weight)."""
        return self.data.shape[0] != self.out_features

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).contiguous()
        if self.filled:
            out = native.kernel().rows_linear(flat, self.data, self.kind, self.scales, _NONE)[:, :self.out_features]
            out = out if bias is None else out + bias
            return out.reshape(*x.shape[:-1], self.out_features)
        out = native.kernel().rows_linear(flat, self.data, self.kind, self.scales, _NONE if bias is None else bias)
        return out.view(*x.shape[:-1], self.out_features)


_BLOCK = 4  # the kernel's outputs per block (NB in csrc/products.cpp)


def _fill(rows: torch.Tensor) -> torch.Tensor:
    """`rows` ([out, ...]) contiguous, with zero rows added up to a multiple of the kernel's block of outputs."""
    missing = -rows.shape[0] % _BLOCK
    if not missing:
        return rows.contiguous()
    return torch.cat([rows, rows.new_zeros(missing, *rows.shape[1:])]).contiguous()


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """int4 values [out, in] (0..15) as bytes [out, in / 2]: each group of 32 in 16 bytes, value i of the group in
    byte i's low nibble and value i + 16 in its high one (GGUF's Q4_1 order)."""
    out_features, in_features = values.shape
    groups = values.reshape(out_features, in_features // INT4_GROUP, 2, INT4_GROUP // 2).to(torch.uint8)
    return (groups[:, :, 0] | groups[:, :, 1] << 4).reshape(out_features, in_features // 2).contiguous()
