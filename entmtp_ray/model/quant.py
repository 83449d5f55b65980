"""Weight-only quantization of the base model's linear layers (`--quantize`): per-channel symmetric int8 and
group-wise asymmetric int4, computed by ATen's own weight-only kernels (the ones gpt-fast and torchao's CPU and
tinygemm layouts call): `_weight_int8pack_mm`, and `_weight_int4pack_mm_for_cpu` / `_weight_int4pack_mm` (CUDA).
The activations stay in the model's dtype; only the weights are stored in fewer bits. Why these kernels and what
they cost: docs/design.md §8. Knows nothing about layers, attention or trees: kernels.Projection calls `QuantWeight`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCHEMES = ("none", "int8", "int4")
# int4 groups along the input dimension: 32 weights share a scale and a zero. 32 and 64 cost the same on this
# CPU (docs/design.md §8), and 32 is the block of the embedded model's own Q4_1 weights, so it keeps them exactly
# up to the scale's rounding
INT4_GROUP = 32
_CUDA_INNER_K_TILES = 8  # tinygemm's layout (gpt-fast's default); the input dimension must divide by 16 * 8


@dataclass(frozen=True)
class QuantWeight:
    """One weight [out, in] in `scheme`, packed for its device's kernel; called as x W^T for x [..., in]."""

    scheme: str  # int8 | int4
    data: torch.Tensor  # int8 [out, in] | int4 packed for the device's kernel
    scales: torch.Tensor  # int8: [out]; int4: [in / group, out, 2] scale and zero, in the activations' dtype
    out_features: int
    group: int = 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).contiguous()
        if self.scheme == "int8":
            out = torch.ops.aten._weight_int8pack_mm(flat, self.data, self.scales)
        elif flat.device.type == "cpu":
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.data, self.group, self.scales)
        else:
            out = torch.ops.aten._weight_int4pack_mm(flat, self.data, self.group, self.scales)
        return out.view(*x.shape[:-1], self.out_features)


def unsupported(out_features: int, in_features: int, device_type: str, dtype: torch.dtype, scheme: str) -> str | None:
    """Why a weight [out_features, in_features] on `device_type` ('cpu' | 'cuda'), multiplied with `dtype`
    activations, cannot take `scheme` (a shape or dtype the kernel does not take), else None. One rule set for the
    weights `quantize` builds and for the config check that runs before any loads (kernels.quantization_problem)."""
    if scheme == "int4":
        if in_features % INT4_GROUP:
            return (f"its input size {in_features} is not a multiple of the int4 group ({INT4_GROUP}); int4 needs a "
                    "model whose layer sizes are multiples of it")
        if device_type == "cpu" and out_features % 16:
            return (f"its output size {out_features} is not a multiple of 16 (the CPU int4 kernel's block); int4 on "
                    "CPU needs a model whose layer sizes are multiples of 16")
        if device_type == "cuda":
            if dtype != torch.bfloat16:
                return "CUDA's int4 kernel (tinygemm) takes bf16 activations only: run --dtype bf16"
            if in_features % (16 * _CUDA_INNER_K_TILES) or out_features % 8:
                return (f"it does not tile for CUDA's int4 kernel (tinygemm: in % {16 * _CUDA_INNER_K_TILES}, "
                        "out % 8); int4 on CUDA needs a model whose layer sizes tile")
    return None


def refused(scheme: str, device_type: str) -> str | None:
    """Why `scheme` is not offered on `device_type` although its kernel runs there (it would lose to the unquantized
    weights), naming the fixes; None when it is. Checked with the config and by loading.load_model, not by
    `quantize`: a measurement (tools/gpu_check.py) still builds such weights to time them."""
    if scheme == "int8" and device_type == "cuda":
        return ("ATen's CUDA int8 kernel (_weight_int8pack_mm, aten/src/ATen/native/cuda/int8mm.cu) is a naive one: "
                "one thread per output, the activations cast to fp32, each thread looping over the inputs along its "
                "own weight row, so neighbouring threads read a row apart (uncoalesced) and the weights stream far "
                "below the bandwidth fp16 cuBLAS reaches; run unquantized fp16 (--quantize none), or --quantize int4 "
                "--dtype bf16 (tinygemm); tools/gpu_check.py's quantized stage measures int8 beside both")
    return None


def quantize(weight: torch.Tensor, scheme: str) -> QuantWeight:
    """`weight` ([out, in], any float dtype) quantized for its device; the scales take the weight's dtype, which is
    the activations' dtype the kernels need."""
    values, scales = quantized_values(weight, scheme)
    if scheme == "int8":
        return QuantWeight("int8", values, scales, weight.shape[0])
    if weight.device.type == "cpu":
        data = torch.ops.aten._convert_weight_to_int4pack_for_cpu(values, 1)
    else:
        data = torch.ops.aten._convert_weight_to_int4pack((values[:, ::2] << 4 | values[:, 1::2]).to(torch.uint8),
                                                          _CUDA_INNER_K_TILES)
    return QuantWeight("int4", data, scales, weight.shape[0], INT4_GROUP)


def quantized_values(weight: torch.Tensor, scheme: str) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight`'s values and scales in `scheme`, before any kernel's packing: int8 (values int8 [out, in], scales
    [out]) or int4 (`quantize_int4`'s), the scales in the weight's dtype. A weight the scheme cannot take is an
    error naming why."""
    problem = unsupported(*weight.shape, weight.device.type, weight.dtype, scheme)
    if problem:
        raise ValueError(f"--quantize {scheme}: a weight of shape {tuple(weight.shape)} cannot be quantized: {problem}")
    w = weight.detach().float()
    if scheme == "int8":
        scales = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny).to(weight.dtype)
        return torch.round(w / scales.float()[:, None]).clamp(-128, 127).to(torch.int8), scales
    if scheme != "int4":
        raise ValueError(f"--quantize {scheme!r}: choose one of {list(SCHEMES)}")
    return quantize_int4(w, INT4_GROUP, weight.dtype)


def quantize_int4(w: torch.Tensor, group: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(values [out, in] int32 in 0..15, scale and zero [in / group, out, 2] in `dtype`) of fp32 `w`, asymmetric per
    group of `group` inputs, in the kernels' convention w = (value - 8) * scale + zero. The values are rounded
    against the stored (rounded) scale and zero, so they are the nearest the stored numbers can give. The scale
    keeps bf16's 8 significant bits in any `dtype`, so that scale * value (4 bits) is exact in fp32: the row products
    widen a weight with one FMA, which rounds as a multiply then an add does only where the product is exact."""
    out_features, in_features = w.shape
    groups = w.reshape(out_features, in_features // group, group)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)  # [out, in / group]
    scale = ((high - low) / 15).clamp(min=1e-12).to(torch.bfloat16).to(dtype)
    zero = (low + 8 * scale.float()).to(dtype)
    values = torch.round((groups - zero.float()[..., None]) / scale.float()[..., None] + 8).clamp(0, 15)
    scales_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()  # [in / group, out, 2]
    return values.to(torch.int32).reshape(out_features, in_features), scales_zeros

