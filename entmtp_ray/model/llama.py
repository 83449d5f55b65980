"""Llama-family forward pass over our own KV cache under an arbitrary (tree) attention mask.

Runs the weights of a transformers Llama decoder layer (SmolLM2, Vicuna, and the Hydra++
prefix layer, which is one such layer) without transformers' cache and mask machinery: one
call verifies a whole draft tree, whose nodes sit at position `committed + depth` and see the
committed prefix plus their own ancestors. Knows nothing about heads, trees or acceptance.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from entmtp_ray.model.kv_cache import KVCache


def rotary(rotary_emb: torch.nn.Module, like: torch.Tensor, positions: torch.Tensor):
    """cos, sin for `positions` ([n]) as [1, n, head_dim], through the model's own rotary module."""
    return rotary_emb(like, positions[None])


def attention_mask(tree_mask: torch.Tensor | None, committed: int, n: int, device,
                   groups: int = 1) -> torch.Tensor | None:
    """Boolean [groups * n, committed + n] mask (True = attend), or None when one token sees everything.

    `tree_mask` ([n, n]) gives the block among the new tokens; None means causal among them. The
    rows repeat once per query head of a key/value group, as `decoder_layer` folds them.
    """
    if n == 1:
        return None
    block = tree_mask if tree_mask is not None else torch.ones(n, n, dtype=torch.bool, device=device).tril()
    if committed:
        block = torch.cat([torch.ones(n, committed, dtype=torch.bool, device=device), block], dim=1)
    return block.repeat(groups, 1) if groups > 1 else block


# Largest row count for which the transposed product below beats F.linear on CPU (measured on
# 2 cores with SmolLM2's shapes: 30 layers of projections at 1 row 42.7 -> 16.6 ms, 4 rows 52.8 ->
# 25.2 ms, 64 rows 185 -> 162 ms). oneDNN's GEMV path for one row is the slow case.
_TRANSPOSED_MAX_ROWS = 64


def matmul_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) for x [..., in]; on CPU with few rows computed as (W @ x^T)^T with >= 2 columns."""
    rows = x.numel() // x.shape[-1]
    if x.device.type != "cpu" or rows > _TRANSPOSED_MAX_ROWS:
        return F.linear(x, weight, bias)
    # contiguous rows: a transposed [in, rows] operand (e.g. from an elementwise product of two
    # outputs of this function) sends mm down a path 5x slower for the 1536-wide down projection
    flat = x.reshape(rows, x.shape[-1]).contiguous()
    if rows == 1:
        flat = flat.expand(2, -1).contiguous()
    out = (weight @ flat.t()).t()[:rows]
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _onednn_packing() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


@dataclass(frozen=True)
class Projection:
    """y = x W^T + b with the fastest kernel this stack has for the weight's device and dtype.

    bf16 on CPU: W prepacked once into oneDNN's blocked layout (measured on 2 cores, 1536x576, cold
    weights: 0.091 ms against 0.134 for bf16 F.linear at 1 row; 0.119 against 0.187 at 16 rows, and
    0.359 for the fp32 product). A row rounds the same at every row count (one row is computed as
    four, `_ONE_ROW_AS`), so a tree's projections round as a one-token step's do (for attention,
    `forward_hidden` runs a one-token step as `ONE_TOKEN_ROWS` copies). Autograd never takes the
    packed path (it has no backward); training gets `matmul_rows`.
    """

    weight: torch.Tensor  # [out, in]
    bias: torch.Tensor | None  # [out]
    packed: torch.Tensor | None  # oneDNN layout of `weight`; None where it would not pay
    source: tuple[int, int]  # weight_key(weight) when built: a weight replaced or updated in place since is noticed
    # one-row products through ATen's native bf16 GEMV: 1.4x faster than the packed kernel here (30
    # layers' projections 7.7 against 11.1 ms, 2 cores) but it rounds 1 in 5 projections differently
    # from the packed kernel's multi-row results, so a one-token step would no longer round as a tree
    # node does; only for drafting, whose rounding no output depends on (`for_drafting`)
    draft_gemv: bool = False

    @classmethod
    def of(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> Projection:
        packed = None
        if weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and _onednn_packing():
            with torch.no_grad():
                packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
        return cls(weight, bias, packed, weight_key(weight))

    def for_drafting(self) -> Projection:
        """This projection with one-row products through the faster GEMV (`draft_gemv`)."""
        return dataclasses.replace(self, draft_gemv=self.packed is not None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
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


# oneDNN's packed product takes a kernel of its own for a single row, and for SmolLM2's down
# projection (K = 1536) it rounds 1 in 15 real activations differently from the same row inside a
# multi-row product (measured: 10 of 150 at 2, 3, 5 and 16 rows; 0 of 150 for every K = 576
# projection), so a one-token step and a tree's root disagreed in the last bit. Four rows take the
# multi-row kernel at no cost (forward + lm_head 21.2 ms at 1 row, 21.2 at 4, 21.4 at 3, 23.6 at 2).
_ONE_ROW_AS = 4


def _native_gemv(x, weight, bias):
    """F.linear of one row through ATen's own bf16 GEMV (oneDNN switched off for the call)."""
    enabled = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        return F.linear(x, weight, bias)
    finally:
        torch._C._set_mkldnn_enabled(enabled)


def weight_key(weight: torch.Tensor) -> tuple[int, int]:
    """Where a weight lives and how often it was written in place: a derived tensor is stale when this changes."""
    return weight.data_ptr(), weight._version


def projection(layer: torch.nn.Linear) -> Projection:
    """The layer's Projection, built on first use and again if its weight was replaced or updated."""
    cached = layer.__dict__.get("_entmtp_projection")
    if cached is None or cached.source != weight_key(layer.weight):
        cached = Projection.of(layer.weight, layer.bias)
        layer.__dict__["_entmtp_projection"] = cached
    return cached


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
    if fused is not None and fused.source == _parts_key(qkv_parts + gate_up_parts):
        return fused
    with torch.inference_mode(False), torch.no_grad():  # plain tensors: the weights stay usable for training
        qkv = torch.cat([p.weight for p in qkv_parts])
        bias = torch.cat([p.bias for p in qkv_parts]) if attn.q_proj.bias is not None else None
        gate_up = torch.cat([p.weight for p in gate_up_parts])
        _share(qkv_parts, qkv, "weight")
        if bias is not None:
            _share(qkv_parts, bias, "bias")
        _share(gate_up_parts, gate_up, "weight")
    fused = FusedProjections(Projection.of(qkv, bias), Projection.of(gate_up, None),
                             _parts_key(qkv_parts + gate_up_parts))
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
    """Every projection of a model's forward, checked against its weights once.

    Checking weight keys costs ~2 us each, ~0.45 ms over SmolLM2's 30 layers (2% of a step), so the
    decoder prepares a plan once per generation and reuses it for every step; weights changed after
    that are picked up by the next `prepare`.
    """

    layers: tuple[LayerPlan, ...]
    lm_head: Projection
    norm: Norm


def prepare(model) -> ModelPlan:
    """The model's plan, with derived weights rebuilt for any weight replaced or updated since the last one."""
    return ModelPlan(tuple(LayerPlan.of(layer) for layer in model.model.layers), projection(model.lm_head),
                     Norm.of(model.model.norm))


def rotary_tables(rotary_emb: torch.nn.Module, like: torch.Tensor, positions: torch.Tensor):
    """(cos, signed sin) for `decoder_layer`, each [1, n, head_dim]: the sin's first half negated, so that
    x * cos + roll(x, hd / 2) * signed_sin is transformers' x * cos + rotate_half(x) * sin bit for bit
    (a sign flip is exact) in 4 ops rather than 7."""
    cos, sin = rotary(rotary_emb, like, positions)
    half = sin.shape[-1] // 2
    return cos, torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)


def decoder_layer(layer: torch.nn.Module, x: torch.Tensor, tables, cache: KVCache, layer_index: int,
                  mask: torch.Tensor | None, plan: LayerPlan | None = None) -> torch.Tensor:
    """One LlamaDecoderLayer on x ([1, n, H]); writes its k/v into the cache's pending block.

    tables: from `rotary_tables`; mask: from `attention_mask(..., groups=LayerPlan.groups)`.
    """
    p = plan or LayerPlan.of(layer)
    n, hd, heads, kv_heads = x.shape[1], p.head_dim, p.heads, p.kv_heads
    qkv = p.qkv(p.input_norm(x)[0]).view(n, -1, hd).transpose(0, 1)  # [heads + 2kv, n, hd]
    cos, signed_sin = tables  # [1, n, hd] each
    qk = qkv[:heads + kv_heads]
    qk = qk * cos + qk.roll(hd // 2, -1) * signed_sin  # rotary on q and k at once
    keys, values = cache.write(layer_index, qk[heads:], qkv[heads + kv_heads:])  # [kv_heads, length + n, hd]
    # grouped-query attention with each group's query heads folded into rows of one head: on CPU
    # SDPA's enable_gqa path costs 4x more for one token (measured 113 against 26 us at 200 keys,
    # 536 against 95 at 1000, 2 cores); the mask rows are repeated to match (`attention_mask`)
    out = F.scaled_dot_product_attention(
        qk[:heads].reshape(1, kv_heads, -1, hd), keys[None], values[None], attn_mask=mask, scale=p.scaling
    )  # [1, kv_heads, (heads / kv_heads) * n, hd], the rows of one group's heads in turn
    x = x + p.o(out.view(heads, n, hd).transpose(0, 1).reshape(1, n, -1))
    gate, up = p.gate_up(p.post_attention_norm(x)).chunk(2, dim=-1)  # [1, n, I] each
    return x + p.down(p.act(gate) * up)


# A one-token step runs as this many copies of the token, each seeing the committed prefix and
# itself, and keeps the first. Kernels round a row differently when there are few of them: oneDNN's
# one-row product (see `_ONE_ROW_AS`) and CPU SDPA with 3 or fewer query rows per head (measured on
# SmolLM2: a one-token step's rows differed in the last bit from the same row inside a tree in 5 of
# 120 layer calls; 4 rows and up gave the bits of 192). With copies, node 0 of a tree and the
# one-token step agree bit for bit (20 of 20 steps, against 9 with one padded projection row and 5
# with none), so greedy trees leave AR's tokens only where attention over different tree shapes
# does, for the price of ~1% of a step (one-token forward + lm_head 24.4 against 24.1 ms, paired).
# Tried and not kept: every step reading one fixed key count (the cache's whole span, masked), which
# made chain nodes agree too, but cost 1.5% and moved a Hydra-tree output 3 ulps from transformers'
# logits in tests/test_greedy_exact.py, beyond the tie rule. Only for packed (oneDNN bf16) weights:
# fp32's one-row product (`matmul_rows`) already rounds as its multi-row one, and 4 rows cost it
# 30% of a step (GSM8K bench, fp32 AR 32.3 ms a step with copies against 24.6 without).
ONE_TOKEN_ROWS = 4


def forward_hidden(model, cache: KVCache, tokens: torch.Tensor, positions: torch.Tensor,
                   tree_mask: torch.Tensor | None = None, plan: ModelPlan | None = None) -> torch.Tensor:
    """Final (post-norm) hidden states [n, H] of `tokens` ([n]) at `positions` ([n]).

    New tokens see all committed cache entries plus `tree_mask` among themselves (causal when
    None). Their k/v land in the cache's pending block; the caller decides what to keep. One token
    on packed weights writes `ONE_TOKEN_ROWS` pending entries where the cache has room (the first
    is the token's).
    `plan`: from `prepare(model)`, for callers that run many forwards on unchanged weights.
    """
    base, plan = model.model, plan or prepare(model)
    if tokens.numel() == 1 and plan.lm_head.packed is not None and cache.length + ONE_TOKEN_ROWS <= cache.capacity:
        # copies that see only themselves: the token's row takes the kernels a tree's rows take
        tokens, positions = tokens.expand(ONE_TOKEN_ROWS), positions.expand(ONE_TOKEN_ROWS)
        tree_mask = torch.eye(ONE_TOKEN_ROWS, dtype=torch.bool, device=tokens.device)
        return forward_hidden(model, cache, tokens, positions, tree_mask, plan)[:1]
    x = base.embed_tokens(tokens)[None]  # [1, n, H]
    tables = rotary_tables(base.rotary_emb, x, positions)
    mask = attention_mask(tree_mask, cache.length, tokens.numel(), tokens.device, plan.layers[0].groups)
    for i, (layer, layer_plan) in enumerate(zip(base.layers, plan.layers)):
        x = decoder_layer(layer, x, tables, cache, i, mask, layer_plan)
    return plan.norm(x)[0]
