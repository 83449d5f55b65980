"""The verify seam: one call scores a set of requests' trees (docs/design.md §2, step 4).

A `Verifier` takes one `Tree` per request (its KV cache, the tree's buffers, its drafted tokens, the model's plan)
and returns one `Verified` each: the base model's last hidden state at every node and the verifier logits at the
tree's logit nodes, the tree's k/v left in that request's cache's pending block for `commit` to keep the accepted
path from. A lone request is a batch of one. Implementations:

- `DynamicVerifier`: eager, over each request's own growing cache; several requests share one forward
  (`llama.forward_hidden_batch`: the products once over every row, attention per request over its own cache).
- `static.StaticVerifier`: static shapes over one cache allocated once, replayed from a CUDA graph per tree
  when captured; one request a call (its cache is the verifier's).

The decode loop (`loop.SpecDecoder.verify`) and the batch (`batch.BatchDecoder`) verify only through this seam, so a
new backend (a compiled program per tree shape, another runtime) is one more implementation of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from entmtp_ray.decode.tree import TreeBuffers
from entmtp_ray.model.kernels import ModelPlan
from entmtp_ray.model.kv_cache import KVCache
from entmtp_ray.model.llama import Rows, forward_hidden_batch


@dataclass
class Tree:
    """One request's tree to score: its tokens at positions cache.length + depth, seeing the cache and the tree."""

    cache: KVCache
    buffers: TreeBuffers
    tokens: torch.Tensor  # [n] drafted tokens, root first
    plan: ModelPlan  # the model's projections and norms (kernels.prepare)


@dataclass
class Verified:
    """What one verification forward produced for the tree of a step."""

    buffers: TreeBuffers
    tokens: torch.Tensor  # [n] the tree's tokens, root first
    committed: int  # cache length before the step (position of the root)
    hidden: torch.Tensor  # [n, H] base model's last hidden state per node
    logits: torch.Tensor  # [rows, V] verifier logits at buffers.logit_nodes (the scored nodes' first)


class Verifier(Protocol):
    """Scores requests' trees (the static verifier: one request's, over its own cache)."""

    def __call__(self, trees: list[Tree]) -> list[Verified]: ...

    def add(self, trees: list[TreeBuffers]) -> None:
        """Prepare for more tree shapes (another policy's): a capture, a compile; nothing for eager verifiers."""


class DynamicVerifier:
    """Eager verification over each request's own cache; any number of requests in one forward. `forward`:
    the model's forward over several requests' rows (`llama.forward_hidden_batch`; a tool may pass the Python
    reference, `llama.reference_forward`)."""

    def __init__(self, model, forward=forward_hidden_batch):
        self.model, self.forward = model, forward

    def add(self, trees: list[TreeBuffers]) -> None:
        pass

    def __call__(self, trees: list[Tree]) -> list[Verified]:
        committed = [t.cache.length for t in trees]
        rows = [Rows(t.cache, t.tokens, length + t.buffers.depth_of, t.buffers.tree_mask)
                for t, length in zip(trees, committed)]
        plan = trees[0].plan
        hidden = self.forward(self.model, rows, plan)  # [n_i, H] each
        picked = [h[t.buffers.logit_nodes] for h, t in zip(hidden, trees)]
        if len(picked) == 1:
            logits = [plan.lm_head(picked[0])]
        else:  # every request's logit rows in one vocabulary projection
            logits = plan.lm_head(torch.cat(picked)).split([p.shape[0] for p in picked])
        return [Verified(t.buffers, t.tokens, length, h, lg)
                for t, length, h, lg in zip(trees, committed, hidden, logits)]


def verifier_stat(stat: str, logits: torch.Tensor) -> torch.Tensor:
    """The verifier statistic a signal reads at each row of logits [a, V] at T=1, [a] on the device:
    `entropy` (nats; log_softmax and one dot product per row) or `top1` (exp(max - logsumexp))."""
    logits = logits.float()
    if stat == "top1":
        return (logits.amax(-1) - torch.logsumexp(logits, dim=-1)).exp()
    log_probs = torch.log_softmax(logits, dim=-1).clamp_min_(-1e4)  # [a, V]; masked tokens: p = 0, finite
    return -torch.linalg.vecdot(log_probs.exp(), log_probs)


def verifier_stats(logits: torch.Tensor) -> tuple[list[float], list[float]]:
    """Entropy (nats) and top-1 probability of each row of logits [a, V] at T=1, on the host."""
    return verifier_stat("entropy", logits).tolist(), verifier_stat("top1", logits).tolist()
