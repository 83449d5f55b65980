"""Row products on CPU that read each weight once for all rows and round every row alike: y = x W^T (+ b) for the
weights in fp32, bf16, int8 (per output channel) or int4 (groups of 32 inputs, a scale and a minimum each: GGUF's
Q4_1 block). Knows nothing about layers or trees: kernels.Projection calls `NativeWeight`.

Why its own kernel (docs/design.md §8): MKL's fp32 products block by row count, so a tree's rows round unlike the
one-token step's (§7); ATen's int8 product is scalar for fp32 activations on x86 and its int4 one reads the weight
again per few rows, so a 64-node tree cost 8-10x a token where it should cost about the weight read.

The arithmetic: the outputs split into blocks of 4, across torch's threads; each group of 32 weights of a block is
widened to fp32 in registers as it is used (int4: d * q + m, q8_0: d * q, int8: q, its scale applied to the sum),
once for up to ROWS_PER_WIDENING rows (fp32 is read in place, two rows at a time), every row's sums in 8 lanes
with FMA (where the CPU has it) over the inputs in order, then the lanes added in one fixed order. Each (row,
output) is the same sequence of roundings whatever the row count, the row's neighbours or the thread count, so a
row of a tree rounds as the one-token step's row does, bit for bit.

Integer products (`activations` int8: 4-bit and Q8_0 blocks, `NativeWeight.integer`): each row's input is rounded
once a call to int8 per group of 32 (dx = max |x| / 127, as llama.cpp's Q8 activations), and a group's product is
d * dx * (the integer sum of weights times inputs, exact) + m * dx * (the sum of the inputs' integers), each group's
scaling added into fp32 lanes in order and the lanes in one fixed order: again one sequence of roundings per (row,
output) at any row count. AVX512-VNNI sums two groups a vector (vpdpbusd), AVX2 one (vpmaddubsw), other CPUs in plain
C++; each is row-invariant, not bitwise the others.

Built once per machine (native.py); ENTMTP_NATIVE_PRODUCTS=0 keeps torch's own products (oneDNN, MKL, ATen's
weight-only kernels).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch

from entmtp_ray.model import native
from entmtp_ray.model.quant import quantized_values

KINDS = {(torch.float32, "none"): 0, (torch.bfloat16, "none"): 1, "int8": 2, "int4": 3, "q8_0": 4,
         ("int4", "int8"): 5, ("q8_0", "int8"): 6}  # (weights, activations): integer products
# the inputs of a product: in the model's dtype, or rounded to int8 per group of 32 inputs (llama.cpp's Q8 activations)
ACTIVATIONS = ("float", "int8")
# the weights whose products can take int8 inputs: 4-bit and Q8_0 blocks (their data and scales as they are)
_INTEGER = {KINDS["int4"]: KINDS["int4", "int8"], KINDS["q8_0"]: KINDS["q8_0", "int8"]}

# the kernel's C++ is csrc/products.cpp, compiled with the others by native.kernel()

_DISABLED = os.environ.get("ENTMTP_NATIVE_PRODUCTS", "1") == "0"
# fp32 weights that are exactly GGUF blocks kept as those blocks (`exact_blocks`); 0 keeps every fp32 weight in fp32
_EXACT_BLOCKS = os.environ.get("ENTMTP_EXACT_BLOCKS", "1") != "0"
_NONE = torch.empty(0)
_switch = native.ThreadSwitch()  # switched_off()


def native_ready() -> bool:
    """Whether the kernel is built (building it on the first call); ENTMTP_NATIVE_PRODUCTS=0 keeps torch's own."""
    return not _DISABLED and not _switch.is_off and native.kernel() is not None


def native_expected() -> bool:
    """Whether the row products will serve and keep GGUF blocks as they are (`exact_blocks`), told without building
    the kernel (native.buildable)."""
    return not _DISABLED and _EXACT_BLOCKS and native.buildable()


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

    data: torch.Tensor  # fp32 / bf16 [out, in] (the weight itself), int8 / q8_0 [out, in], int4 bytes [out, in / 2]
    kind: int  # KINDS
    # int8: fp32 [out]; int4: fp32 [out, in / 32, 2] (d, m) with w = d * q + m; q8_0: fp32 [out, in / 32] (d) with
    # w = d * q; else empty
    scales: torch.Tensor
    out_features: int  # the weight's; `data` and `scales` hold rows up to a multiple of 4 (zeros past it)
    scheme: str

    @classmethod
    def of(cls, weight: torch.Tensor, scheme: str, activations: str = "float") -> NativeWeight:
        """`weight` for the kernel: unquantized fp32/bf16 as it is (a view, no copy, where its rows fill the kernel's
        blocks of 4 outputs, else a copy with zero rows added), else quantized (quant.py's rounding: the same values
        ATen's kernels take). `activations` int8: 4-bit or Q8_0 blocks take their inputs rounded to int8
        (`integer`); every other weight keeps float inputs."""
        return cls._of(weight, scheme).integer(activations)

    @classmethod
    def _of(cls, weight: torch.Tensor, scheme: str) -> NativeWeight:
        out_features = weight.shape[0]
        if scheme == "none":
            blocks = exact_blocks(weight) if _EXACT_BLOCKS and weight.dtype == torch.float32 else None
            if blocks is not None:
                kind, data, scales = blocks
                return cls(_fill(data), kind, _fill(scales), out_features, scheme)
            return cls(_fill(weight.detach()), KINDS[weight.dtype, "none"], _NONE, out_features, scheme)
        values, scales = quantized_values(weight, scheme)
        if scheme == "int8":
            return cls(_fill(values.to(torch.int8)), KINDS["int8"], _fill(scales.float()), out_features, scheme)
        scale, zero = scales[..., 0].float().t(), scales[..., 1].float().t()  # [out, in / 32] each
        minimum = zero - 8 * scale  # (q - 8) * scale + zero = scale * q + minimum
        return cls(_fill(pack_int4(values)), KINDS["int4"], _fill(torch.stack([scale, minimum], -1)), out_features,
                   scheme)

    def integer(self, activations: str) -> NativeWeight:
        """This weight with its products' inputs rounded to int8 per group of 32 (`activations` int8), where it is
        4-bit or Q8_0 blocks; else itself."""
        if activations not in ACTIVATIONS:
            raise ValueError(f"activations {activations!r}: choose one of {list(ACTIVATIONS)}")
        if activations == "float" or self.kind not in _INTEGER:
            return self
        return dataclasses.replace(self, kind=_INTEGER[self.kind])

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
# rows that one widening of a weight group serves (block_few in csrc/products.cpp): up to it, another row costs
# its FMAs alone (about a tenth of the first row's product on an AVX2 EPYC); past it, the weights widen again
ROWS_PER_WIDENING = 8


def _fill(rows: torch.Tensor) -> torch.Tensor:
    """`rows` ([out, ...]) contiguous, with zero rows added up to a multiple of the kernel's block of outputs."""
    missing = -rows.shape[0] % _BLOCK
    if not missing:
        return rows.contiguous()
    return torch.cat([rows, rows.new_zeros(missing, *rows.shape[1:])]).contiguous()


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """int4 values [out, in] (0..15) as bytes [out, in / 2]: byte k of a row holds value 2k in its low nibble and
    value 2k + 1 in its high one, so each 4-byte word holds 8 consecutive values, the first in its lowest nibble (the
    kernel widens a word to 8 lanes by one shift per lane)."""
    out_features, in_features = values.shape
    pairs = values.reshape(out_features, in_features // 2, 2).to(torch.uint8)
    return (pairs[..., 0] | pairs[..., 1] << 4).contiguous()


_GROUP = 32  # GGUF's block: Q4_1 and Q8_0 alike


def q8_0(weight: torch.Tensor, activations: str = "float") -> NativeWeight:
    """fp32 `weight` [out, in] (in % 32) rounded to Q8_0 blocks, as llama.cpp quantizes them (per 32 inputs d = max
    |w| / 127, an fp16 value, q = round(w / d)): 1.125 bytes a weight, within half a step of d of each value. For
    products whose rounding no output depends on (drafting, `kernels.Projection.for_drafting`)."""
    out_features, in_features = weight.shape
    with torch.no_grad():
        groups = weight.detach().float().reshape(out_features, in_features // _GROUP, _GROUP)
        d = (groups.abs().amax(-1) / 127).half().float()
        values = torch.round(groups / d.clamp(min=torch.finfo(torch.float32).tiny)[..., None]).clamp(-127, 127)
    return NativeWeight(_fill(values.to(torch.int8).reshape(out_features, in_features)), KINDS["q8_0"],
                        _fill(d.contiguous()), out_features, "none").integer(activations)


def exact_blocks(weight: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor] | None:
    """(kind, data, scales) holding fp32 `weight` [out, in] exactly, where every group of 32 inputs is a GGUF block
    dequantized: Q4_1 (w = d * q + m, q in 0..15, d an fp16 value, m one too) as int4, else Q8_0 (w = d * q, q in
    -127..127, d an fp16 value) as q8_0; None where any group is not (a trained or converted fp32 weight).

    The kernel widens such a block to the very fp32 values the weight holds (d * q is exact in fp32: 11 bits of d
    times at most 8 of q, so d * q + m rounds once, as the dequantization did), so every product is the fp32 one bit
    for bit, reading 0.75 (int4) or 1.125 (q8_0) bytes a weight instead of 4. The embedded model's layers are Q4_1 and
    its embedding Q8_0 (its GGUF). Each candidate is checked on every value: a weight either rebuilds exactly or
    stays fp32."""
    out_features, in_features = weight.shape
    if in_features % _GROUP or not torch.isfinite(weight[:1]).all():
        return None
    with torch.no_grad():
        groups = weight.detach().reshape(out_features, in_features // _GROUP, _GROUP)
        # the first output's groups first: most weights that are not blocks show it there, at 1/out of the cost
        found = _q4_1(groups[:1]) and _q4_1(groups)
        if found is not None:
            values, d, m = found
            return KINDS["int4"], pack_int4(values.reshape(out_features, in_features)), torch.stack([d, m], -1)
        found = _q8_0(groups[:1]) and _q8_0(groups)
        if found is not None:
            values, d = found
            return KINDS["q8_0"], values.reshape(out_features, in_features), d
    return None


def _q4_1(groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(values uint8 [out, groups, 32], d, m [out, groups]) rebuilding `groups` exactly as Q4_1 blocks, or None."""
    low = groups.amin(-1)
    if not torch.equal(low.half().float(), low):  # Q4_1 stores the group's minimum as m (fp16): q = 0 there
        return None
    # the largest value has q = 15 (it quantizes to 15.5 rounded down), so d is its distance over 15, rounded to fp16
    d = ((groups.amax(-1) - low) / 15).half().float()
    values = torch.round((groups - low[..., None]) / d.clamp(min=torch.finfo(torch.float32).tiny)[..., None])
    values = values.clamp(0, 15)
    if not torch.equal(d[..., None] * values + low[..., None], groups):
        return None
    return values.to(torch.uint8), d.contiguous(), low.contiguous()


def _q8_0(groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(values int8 [out, groups, 32], d [out, groups]) rebuilding `groups` exactly as Q8_0 blocks, or None."""
    d = (groups.abs().amax(-1) / 127).half().float()
    values = torch.round(groups / d.clamp(min=torch.finfo(torch.float32).tiny)[..., None]).clamp(-127, 127)
    if not torch.equal(d[..., None] * values, groups):
        return None
    return values.to(torch.int8), d.contiguous()
