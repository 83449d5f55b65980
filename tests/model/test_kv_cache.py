"""KVCache write/keep, and tree verification over the cache against fresh prefills and transformers."""

from __future__ import annotations

import pytest
import torch

from entmtp_ray.model.kv_cache import KVCache
from entmtp_ray.model.llama import forward_hidden
from entmtp_ray.decode.tree import build_buffers, make_topology

# --- KVCache alone ----------------------------------------------------------------------------


def _block(n: int, start: float, layers: int = 2, kv_heads: int = 2, head_dim: int = 3):
    """Distinct k, v per (layer, head, position): k = start + position, v = -k, plus head/layer offsets."""
    pos = torch.arange(n, dtype=torch.float32)[None, :, None] + start  # [1, n, 1]
    k = [pos + 100 * layer + 10 * torch.arange(kv_heads, dtype=torch.float32)[:, None, None]
         + 0.1 * torch.arange(head_dim, dtype=torch.float32) for layer in range(layers)]  # [kv, n, hd] each
    return k, [-x for x in k]


def _filled(capacity: int = 16) -> tuple[KVCache, list, list]:
    cache = KVCache(2, 2, 3, capacity, torch.float32, "cpu")
    k, v = _block(2, 0.0)
    for layer in range(2):
        cache.write(layer, k[layer], v[layer])
    cache.keep(torch.arange(2))
    return cache, k, v


def test_write_returns_prefix_plus_block():
    cache, k0, v0 = _filled()
    k, v = _block(4, 50.0)
    keys, values = cache.write(1, k[1], v[1])
    assert keys.shape == (2, 6, 3) and values.shape == (2, 6, 3)
    assert torch.equal(keys[:, :2], k0[1]) and torch.equal(keys[:, 2:], k[1])
    assert torch.equal(values[:, 2:], v[1])
    assert cache.length == 2  # writing commits nothing


def test_keep_non_contiguous_commits_in_order():
    cache, k0, v0 = _filled()
    k, v = _block(6, 50.0)  # pending block positions 0..5
    for layer in range(2):
        cache.write(layer, k[layer], v[layer])
    cache.keep(torch.tensor([0, 2, 5]))
    assert cache.length == 5
    for layer in range(2):
        assert torch.equal(cache.k[layer, :, :2], k0[layer])
        assert torch.equal(cache.v[layer, :, :2], v0[layer])
        assert torch.equal(cache.k[layer, :, 2:5], k[layer][:, [0, 2, 5]])
        assert torch.equal(cache.v[layer, :, 2:5], v[layer][:, [0, 2, 5]])


def test_keep_contiguous_is_a_no_op_copy():
    cache, k0, v0 = _filled()
    k, v = _block(5, 50.0)
    for layer in range(2):
        cache.write(layer, k[layer], v[layer])
    before_k, before_v = cache.k.clone(), cache.v.clone()
    cache.keep(torch.arange(3))
    assert cache.length == 5
    assert torch.equal(cache.k, before_k) and torch.equal(cache.v, before_v)
    for layer in range(2):
        assert torch.equal(cache.k[layer, :, 2:5], k[layer][:, :3])


def test_commit_is_keep_of_the_first_entries():
    a, b = KVCache(2, 1, 4, 16, torch.float32, "cpu"), KVCache(2, 1, 4, 16, torch.float32, "cpu")
    for cache in (a, b):
        cache.write(0, torch.arange(12.0).view(1, 3, 4), torch.ones(1, 3, 4))
    a.commit(2)
    b.keep(torch.arange(2))
    assert a.length == b.length == 2 and torch.equal(a.k, b.k) and torch.equal(a.v, b.v)


def test_keep_nothing_and_reset():
    cache, _, _ = _filled()
    cache.keep(torch.tensor([], dtype=torch.long))
    assert cache.length == 2
    cache.reset()
    assert cache.length == 0


def test_next_write_overwrites_the_discarded_tail():
    cache, _, _ = _filled()
    k, v = _block(6, 50.0)
    for layer in range(2):
        cache.write(layer, k[layer], v[layer])
    cache.keep(torch.tensor([0, 3]))
    k2, v2 = _block(1, 900.0)
    keys, _ = cache.write(0, k2[0], v2[0])
    assert keys.shape[1] == 5
    assert torch.equal(keys[:, 2:4], k[0][:, [0, 3]]) and torch.equal(keys[:, 4:], k2[0])


def test_overflow_raises():
    cache, _, _ = _filled(capacity=6)
    k, v = _block(4, 0.0)
    cache.write(0, k[0], v[0])  # exactly full: fine
    k, v = _block(5, 0.0)
    with pytest.raises(RuntimeError, match="overflow: 7 > capacity 6"):
        cache.write(0, k[0], v[0])


# --- forward_hidden over the cache ------------------------------------------------------------


def _new_cache(model, capacity: int = 64) -> KVCache:
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    return KVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim, capacity, torch.float32, "cpu")


def _prefill(model, tokens: torch.Tensor) -> tuple[KVCache, torch.Tensor]:
    cache = _new_cache(model)
    positions = torch.arange(tokens.numel())
    hidden = forward_hidden(model, cache, tokens, positions)
    cache.keep(positions)
    return cache, hidden


PROMPT = torch.tensor([3, 14, 15, 92, 65, 35, 89, 79])


@torch.no_grad()
def test_forward_hidden_matches_transformers(tiny_llama):
    _, hidden = _prefill(tiny_llama, PROMPT)
    want = tiny_llama.model(PROMPT[None]).last_hidden_state[0]
    assert hidden.shape == (PROMPT.numel(), 32)
    torch.testing.assert_close(hidden, want, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_forward_hidden_incremental_matches_one_shot(tiny_llama):
    """Prefill 5, then 2, then 1 token (the n == 1 unmasked path): same states as one causal pass."""
    want = tiny_llama.model(PROMPT[None]).last_hidden_state[0]
    cache = _new_cache(tiny_llama)
    outs = []
    for lo, hi in [(0, 5), (5, 7), (7, 8)]:
        positions = torch.arange(lo, hi)
        outs.append(forward_hidden(tiny_llama, cache, PROMPT[lo:hi], positions))
        cache.keep(positions - lo)
    torch.testing.assert_close(torch.cat(outs), want, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_tree_verify_then_keep_equals_fresh_prefill(tiny_llama):
    # 0 root, 1 (0), 2 (1), 3 (0,0), 4 (1,0), 5 (1,1); accept the chain root -> (1) -> (1,0) = [0, 2, 4]
    buffers = build_buffers(make_topology([[0], [1], [0, 0], [1, 0], [1, 1]]))
    assert buffers.parent_of[4] == 2 and buffers.parent_of[2] == 0
    tokens = torch.tensor([11, 22, 33, 44, 55, 66])  # [n] one token per node
    cache, _ = _prefill(tiny_llama, PROMPT)
    committed = cache.length
    positions = committed + buffers.depth_of
    hidden = forward_hidden(tiny_llama, cache, tokens, positions, buffers.tree_mask)  # [n, H]

    # every node's hidden state equals a causal pass over prompt + its root->node chain
    for node in range(buffers.num_nodes):
        chain, i = [], node
        while i >= 0:
            chain.append(i)
            i = int(buffers.parent_of[i])
        seq = torch.cat([PROMPT, tokens[chain[::-1]]])
        want = tiny_llama.model(seq[None]).last_hidden_state[0, -1]
        torch.testing.assert_close(hidden[node], want, atol=1e-5, rtol=1e-5)

    accepted = torch.tensor([0, 2, 4])
    cache.keep(accepted)
    assert cache.length == committed + 3
    fresh, _ = _prefill(tiny_llama, torch.cat([PROMPT, tokens[accepted]]))
    assert fresh.length == cache.length
    n = cache.length
    torch.testing.assert_close(cache.k[:, :, :n], fresh.k[:, :, :n], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache.v[:, :, :n], fresh.v[:, :, :n], atol=1e-5, rtol=1e-5)

    # the next step continues from the kept path exactly as from the fresh prefill
    nxt = torch.tensor([77])
    h_tree = forward_hidden(tiny_llama, cache, nxt, torch.tensor([n]))
    h_fresh = forward_hidden(tiny_llama, fresh, nxt, torch.tensor([n]))
    torch.testing.assert_close(h_tree, h_fresh, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_tree_verify_of_a_three_depth_tree_keeps_deepest_path(tiny_llama):
    # 0 root, 1 (0), 2 (1), 3 (2), 4 (0,0), 5 (0,1), 6 (1,0), 7 (0,0,0); keep [0, 1, 4, 7]
    buffers = build_buffers(make_topology([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]))
    tokens = torch.tensor([5, 6, 7, 8, 9, 10, 11, 12])
    cache, _ = _prefill(tiny_llama, PROMPT[:5])
    hidden = forward_hidden(tiny_llama, cache, tokens, cache.length + buffers.depth_of, buffers.tree_mask)
    accepted = buffers.retrieve_indices[-1]
    assert accepted.tolist() == [0, 1, 4, 7]
    cache.keep(accepted)
    fresh, fresh_hidden = _prefill(tiny_llama, torch.cat([PROMPT[:5], tokens[accepted]]))
    n = cache.length
    assert n == 9
    torch.testing.assert_close(cache.k[:, :, :n], fresh.k[:, :, :n], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache.v[:, :, :n], fresh.v[:, :, :n], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hidden[accepted], fresh_hidden[5:], atol=1e-5, rtol=1e-5)


def test_keep_of_a_later_sibling_moves_its_row_even_when_the_count_matches():
    """[0, 2]: the root and the second child at depth 1; ends on index 2 with 2 entries kept, which
    a contiguity check must not mistake for rows already in place."""
    cache = KVCache(1, 1, 2, 8, torch.float32, "cpu")
    k = torch.arange(6, dtype=torch.float32).reshape(1, 3, 2)  # [kv_heads, n, head_dim]: rows 0, 1, 2
    cache.write(0, k, -k)
    cache.keep(torch.tensor([0, 2]))
    assert cache.length == 2
    assert cache.k[0, 0, :2].tolist() == [[0.0, 1.0], [4.0, 5.0]] and cache.v[0, 0, :2].tolist() == [[0.0, -1.0],
                                                                                                      [-4.0, -5.0]]
