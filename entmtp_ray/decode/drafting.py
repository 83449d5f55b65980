"""Drafting: what proposes a step's tree tokens below its root. Hydra heads in production (`HydraDrafter`, one
trunk pass and one projection per depth, over one request or the lanes of a batch: `draft_together`), the root
alone for AR (`NoDrafter`); tests plug in oracles through the `Drafter` protocol."""

from __future__ import annotations

import copy
from typing import Protocol

import torch

from entmtp_ray.decode.tree import TreeBuffers
from entmtp_ray.model.heads import HeadsPlan, HydraHeads
from entmtp_ray.model.kernels import Projection, projection
from entmtp_ray.model.kv_cache import KVCache


class Drafter(Protocol):
    """Proposes the tree's tokens. Hydra heads in production; tests plug in oracles."""

    max_depth: int

    def begin(self, base_hidden: torch.Tensor, positions: torch.Tensor, capacity: int) -> None: ...

    def draft(self, buffers: TreeBuffers, root: int) -> torch.Tensor: ...

    def advance(self, base_hidden: torch.Tensor, positions: torch.Tensor) -> None: ...


class NoDrafter:
    """For AR-only policies: the root alone."""

    max_depth = 0

    def __init__(self, device):
        self.device = device

    def begin(self, base_hidden, positions, capacity):
        pass

    def draft(self, buffers, root):
        assert buffers.num_nodes == 1
        return torch.full((1,), root, dtype=torch.long, device=self.device)  # a fill, not a host-to-device copy

    def advance(self, base_hidden, positions):
        pass

    def lane(self) -> NoDrafter:
        return self


class HydraDrafter:
    """Grounded Hydra drafting: each depth runs its head once over all expanding parents.

    With `draft_vocab` ([K] token ids) each depth projects onto those K tokens only (rows of each
    head's vocabulary projection, taken once here), so a depth's cost stops growing with the vocabulary.
    """

    def __init__(self, heads: HydraHeads, model, draft_vocab: list[int] | None = None):
        self.heads = heads
        self.embed = model.model.embed_tokens
        self.lm_head = model.lm_head
        self.vocab_ids = None  # [K] token id of each column of the draft logits; None = all
        self.projections = None  # per head: a Projection onto the K rows, when drafting on a shortlist
        if draft_vocab:
            device = model.lm_head.weight.device
            self.vocab_ids = torch.tensor(draft_vocab, dtype=torch.long, device=device)  # [K]
            sources = heads.lm_heads if heads.lm_heads is not None else [model.lm_head] * heads.config.num_heads
            self.projections = [Projection.of(*_row_subset(source, self.vocab_ids)).for_drafting()
                                for source in sources]
        self.rotary = model.model.rotary_emb
        self.max_depth = heads.config.num_heads
        self.cache: KVCache | None = None
        self.context: torch.Tensor | None = None  # [H] context vector at the last committed position
        self.plan: HeadsPlan | None = None  # the heads' inference plan, prepared once per generation

    def begin(self, base_hidden, positions, capacity):
        self.plan = self.heads.prepare()
        if self.cache is None or self.cache.capacity < capacity:
            self.cache = self.heads.new_cache(capacity, base_hidden.dtype, base_hidden.device)
        if self.cache is not None:
            self.cache.reset()
        self.advance(base_hidden, positions)

    def lane(self) -> HydraDrafter:
        """A drafter over the same heads and projections with a cache and context of its own (SpecDecoder.lane)."""
        twin = copy.copy(self)
        twin.cache, twin.context, twin.plan = None, None, None
        return twin

    def advance(self, base_hidden, positions):
        self.context = self.heads.context(base_hidden, positions, self.cache, self.rotary, self.plan)[-1]

    def draft(self, buffers: TreeBuffers, root: int) -> torch.Tensor:
        return draft_together([self], [buffers], [root])[0]

    def top_tokens(self, head: int, hidden: torch.Tensor, k: int) -> torch.Tensor:
        """Head `head`'s k best tokens ([rows, k], best first) from its trunk output hidden [rows, H]."""
        if self.projections is None:  # over [rows, V], as drafting multiplies (`Projection.for_drafting`)
            source = self.lm_head if self.heads.lm_heads is None else self.heads.lm_heads[head]
            return projection(source).for_drafting()(hidden).topk(k, dim=-1).indices
        return self.vocab_ids[self.projections[head](hidden).topk(k, dim=-1).indices]  # over [rows, K]


def draft_together(drafters: list, buffers: list[TreeBuffers], roots: list[int]) -> list[torch.Tensor]:
    """Each request's tree drafted ([n_i] tokens each, root first) by its HydraDrafter, with one trunk pass and one
    projection per depth over the expanding parents of every request (lanes of one batch: the same heads, each
    with its own context vector); one drafter is HydraDrafter.draft. Drafters of another kind draft one by one."""
    first = drafters[0]
    if not all(isinstance(d, HydraDrafter) and d.heads is first.heads for d in drafters):
        return [d.draft(b, r) for d, b, r in zip(drafters, buffers, roots)]
    device = first.context.device
    tokens = [torch.empty(b.num_nodes, dtype=torch.long, device=device) for b in buffers]  # [n_i] each
    for t, root in zip(tokens, roots):
        t[0] = root
    for depth in range(max(len(b.levels) for b in buffers)):
        active = [(i, b.levels[depth]) for i, b in enumerate(buffers) if depth < len(b.levels)]
        rows = []
        for i, level in active:
            paths = tokens[i][level.parent_paths]  # [parents, d] tokens root..parent
            parents = paths.shape[0]
            rows.append(torch.cat([drafters[i].context.expand(parents, -1), first.embed(paths).reshape(parents, -1)],
                                  dim=-1))
        head = active[0][1].head_index  # depth d is drafted by head d - 1 in every tree
        hidden = first.plan.trunks[head](rows[0] if len(rows) == 1 else torch.cat(rows))  # [all parents, H]
        top = first.top_tokens(head, hidden, max(level.top_k for _, level in active))  # [all parents, k], best first
        start = 0
        for (i, level), part in zip(active, rows):
            mine = top[start:start + part.shape[0], :level.top_k].reshape(-1)  # [parents * top_k]
            start += part.shape[0]
            tokens[i][level.node_start: level.node_start + level.child_select.numel()] = mine[level.child_select]
    return tokens


def _row_subset(layer: torch.nn.Linear, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Weight and bias of `layer`'s output features `rows`, copied (frozen: later changes to `layer` are not seen)."""
    with torch.no_grad():
        return layer.weight[rows].clone(), layer.bias[rows].clone() if layer.bias is not None else None
