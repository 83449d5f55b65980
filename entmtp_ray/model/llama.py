"""Llama-family forward pass over our own KV cache under an arbitrary (tree) attention mask.

Runs the weights of a transformers Llama decoder layer (SmolLM2, Vicuna, and the Hydra++
prefix layer, which is one such layer) without transformers' cache and mask machinery: one
call verifies a whole draft tree, whose nodes sit at position `committed + depth` and see the
committed prefix plus their own ancestors. Which kernel each product takes: kernels.py. Knows
nothing about heads, trees or acceptance.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from entmtp_ray.model import step
from entmtp_ray.model.attention import fixed_order_attention, uses_fixed_order
from entmtp_ray.model.kernels import ONE_TOKEN_ROWS, LayerPlan, ModelPlan, prepare
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


def rotary_tables(rotary_emb: torch.nn.Module, like: torch.Tensor, positions: torch.Tensor):
    """(cos, signed sin) for `decoder_layer`, each [1, n, head_dim]: the sin's first half negated, so that
    x * cos + roll(x, hd / 2) * signed_sin is transformers' x * cos + rotate_half(x) * sin bit for bit
    (a sign flip is exact) in 4 ops rather than 7 (docs/design.md §8)."""
    cos, sin = rotary(rotary_emb, like, positions)
    half = sin.shape[-1] // 2
    return cos, torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)


def decoder_layer(layer: torch.nn.Module, x: torch.Tensor, tables, cache: KVCache, layer_index: int,
                  mask: torch.Tensor | None, plan: LayerPlan | None = None) -> torch.Tensor:
    """One LlamaDecoderLayer on x ([1, n, H]); writes its k/v into the cache's pending block.

    tables: from `rotary_tables`; mask: from `attention_mask(..., groups=LayerPlan.groups)`.
    """
    return decoder_layer_parts(layer, x, tables, [Part(cache, 0, x.shape[1], mask)], layer_index, plan)


@dataclass(frozen=True)
class Part:
    """One request's rows [start, end) of a batched forward: its own cache and its mask (`attention_mask`).
    `copies`: the rows are copies of one token (a one-token step, `forward_hidden`), which the products compute
    once: they hold one row of the layer's input and output, and all [start, end) only inside the attention."""

    cache: KVCache
    start: int
    end: int
    mask: torch.Tensor | None
    copies: bool = False


def decoder_layer_parts(layer: torch.nn.Module, x: torch.Tensor, tables, parts: list[Part], layer_index: int,
                        plan: LayerPlan | None = None, expand: torch.Tensor | None = None) -> torch.Tensor:
    """One LlamaDecoderLayer on the rows of several requests at once (x [1, M, H]): the projections and the MLP
    run once over all rows, the attention once per request over its own cache (the same call, on the same shapes,
    as the request alone: a part's rows round as they would alone wherever the products are row-independent,
    docs/design.md §8). `parts` tile the N rows the attention sees; with copies, `expand` ([N]) names each one's
    row of x (M < N), and the output has x's rows."""
    p = plan or LayerPlan.of(layer)
    hd, heads, kv_heads = p.head_dim, p.heads, p.kv_heads
    normed = p.input_norm(x)[0]  # [M, H]
    qkv = p.qkv(normed)  # [M, (heads + 2kv) * hd]
    if expand is not None:
        qkv = qkv.index_select(0, expand)
    n = qkv.shape[0]
    qkv = qkv.view(n, -1, hd).transpose(0, 1)  # [heads + 2kv, n, hd]
    cos, signed_sin = tables  # [1, n, hd] each
    qk = qkv[:heads + kv_heads]
    qk = qk * cos + qk.roll(hd // 2, -1) * signed_sin  # rotary on q and k at once
    fixed_order = uses_fixed_order(qk)
    outs = []
    for part in parts:
        rows, m = slice(part.start, part.end), part.end - part.start
        keys, values = part.cache.write(layer_index, qk[heads:, rows], qkv[heads + kv_heads:, rows])
        # grouped-query attention with each group's query heads folded into rows of one head (SDPA's enable_gqa
        # costs 4x more for one token on CPU, docs/design.md §8); the mask rows repeat to match. The queries are
        # made contiguous: a strided one-row query takes another CPU kernel, which rounds differently
        query = qk[:heads, rows].contiguous().view(kv_heads, -1, hd)
        if fixed_order:  # each row a function of its own keys alone: a tree row rounds as its one-token step
            out = fixed_order_attention(query, keys, values, part.mask, p.scaling)
        else:
            out = F.scaled_dot_product_attention(query[None], keys[None], values[None], attn_mask=part.mask,
                                                 scale=p.scaling)
        # [(1,) kv_heads, (heads / kv_heads) * m, hd], the rows of one group's heads in turn
        out = out.view(heads, m, hd).transpose(0, 1)
        # a copy sees only the prefix and itself: the first row is the token's (the others equal it)
        outs.append(out[:1].reshape(1, -1) if part.copies else out.reshape(m, -1))
    attended = outs[0] if len(outs) == 1 else torch.cat(outs)  # [M, heads * hd]
    projected = p.o(attended[None])  # [1, M, H]
    x = x + projected
    normed = p.post_attention_norm(x)
    fused = p.gate_up(normed)  # [1, M, 2I]
    gate, up = fused.chunk(2, dim=-1)  # [1, M, I] each
    mixed = p.act(gate) * up
    down = p.down(mixed)
    x = x + down
    return x


def forward_hidden(model, cache: KVCache, tokens: torch.Tensor, positions: torch.Tensor,
                   tree_mask: torch.Tensor | None = None, plan: ModelPlan | None = None) -> torch.Tensor:
    """Final (post-norm) hidden states [n, H] of `tokens` ([n]) at `positions` ([n]).

    New tokens see all committed cache entries plus `tree_mask` among themselves (causal when
    None). Their k/v land in the cache's pending block; the caller decides what to keep. One token
    on row-invariant products (packed or quantized, `ModelPlan.row_invariant`) writes `ONE_TOKEN_ROWS` pending
    entries where the cache has room (the first is the token's).
    `plan`: from `prepare(model)`, for callers that run many forwards on unchanged weights.
    """
    return forward_hidden_batch(model, [Rows(cache, tokens, positions, tree_mask)], plan)[0]


@dataclass(frozen=True)
class Rows:
    """One request's new tokens in a batched forward: its cache, tokens [n], positions [n] and tree mask
    ([n, n], None = causal), as `forward_hidden` takes them."""

    cache: KVCache
    tokens: torch.Tensor
    positions: torch.Tensor
    tree_mask: torch.Tensor | None = None


def forward_hidden_batch(model, requests: list[Rows], plan: ModelPlan | None = None) -> list[torch.Tensor]:
    """`forward_hidden` of several requests in one pass: each request's hidden states [n_i, H], its k/v in its
    own cache. The products run once over all rows (the weights are read once for every request); each
    request attends over its own cache with its own mask, as it would alone (`decoder_layer_parts`)."""
    base, plan = model.model, plan or prepare(model)
    if len(requests) == 1 and uses_fixed_order(base.embed_tokens.weight):
        native = step.for_model(model, plan)
        if native is not None:
            return [_native_forward(native, base, requests[0], plan)]
    return reference_forward(model, requests, plan)


def reference_forward(model, requests: list[Rows], plan: ModelPlan) -> list[torch.Tensor]:
    """`forward_hidden_batch` in Python, operation by operation (never the native step): what the native step is
    checked against, and what tools/first_parting.py observes through the plan's products and norms."""
    base = model.model
    device = requests[0].tokens.device
    tokens, positions, parts, start = [], [], [], 0
    expand, compact = [], 0  # each attention row's row of the products, and how many rows those have
    # the fixed-order attention rounds a row alike at any row count: no copies needed for it
    copying = plan.row_invariant and not uses_fixed_order(base.embed_tokens.weight)
    for r in requests:
        t, pos, tree_mask, cache = r.tokens, r.positions, r.tree_mask, r.cache
        copies = t.numel() == 1 and copying and cache.length + ONE_TOKEN_ROWS <= cache.capacity
        if copies:
            # copies that see only themselves: the token's attention takes the kernel a tree's rows take (its
            # products round alike at any row count, so they run on the token alone)
            pos, tree_mask = pos.expand(ONE_TOKEN_ROWS), torch.eye(ONE_TOKEN_ROWS, dtype=torch.bool, device=device)
        n = pos.numel()
        parts.append(Part(cache, start, start + n, attention_mask(tree_mask, cache.length, n, device,
                                                                   plan.layers[0].groups), copies))
        expand.extend([compact] * n if copies else range(compact, compact + n))
        compact += t.numel()
        tokens.append(t)
        positions.append(pos)
        start += n
    rows = [t.numel() for t in tokens]
    tokens = tokens[0] if len(tokens) == 1 else torch.cat(tokens)
    positions = positions[0] if len(positions) == 1 else torch.cat(positions)
    expand = None if compact == start else torch.tensor(expand, device=device)
    x = base.embed_tokens(tokens)[None]  # [1, M, H]
    tables = rotary_tables(base.rotary_emb, x, positions)
    for i, (layer, layer_plan) in enumerate(zip(base.layers, plan.layers)):
        x = decoder_layer_parts(layer, x, tables, parts, i, layer_plan, expand)
    x = plan.norm(x)[0]  # [M, H]
    return list(x.split(rows))  # [n_i, H] each


_NO_MASK = torch.empty(0, dtype=torch.bool)


def _native_forward(native, base, r: Rows, plan: ModelPlan) -> torch.Tensor:
    """`forward_hidden` of one request through the native step (step.py): the layers in one C++ call."""
    x = base.embed_tokens(r.tokens)  # [n, H]
    return plan.norm(native_layers(native, x, base.rotary_emb, r.cache, r.positions, r.tree_mask,
                                   plan.layers[0].groups))


def native_layers(native, x: torch.Tensor, rotary_emb: torch.nn.Module, cache: KVCache, positions: torch.Tensor,
                  tree_mask: torch.Tensor | None, groups: int) -> torch.Tensor:
    """The output [n, H] of the decoder layers a native step (step.py) holds, on inputs x [n, H] at `positions`,
    their k/v written into `cache`'s pending block: `decoder_layer`'s work, one C++ call for all the layers."""
    n = x.shape[0]
    if cache.length + n > cache.capacity:
        raise RuntimeError(f"KV cache overflow: {cache.length + n} > capacity {cache.capacity}")
    cos, signed_sin = rotary_tables(rotary_emb, x[None], positions)
    mask = attention_mask(tree_mask, cache.length, n, x.device, groups)
    return native.forward(x.contiguous(), cos[0].contiguous(), signed_sin[0].contiguous(), cache.k, cache.v,
                          cache.length, _NO_MASK if mask is None else mask)
