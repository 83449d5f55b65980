"""A drafter that knows the answer: it drafts the base model's own greedy continuation, with the
mistakes a test chooses, so that the decoder commits long, non-contiguous accepted paths on a tiny
random model whose Hydra heads would accept almost nothing; and the setting the oracle tests share
(test_decode_oracle, test_batch, test_stop, test_quant): PROMPT decoded MAX_NEW tokens through test trees,
with plans that move the true token to other ranks. No test lives here."""

from __future__ import annotations

from collections.abc import Callable

import torch

from entmtp_ray.decode.tree import chain_topology, load_topology, make_topology
from entmtp_ray.model.kv_cache import KVCache
from entmtp_ray.model.llama import forward_hidden

PROMPT = [3, 14, 15, 92, 65, 35]
MAX_NEW = 48
# 3 children at the root, 2 below the first, chains below: the rank-0 path's nodes are 0, 1, 4, 7, 9
BRANCHY_PATHS = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0], [0, 0, 0, 0]]

# (draft call, depth of the parent, 1-based) -> rank at which the true token sits among the
# parent's children, or None to leave it out (every child then is wrong and acceptance stops there)
Plan = Callable[[int, int], int | None]


def first_rank(call: int, depth: int) -> int | None:
    return 0


class OracleDrafter:
    """Drafts from `reference`, the greedy continuation of a prompt of `prompt_len` tokens.

    At each parent that lies on the true path, the true next token goes to the child of rank
    `plan(call, depth) % children` (None: nowhere); every other child gets a distinct wrong token.
    A rank above 0 puts the accepted path on later siblings, so the KV cache keeps a non-contiguous
    set of tree rows. `drafts` keeps every draft() call's tokens (one list per decoding step).
    """

    def __init__(self, reference: list[int], prompt_len: int, vocab: int, max_depth: int = 4,
                 plan: Plan = first_rank):
        self.reference, self.prompt_len, self.vocab = reference, prompt_len, vocab
        self.max_depth, self.plan = max_depth, plan
        self.committed = 0  # tokens in the base model's cache: prompt + committed output
        self.drafts: list[list[int]] = []

    def begin(self, base_hidden, positions, capacity):
        self.committed = int(positions[-1]) + 1

    def advance(self, base_hidden, positions):
        self.committed = int(positions[-1]) + 1

    def draft(self, buffers, root: int) -> torch.Tensor:
        at = self.committed - self.prompt_len  # output index of the root
        n = buffers.num_nodes
        tokens = [root] + [0] * (n - 1)
        on_path = [at < len(self.reference) and self.reference[at] == root] + [False] * (n - 1)
        depth_of = buffers.depth_of.tolist()
        for parent, kids in enumerate(buffers.children):
            if not kids:
                continue
            target = at + depth_of[parent] + 1
            truth = self.reference[target] if on_path[parent] and target < len(self.reference) else None
            rank = self.plan(len(self.drafts), depth_of[parent] + 1) if truth is not None else None
            slot = rank % len(kids) if rank is not None else None
            wrong = (t for t in range(self.vocab) if t != truth and t != root)
            for i, node in enumerate(kids):
                if i == slot:
                    tokens[node], on_path[node] = truth, True
                else:
                    tokens[node] = next(wrong)
        self.drafts.append(tokens)
        return torch.tensor(tokens, dtype=torch.long, device=buffers.depth_of.device)


def tree_of(name: str):
    """The test trees, built when a test runs (a broken tree module fails tests, not their import)."""
    if name == "branchy":
        return make_topology(BRANCHY_PATHS, "branchy")
    return chain_topology(int(name[5:])) if name.startswith("chain") else load_topology(name)


def rotating(call: int, depth: int) -> int | None:
    """The truth at rank (call + depth) % 3 of its parent's children; missing at depth 3 every 4th call."""
    return None if call % 4 == 3 and depth == 3 else call + depth


def assert_cache_holds_the_committed_prefix(loaded, decoder, result):
    """The decoder's cache rows equal a fresh causal prefill of prompt + the output it committed."""
    cache = decoder.cache
    length = min(cache.length, len(PROMPT) + result.num_output_tokens - 1)
    assert length > len(PROMPT)
    tokens = torch.tensor(PROMPT + result.output_token_ids)[:length]
    cfg = loaded.model.config
    fresh = KVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads,
                    length, torch.float32, "cpu")
    with torch.inference_mode():
        forward_hidden(loaded.model, fresh, tokens, torch.arange(length))
    torch.testing.assert_close(cache.k[:, :, :length], fresh.k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache.v[:, :, :length], fresh.v, atol=1e-5, rtol=1e-5)
