"""Drafting several lanes at once (`draft_together`, what the batched decoder calls) against each lane's drafter
drafting alone."""

from __future__ import annotations

import torch

from entmtp_ray.decode.drafting import HydraDrafter, draft_together
from entmtp_ray.decode.tree import build_buffers, load_topology, make_topology
from entmtp_ray.model.heads import init_heads
from helpers.tiny import make_tiny_llama


def _heads(model, seed: int):
    heads = init_heads(model, num_heads=4, seed=seed).eval()
    with torch.no_grad():  # away from the identity-like start, so that heads and lanes draft different tokens
        for p in heads.mlps.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(seed * 1000 + p.numel())))
    return heads


def test_lanes_drafted_together_draft_what_each_drafts_alone():
    """Lanes over the same heads whose trees differ in depth (4 and 2 levels) and width (at depth 2, two parents
    taking their best child beside Hydra's ten parents taking ten) share one trunk pass and one projection per
    depth, and each lane still gets the tokens its drafter drafts alone; a lane over other heads makes the whole
    call draft lane by lane."""
    model = make_tiny_llama(7)
    heads, other = _heads(model, 4), _heads(model, 5)
    drafters = [HydraDrafter(heads, model), HydraDrafter(heads, model), HydraDrafter(other, model)]
    fork = make_topology([(0,), (1,), (0, 0), (1, 0)], name="fork")
    trees = [load_topology("hydra", max_depth=4), fork, load_topology("hydra", max_depth=4)]
    buffers = [build_buffers(t) for t in trees]
    assert [len(b.levels) for b in buffers] == [4, 2, 4]
    assert (buffers[1].levels[1].top_k, buffers[1].levels[1].parent_paths.shape[0]) == (1, 2)
    assert buffers[0].levels[1].top_k > 1
    roots = [5, 11, 17]
    twin = HydraDrafter(heads, model)  # the third lane's context under the first heads
    with torch.inference_mode():
        for k, drafter in enumerate(drafters + [twin]):
            hidden = torch.randn(6, model.config.hidden_size, generator=torch.Generator().manual_seed(min(k, 2)))
            drafter.begin(hidden, torch.arange(6), capacity=64)
        alone = [d.draft(b, r) for d, b, r in zip(drafters, buffers, roots)]
        under_first_heads = twin.draft(buffers[2], roots[2])
        shared = draft_together(drafters[:2], buffers[:2], roots[:2])  # one pass: the same heads
        mixed = draft_together(drafters, buffers, roots)  # lane by lane: other heads in the call
        reversed_lanes = draft_together(drafters[1::-1], buffers[1::-1], roots[1::-1])  # the shallow lane first
    assert [t.numel() for t in alone] == [b.num_nodes for b in buffers]
    assert not torch.equal(under_first_heads, alone[2])  # the heads decide the tokens: a mixed call must not share
    for got in (shared, mixed[:2], reversed_lanes[::-1]):
        assert all(torch.equal(g, a) for g, a in zip(got, alone))
    assert torch.equal(mixed[2], alone[2])
