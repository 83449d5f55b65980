"""Llama-family forward pass over our own KV cache under an arbitrary (tree) attention mask.

Runs the weights of a transformers Llama decoder layer (SmolLM2, Vicuna, and the Hydra++
prefix layer, which is one such layer) without transformers' cache and mask machinery: one
call verifies a whole draft tree, whose nodes sit at position `committed + depth` and see the
committed prefix plus their own ancestors. Knows nothing about heads, trees or acceptance.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from .kv_cache import KVCache


def rotary(rotary_emb: torch.nn.Module, like: torch.Tensor, positions: torch.Tensor):
    """cos, sin for `positions` ([n]) as [1, n, head_dim], through the model's own rotary module."""
    return rotary_emb(like, positions[None])


def attention_mask(tree_mask: torch.Tensor | None, committed: int, n: int, device) -> torch.Tensor | None:
    """Boolean [n, committed + n] mask (True = attend), or None when plain causal suffices.

    `tree_mask` ([n, n]) gives the block among the new tokens; None means causal among them.
    """
    if n == 1:
        return None
    block = tree_mask if tree_mask is not None else torch.ones(n, n, dtype=torch.bool, device=device).tril()
    if committed == 0:
        return block
    return torch.cat([torch.ones(n, committed, dtype=torch.bool, device=device), block], dim=1)


# Largest row count for which the transposed product below beats F.linear on CPU (measured on
# 2 cores with SmolLM2's shapes: 30 layers of projections at 1 row 42.7 -> 16.6 ms, 4 rows 52.8 ->
# 25.2 ms, 64 rows 185 -> 162 ms). oneDNN's GEMV path for one row is the slow case.
_TRANSPOSED_MAX_ROWS = 64


def linear(x: torch.Tensor, layer: torch.nn.Linear) -> torch.Tensor:
    """layer(x) for x [..., in]; on CPU with few rows computed as (W @ x^T)^T with >= 2 columns."""
    rows = x.numel() // x.shape[-1]
    if x.device.type != "cpu" or rows > _TRANSPOSED_MAX_ROWS:
        return F.linear(x, layer.weight, layer.bias)
    flat = x.reshape(rows, x.shape[-1])
    if rows == 1:
        flat = flat.expand(2, -1).contiguous()
    out = (layer.weight @ flat.t()).t()[:rows]
    if layer.bias is not None:
        out = out + layer.bias
    return out.reshape(*x.shape[:-1], out.shape[-1])


def mlp(block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A LlamaMLP: down(act(gate(x)) * up(x))."""
    return linear(block.act_fn(linear(x, block.gate_proj)) * linear(x, block.up_proj), block.down_proj)


def decoder_layer(layer: torch.nn.Module, x: torch.Tensor, cos_sin, cache: KVCache, layer_index: int,
                  mask: torch.Tensor | None) -> torch.Tensor:
    """One LlamaDecoderLayer on x ([1, n, H]); writes its k/v into the cache's pending block."""
    attn = layer.self_attn
    n = x.shape[1]
    h = layer.input_layernorm(x)
    q = linear(h, attn.q_proj).view(1, n, -1, attn.head_dim).transpose(1, 2)  # [1, heads, n, hd]
    k = linear(h, attn.k_proj).view(1, n, -1, attn.head_dim).transpose(1, 2)  # [1, kv_heads, n, hd]
    v = linear(h, attn.v_proj).view(1, n, -1, attn.head_dim).transpose(1, 2)  # [1, kv_heads, n, hd]
    cos, sin = cos_sin
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    keys, values = cache.write(layer_index, k[0], v[0])  # [kv_heads, length + n, hd]
    out = F.scaled_dot_product_attention(
        q, keys[None], values[None], attn_mask=mask, scale=attn.scaling, enable_gqa=True
    )  # [1, heads, n, hd]
    x = x + linear(out.transpose(1, 2).reshape(1, n, -1), attn.o_proj)
    return x + mlp(layer.mlp, layer.post_attention_layernorm(x))


def forward_hidden(model, cache: KVCache, tokens: torch.Tensor, positions: torch.Tensor,
                   tree_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Final (post-norm) hidden states [n, H] of `tokens` ([n]) at `positions` ([n]).

    New tokens see all committed cache entries plus `tree_mask` among themselves (causal when
    None). Their k/v land in the cache's pending block; the caller decides what to keep.
    """
    base = model.model
    x = base.embed_tokens(tokens)[None]  # [1, n, H]
    cos_sin = rotary(base.rotary_emb, x, positions)
    mask = attention_mask(tree_mask, cache.length, tokens.numel(), tokens.device)
    for i, layer in enumerate(base.layers):
        x = decoder_layer(layer, x, cos_sin, cache, i, mask)
    return base.norm(x)[0]
