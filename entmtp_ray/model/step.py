"""The decoder layers of one request's forward as one native call on CPU: norms, products, rotary, cache writes,
attention, the MLP and the residuals in C++, with no Python between operators (docs/design.md §8).

It takes the path llama.decoder_layer_parts takes, operation by operation, in the same kernels where there is one:
the row products (products.py) and the fixed-order attention (attention.py), whose sources it compiles in; its own
code for the rest: an RMS norm summed in 8 lanes in order then the lanes in one fixed order, the rotary as the Python
forward computes it (x * cos + rolled x * signed sin: the same roundings), SiLU through the attention's polynomial
e^x. Every row's arithmetic is its own (the products and attention round a row alike at any row count, the rest is
row by row), so a tree row rounds as the one-token step at its position does, bit for bit. It serves fp32 models
whose every projection takes the row products (fp32, GGUF blocks, --quantize int8/int4; their inputs fp32 or, for
4-bit and Q8_0 blocks, int8: products.py's integer products), one request at a time; the Python forward serves the
rest and stays the reference (`tools/first_parting.py`).
"""

from __future__ import annotations

import os

import torch

from entmtp_ray.model import attention, native


# the kernel's C++ is csrc/step.cpp, compiled with the others by native.kernel()

_DISABLED = os.environ.get("ENTMTP_NATIVE_STEP", "1") == "0"


def native_expected() -> bool:
    """Whether the step may serve (not switched off, nor its fixed-order attention), told without building it."""
    return not _DISABLED and attention.switched_on()


def build(layers) -> object | None:
    """The native step of decoder layers whose plans are `layers` (kernels.LayerPlan, in order), or None where it
    does not serve: a model not in fp32 on CPU, a projection the row products do not hold, no fixed-order attention,
    no compiler, or ENTMTP_NATIVE_STEP=0. Built once per model and projections (`for_model`, `for_layers`)."""
    first = layers[0]
    projections = [p for layer in layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    kinds = [p.native.kind if p.native is not None else None for p in projections]
    if (_DISABLED or first.input_norm.weight.dtype != torch.float32 or first.input_norm.weight.device.type != "cpu"
            or not set(kinds) <= {0, 2, 3, 4, 5, 6} or any(p.native.filled for p in projections if p.native)
            or any(p.bias is not None for layer in layers
                                                                 for p in (layer.o, layer.gate_up, layer.down))
            or not attention.fixed_order_ready()):
        return None
    module = native.kernel()
    if module is None:
        return None
    empty = torch.empty(0)
    tensors = []
    for layer in layers:
        tensors += [layer.input_norm.weight.detach().contiguous(), layer.post_attention_norm.weight.detach().contiguous()]
        for p in (layer.qkv, layer.o, layer.gate_up, layer.down):
            tensors += [p.native.data, p.native.scales]
            if p is layer.qkv:
                tensors.append(empty if p.bias is None else p.bias.detach().float().contiguous())
    return module.Model(tensors, kinds, first.heads, first.kv_heads, first.head_dim, first.input_norm.eps,
                        first.scaling)


def for_model(model, plan) -> object | None:
    """`build(plan.layers)`, kept on the model until any of its projections is rebuilt (a weight replaced or
    requantized)."""
    return for_layers(model, plan.layers)


def for_layers(owner, layers) -> object | None:
    """`build(layers)`, kept on `owner` (the module holding them) until any of their projections is rebuilt."""
    projections = tuple(p for layer in layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down))
    cached = owner.__dict__.get("_entmtp_step")
    if cached is None or len(cached[0]) != len(projections) or any(a is not b for a, b in zip(cached[0], projections)):
        cached = (projections, build(layers))
        owner.__dict__["_entmtp_step"] = cached
    return cached[1]
