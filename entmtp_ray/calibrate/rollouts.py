"""Acceptance tables from self-rollouts: where the true next tokens rank in each head's drafts.

A self-rollout is the base model's own continuation of a calibration prompt. Along it, every
position t is a possible decoding step: the committed prefix ends at t, the root is token t+1,
and head k (drafting depth k+1, grounded on the true tokens t+1..t+1+k) should rank token
t+2+k first. One teacher-forced pass over the rollout gives those ranks for every t and depth
at once; growth.py turns them into trees. The numerics are the decoder's own (its forward, its
prefix-layer context, the drafter's vocab projection and draft vocabulary), so the table predicts
what decoding does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from entmtp_ray.decode.drafting import HydraDrafter
from entmtp_ray.decode.loop import SpecDecoder
from entmtp_ray.decode.verify import verifier_stats
from entmtp_ray.model.llama import forward_hidden
from entmtp_ray.model.kernels import linear

NOT_RANKED = -1  # the true token is not within the ranks a tree could use at that depth


@dataclass
class Rollout:
    """What a greedy decode of this rollout would see, step position by step position.

    rows[i]: rank row of the step whose root is rollout token i (t = first - 1 + i).
    entropy[i], top1[i]: the verifier's next-token entropy (nats, T=1) and top-1 probability at
    rollout token i, i.e. what a step observes at each accepted token.
    """

    rows: list[list[int]]
    entropy: list[float]
    top1: list[float]


@torch.inference_mode()
def measure_rollout(decoder: SpecDecoder, token_ids: Sequence[int], first: int,
                    max_ranks: Sequence[int]) -> Rollout:
    rows, hidden = _rank_rows(decoder, token_ids, first, max_ranks)
    entropy, top1 = verifier_stats(linear(hidden[first:], decoder.loaded.model.lm_head))
    return Rollout(rows, entropy, top1)


def rank_rows(decoder: SpecDecoder, token_ids: Sequence[int], first: int, max_ranks: Sequence[int]) -> list[list[int]]:
    """Rank rows for the steps of one rollout.

    token_ids: prompt + rollout; first: index of the rollout's first token (the first root), so
    rows start at t = first - 1. Row t holds, for each depth k+1 (k < len(max_ranks)), the rank of
    token t+2+k among head k's logits when that rank is below max_ranks[k], else NOT_RANKED (also
    past the rollout's end); a row ends at its first NOT_RANKED, as acceptance does.
    """
    return _rank_rows(decoder, token_ids, first, max_ranks)[0]


@torch.inference_mode()
def _rank_rows(decoder, token_ids, first, max_ranks) -> tuple[list[list[int]], torch.Tensor]:
    drafter = decoder.drafter
    if not isinstance(drafter, HydraDrafter):
        raise ValueError("acceptance tables need a drafter with heads (a policy that drafts)")
    heads, dev = drafter.heads, decoder.loaded.device
    n = len(token_ids)
    depth = min(len(max_ranks), heads.config.num_heads)
    ids = torch.tensor(list(token_ids), dtype=torch.long, device=dev)  # [n]
    positions = torch.arange(n, device=dev)  # [n]
    cache = decoder._cache_for(n)
    hidden = forward_hidden(decoder.loaded.model, cache, ids, positions)  # [n, H]
    cache.keep(positions)
    prefix_cache = heads.new_cache(n, hidden.dtype, dev)
    plan = heads.prepare()  # what drafting runs (its products' drafting copies), so the ranks are drafting's
    context = heads.context(hidden, positions, prefix_cache, drafter.rotary, plan)  # [n, H]
    embeds = drafter.embed(ids)  # [n, H]
    starts = torch.arange(first - 1, n - 1, device=dev)  # [m] step positions t (root t+1 exists)
    ranks = torch.full((starts.numel(), depth), NOT_RANKED, dtype=torch.long, device=dev)  # [m, depth]
    for k in range(depth):
        t = starts[starts + 2 + k < n]  # [m_k] positions whose depth-(k+1) target lies in the rollout
        if t.numel() == 0:
            break
        rows = torch.cat([context[t]] + [embeds[t + 1 + j] for j in range(k + 1)], dim=-1)  # [m_k, (k+2)H]
        # rank as drafting ranks (the drafter's own top-k, over its draft vocabulary): the position in
        # topk's order, which also settles ties the way the drafter does (bf16 logits tie often)
        top = drafter.top_tokens(k, plan.trunks[k](rows), max_ranks[k])  # [m_k, max_rank]
        hit = top == ids[t + 2 + k][:, None]  # [m_k, max_rank]
        ranks[: t.numel(), k] = torch.where(hit.any(-1), hit.int().argmax(-1), NOT_RANKED)
    out = []
    for row in ranks.tolist():
        cut = row.index(NOT_RANKED) + 1 if NOT_RANKED in row else len(row)
        out.append(row[:cut])
    return out, hidden
