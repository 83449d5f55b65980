"""Llama-family forward pass over our own KV cache under an arbitrary (tree) attention mask.

Runs the weights of a transformers Llama decoder layer (SmolLM2, Vicuna, and the Hydra++
prefix layer, which is one such layer) without transformers' cache and mask machinery: one
call verifies a whole draft tree, whose nodes sit at position `committed + depth` and see the
committed prefix plus their own ancestors. Which kernel each product takes: kernels.py. Knows
nothing about heads, trees or acceptance.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

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
    p = plan or LayerPlan.of(layer)
    n, hd, heads, kv_heads = x.shape[1], p.head_dim, p.heads, p.kv_heads
    qkv = p.qkv(p.input_norm(x)[0]).view(n, -1, hd).transpose(0, 1)  # [heads + 2kv, n, hd]
    cos, signed_sin = tables  # [1, n, hd] each
    qk = qkv[:heads + kv_heads]
    qk = qk * cos + qk.roll(hd // 2, -1) * signed_sin  # rotary on q and k at once
    keys, values = cache.write(layer_index, qk[heads:], qkv[heads + kv_heads:])  # [kv_heads, length + n, hd]
    # grouped-query attention with each group's query heads folded into rows of one head (SDPA's
    # enable_gqa costs 4x more for one token on CPU, docs/design.md §8); the mask rows repeat to match
    out = F.scaled_dot_product_attention(
        qk[:heads].reshape(1, kv_heads, -1, hd), keys[None], values[None], attn_mask=mask, scale=p.scaling
    )  # [1, kv_heads, (heads / kv_heads) * n, hd], the rows of one group's heads in turn
    x = x + p.o(out.view(heads, n, hd).transpose(0, 1).reshape(1, n, -1))
    gate, up = p.gate_up(p.post_attention_norm(x)).chunk(2, dim=-1)  # [1, n, I] each
    return x + p.down(p.act(gate) * up)




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
