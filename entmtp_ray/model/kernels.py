"""The CPU kernel choices, in one place: how each projection of the forward is computed (packed
oneDNN products, the one-row rules, the drafting GEMV), the fused q/k/v and gate/up weights, the
caches of derived weights, the per-generation plans that hold them, and the shapes of the weights
`quantize_model` builds, for checks before any loads (`LayerShapes`). Why each choice, with its
measurements: docs/design.md §8 (the § marks below cite it). On CUDA every product is plain
F.linear. Knows nothing about attention, heads or trees.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from entmtp_ray.model import products
from entmtp_ray.model.quant import QuantWeight, quantize, refused, unsupported

# A one-token step on row-invariant products (packed oneDNN bf16, or quantized weights) runs its attention as
# this many copies of the token, each seeing the prefix and itself, so that its rows take the kernel a tree's
# rows take and node 0 of a tree rounds as the one-token step does (§7, §8); its products run on the token
# alone. Unquantized fp32 needs no copies.
ONE_TOKEN_ROWS = 4


_TRANSPOSED_MAX_ROWS = 64  # up to here (W x^T)^T beats F.linear on CPU (§8, unpacked path)


def matmul_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) for x [..., in]; on CPU with few rows computed as (W @ x^T)^T with >= 2 columns."""
    rows = x.numel() // x.shape[-1]
    if x.device.type != "cpu" or rows > _TRANSPOSED_MAX_ROWS:
        return F.linear(x, weight, bias)
    # contiguous rows: a transposed [in, rows] operand takes a path 5x slower (§8)
    flat = x.reshape(rows, x.shape[-1]).contiguous()
    if rows == 1:
        flat = flat.expand(2, -1).contiguous()
    out = (weight @ flat.t()).t()[:rows]
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _onednn_packing() -> bool:
    """Whether oneDNN can pack bf16 weights here: it needs AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT, which an AVX2-only
    CPU (some AMD EPYC hosts) lacks; there bf16 products take the unpacked path instead of failing to pack."""
    mkldnn = torch.ops.mkldnn
    return (torch.backends.mkldnn.is_available() and hasattr(mkldnn, "_reorder_linear_weight")
            and (not hasattr(mkldnn, "_is_mkldnn_bf16_supported") or bool(mkldnn._is_mkldnn_bf16_supported())))


@dataclass(frozen=True)
class Projection:
    """y = x W^T + b with the fastest kernel this stack has for the weight's device and dtype.

    bf16 on CPU: W prepacked once into oneDNN's blocked layout; a row rounds the same at every row
    count (one row is computed as `_ONE_ROW_AS`), so a tree's projections round as a one-token step's
    do. Autograd never takes the packed path (no backward); training gets `matmul_rows`. §8.
    """

    weight: torch.Tensor  # [out, in]
    bias: torch.Tensor | None  # [out]
    packed: torch.Tensor | None  # oneDNN layout of `weight`; None where it would not pay
    source: tuple[int, int]  # weight_key(weight) when built: a weight replaced or updated in place since is noticed
    # one-row products through ATen's native bf16 GEMV: faster, but rounding unlike multi-row products,
    # so for drafting only, whose rounding no output depends on (§8, the mkldnn toggle)
    draft_gemv: bool = False
    # the weight in int8/int4 (--quantize) for ATen's kernels: every product without autograd takes it (§8)
    quantized: QuantWeight | None = None
    # the weight for the row products (products.py): on CPU, every product without autograd takes it (§8)
    native: products.NativeWeight | None = None
    # the products' inputs asked for (`set_activations`; products.NativeWeight.integer says which weights take int8)
    marked_activations: str = "float"

    @classmethod
    def of(cls, weight: torch.Tensor, bias: torch.Tensor | None, scheme: str = "none",
           activations: str = "float") -> Projection:
        """`activations` int8: the row products take their inputs rounded to int8 where they hold 4-bit or Q8_0
        blocks (products.NativeWeight.integer); every other product keeps float inputs."""
        packed, quantized, native = None, None, None
        with torch.no_grad():
            if _takes_native(weight, scheme):
                native = products.NativeWeight.of(weight, scheme, activations)
            elif scheme != "none":
                quantized = quantize(weight, scheme)
            elif weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and _onednn_packing():
                packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
        return cls(weight, bias, packed, weight_key(weight), quantized=quantized, native=native,
                   marked_activations=activations)

    @property
    def scheme(self) -> str:
        held = self.native or self.quantized
        return held.scheme if held is not None else "none"

    @property
    def row_invariant(self) -> bool:
        """Whether a row rounds the same at every row count, one row included (packed, native and quantized
        products, §7), so that a one-token step may run its products on the token alone."""
        return self.packed is not None or self.quantized is not None or self.native is not None

    def for_drafting(self) -> Projection:
        """This projection for drafting, whose rounding no output depends on: one-row products through the faster
        GEMV (`draft_gemv`) where oneDNN packs, and an fp32 weight for the row products in Q8_0 blocks (a quarter of
        its bytes: `products.q8_0`) on int8 inputs (integer products, faster than widening the blocks to fp32,
        whatever the model's --activations). Made once per projection (the projection is remade when its weight
        changes)."""
        made = self.__dict__.get("_drafting")
        if made is None:
            native = self.native
            if native is not None and native.kind == products.KINDS[torch.float32, "none"] \
                    and self.weight.shape[1] % 32 == 0:
                native = products.q8_0(self.weight, "int8")
            made = dataclasses.replace(self, draft_gemv=self.packed is not None, native=native)
            object.__setattr__(self, "_drafting", made)  # a memo on a frozen dataclass: not a field
        return made

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.native is not None and not torch.is_grad_enabled():
            return self.native(x, self.bias)
        if self.quantized is not None and not torch.is_grad_enabled():
            out = self.quantized(x)
            return out if self.bias is None else out + self.bias
        if self.packed is not None and not torch.is_grad_enabled():
            if x.numel() == x.shape[-1]:
                if self.draft_gemv:
                    return _native_gemv(x, self.weight, self.bias)
                # one row, computed as 4 so that it rounds as a tree's rows do
                rows = x.reshape(1, -1).expand(_ONE_ROW_AS, -1).contiguous()
                out = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")
                return out[:1].view(*x.shape[:-1], -1)
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")
        return matmul_rows(x, self.weight, self.bias)


_ONE_ROW_AS = 4  # oneDNN's one-row kernel rounds unlike its multi-row one; four rows cost the same (§8)


def _native_gemv(x, weight, bias):
    """F.linear of one row through ATen's own bf16 GEMV (oneDNN switched off for the call)."""
    enabled = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        return F.linear(x, weight, bias)
    finally:
        torch._C._set_mkldnn_enabled(enabled)


def _takes_native(weight: torch.Tensor, scheme: str) -> bool:
    """Whether the row products (products.py) serve this weight: on CPU, quantized or fp32, and bf16 where oneDNN
    cannot pack it (oneDNN's packed bf16 products are row-invariant and faster where the CPU has native bf16, §8)."""
    if weight.dtype == torch.bfloat16 and scheme == "none" and _onednn_packing():
        return False
    return products.takes(weight, scheme)


def weight_key(weight: torch.Tensor) -> tuple[int, int]:
    """Where a weight lives and how often it was written in place: a derived tensor is stale when this changes."""
    return weight.data_ptr(), weight._version


def projection(layer: torch.nn.Linear) -> Projection:
    """The layer's Projection, built on first use and again if its weight was replaced or updated, or its
    quantization (`set_quantization`) changed."""
    cached = layer.__dict__.get("_entmtp_projection")
    scheme, inputs = quantization(layer), activations(layer)
    if cached is None or cached.source != weight_key(layer.weight) or cached.scheme != scheme \
            or cached.marked_activations != inputs:
        cached = Projection.of(layer.weight, layer.bias, scheme, inputs)
        layer.__dict__["_entmtp_projection"] = cached
    return cached


def set_quantization(layer: torch.nn.Linear, scheme: str) -> None:
    """Mark a linear layer's products for `scheme` (quant.SCHEMES); its Projection is rebuilt on next use."""
    layer.__dict__["_entmtp_quantize"] = scheme


def quantization(layer: torch.nn.Linear) -> str:
    return layer.__dict__.get("_entmtp_quantize", "none")


def set_activations(layer: torch.nn.Linear, inputs: str) -> None:
    """Mark a linear layer's products to take their inputs as `inputs` (products.ACTIVATIONS); its Projection is
    rebuilt on next use."""
    if inputs not in products.ACTIVATIONS:
        raise ValueError(f"activations {inputs!r}: choose one of {list(products.ACTIVATIONS)}")
    layer.__dict__["_entmtp_activations"] = inputs


def activations(layer: torch.nn.Linear) -> str:
    return layer.__dict__.get("_entmtp_activations", "float")


def linear(x: torch.Tensor, layer: torch.nn.Linear) -> torch.Tensor:
    """layer(x) through its Projection."""
    return projection(layer)(x)


@dataclass(frozen=True)
class FusedProjections:
    """One layer's q/k/v and gate/up weights, each pair of matmuls made one.

    The module's own q/k/v/gate/up weights are re-pointed to views of these tensors, so memory
    is not doubled; `source` holds the parts' weight keys, to notice a later `.to()` or in-place update
    of any of them (a Parameter re-pointed at a view keeps its own version counter).
    """

    qkv: Projection  # H -> (heads + 2 * kv_heads) * head_dim
    gate_up: Projection  # H -> 2 * I
    source: tuple[tuple[int, int], ...]
    scheme: str = "none"  # the parts' quantization (`set_quantization` on each)
    activations: str = "float"  # the parts' inputs (`set_activations` on each)


def _share(parts: list[torch.nn.Linear], fused: torch.Tensor, attribute: str) -> None:
    start = 0
    for part in parts:
        rows = getattr(part, attribute).shape[0]
        getattr(part, attribute).data = fused[start:start + rows]
        start += rows


def _parts_key(parts: list[torch.nn.Linear]) -> tuple[tuple[int, int], ...]:
    return tuple(weight_key(p.weight) for p in parts)


def fused_projections(layer: torch.nn.Module) -> FusedProjections:
    """The layer's FusedProjections, built on first use and again if its weights were replaced."""
    attn, block = layer.self_attn, layer.mlp
    qkv_parts, gate_up_parts = [attn.q_proj, attn.k_proj, attn.v_proj], [block.gate_proj, block.up_proj]
    fused = layer.__dict__.get("_entmtp_fused")
    scheme, inputs = quantization(attn.q_proj), activations(attn.q_proj)
    if fused is not None and fused.source == _parts_key(qkv_parts + gate_up_parts) and fused.scheme == scheme \
            and fused.activations == inputs:
        return fused
    with torch.inference_mode(False), torch.no_grad():  # plain tensors: the weights stay usable for training
        qkv = torch.cat([p.weight for p in qkv_parts])
        bias = torch.cat([p.bias for p in qkv_parts]) if attn.q_proj.bias is not None else None
        gate_up = torch.cat([p.weight for p in gate_up_parts])
        _share(qkv_parts, qkv, "weight")
        if bias is not None:
            _share(qkv_parts, bias, "bias")
        _share(gate_up_parts, gate_up, "weight")
    fused = FusedProjections(Projection.of(qkv, bias, scheme, inputs), Projection.of(gate_up, None, scheme, inputs),
                             _parts_key(qkv_parts + gate_up_parts), scheme, inputs)
    layer.__dict__["_entmtp_fused"] = fused
    return fused


@dataclass(frozen=True)
class Norm:
    """A LlamaRMSNorm's weight and epsilon, read once."""

    weight: torch.Tensor
    eps: float

    @classmethod
    def of(cls, norm: torch.nn.Module) -> Norm:
        return cls(norm.weight, norm.variance_epsilon)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The module's output, rounding as it does (normalise in fp32, then cast back and scale), in one
        fused kernel."""
        if x.dtype == torch.float32:
            return F.rms_norm(x, x.shape[-1:], self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), x.shape[-1:], None, self.eps).to(x.dtype)


@dataclass(frozen=True)
class LayerPlan:
    """One decoder layer's projections, norms and shapes, looked up once: a step reads them without
    re-checking weights or walking module attributes (each nn.Module lookup is a Python call)."""

    qkv: Projection
    gate_up: Projection
    o: Projection
    down: Projection
    input_norm: Norm
    post_attention_norm: Norm
    act: torch.nn.Module
    heads: int
    kv_heads: int
    head_dim: int
    scaling: float

    @classmethod
    def of(cls, layer: torch.nn.Module) -> LayerPlan:
        attn, fused = layer.self_attn, fused_projections(layer)
        hd = attn.head_dim
        return cls(fused.qkv, fused.gate_up, projection(attn.o_proj), projection(layer.mlp.down_proj),
                   Norm.of(layer.input_layernorm), Norm.of(layer.post_attention_layernorm), layer.mlp.act_fn,
                   attn.q_proj.out_features // hd, attn.k_proj.out_features // hd, hd, attn.scaling)

    @property
    def groups(self) -> int:
        """Query heads per key/value head (1 without grouped-query attention), for `attention_mask`."""
        return self.heads // self.kv_heads

    def for_drafting(self) -> LayerPlan:
        """This plan with one-row products through the faster GEMV (`Projection.draft_gemv`)."""
        return dataclasses.replace(self, qkv=self.qkv.for_drafting(), gate_up=self.gate_up.for_drafting(),
                                   o=self.o.for_drafting(), down=self.down.for_drafting())


@dataclass(frozen=True)
class ModelPlan:
    """Every projection of a model's forward, checked against its weights once: the decoder prepares a
    plan once per generation (checking every weight key per step would cost 2% of it, §8); weights
    changed after that are picked up by the next `prepare`.
    """

    layers: tuple[LayerPlan, ...]
    lm_head: Projection
    norm: Norm

    @property
    def row_invariant(self) -> bool:
        """Whether the layers' products round a row alike at every row count (packed bf16 or quantized)."""
        return self.layers[0].qkv.row_invariant


def quantize_model(model, scheme: str) -> None:
    """Mark every decoder-layer projection for `scheme` (quant.SCHEMES) and quantize them now, once: a weight the
    kernel cannot take is an error naming why, before any work. The lm_head too where the kernel takes its shape
    (else it stays in the model's dtype): in the embedded model it is a fifth of the weights and, left in fp32, most
    of a quantized step's bytes (§8). A tied embedding keeps its own values (the quantized copy is the Projection's,
    not the module's weight)."""
    for module in _decoder_linears(model):
        set_quantization(module, scheme)
    head = model.lm_head.weight
    takes_head = scheme == "none" or unsupported(*head.shape, head.device.type, head.dtype, scheme) is None
    set_quantization(model.lm_head, scheme if takes_head else "none")
    prepare(model)


def set_model_activations(model, inputs: str) -> None:
    """Mark every decoder-layer projection and the lm_head to take their inputs as `inputs` (products.ACTIVATIONS:
    int8 rounds them per group of 32 where the row products hold 4-bit or Q8_0 blocks) and rebuild them now."""
    for module in (*_decoder_linears(model), model.lm_head):
        set_activations(module, inputs)
    prepare(model)


def _decoder_linears(model) -> list[torch.nn.Linear]:
    """Every linear layer of the model's decoder layers, in order."""
    return [m for layer in model.model.layers for m in layer.modules() if isinstance(m, torch.nn.Linear)]


@dataclass(frozen=True)
class LayerShapes:
    """A decoder layer's sizes as a model's config states them: enough to know every weight `quantize_model`
    builds without loading one."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int

    @classmethod
    def of_config(cls, config: dict) -> LayerShapes:
        """From a config.json's fields, with transformers' Llama defaults (kv heads = heads, head_dim = hidden /
        heads)."""
        heads = config["num_attention_heads"]
        return cls(config["hidden_size"], config["intermediate_size"], heads,
                   config.get("num_key_value_heads") or heads,
                   config.get("head_dim") or config["hidden_size"] // heads)

    def projections(self) -> dict[str, tuple[int, int]]:
        """(out, in) of each weight quantize_model quantizes in every layer, as `LayerPlan.of` builds it (the lm_head
        only where the kernel takes it, so it never refuses a model)."""
        return {"qkv": ((self.heads + 2 * self.kv_heads) * self.head_dim, self.hidden),  # fused q/k/v
                "gate_up": (2 * self.intermediate, self.hidden),  # fused gate/up
                "o": (self.hidden, self.heads * self.head_dim),
                "down": (self.hidden, self.intermediate)}


def quantization_problem(shapes: LayerShapes, scheme: str, device_type: str, dtype: torch.dtype) -> str | None:
    """Why `quantize_model(model, scheme)` would fail, or is refused (quant.refused), for a model of `shapes` on
    `device_type` ('cpu' | 'cuda') with `dtype` activations: the first weight the kernel cannot take, by the rules
    `quantize` applies (quant.unsupported); None when every one can."""
    if scheme == "none":
        return None
    why = refused(scheme, device_type)
    if why:
        return why
    for name, (out_features, in_features) in shapes.projections().items():
        problem = unsupported(out_features, in_features, device_type, dtype, scheme)
        if problem:
            return (f"the {name} weight [{out_features}, {in_features}] cannot take it: {problem}; or run "
                    "--quantize none")
    return None


def prepare(model) -> ModelPlan:
    """The model's plan, with derived weights rebuilt for any weight replaced or updated since the last one."""
    return ModelPlan(tuple(LayerPlan.of(layer) for layer in model.model.layers), projection(model.lm_head),
                     Norm.of(model.model.norm))
