"""Which drafted path to accept, and the token that follows it. No model inside.

Inputs are the tree's tokens and the verifier's logits at the *scored* nodes (those with
children: only their distributions decide acceptance), addressed through `row_of_node`.
A candidate path is a row of the tree's retrieve indices (root -> leaf, -1 padded). The
result is the accepted node chain, root first; its length is the step's accepted length
(the root counts as the bonus token the base model always contributes).
"""

from __future__ import annotations

import functools
import zlib

import torch

from entmtp_ray.config import TYPICAL_ALPHA, TYPICAL_EPSILON


def greedy_up_to_tie(logits: torch.Tensor, tokens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Whether each token ([...]) is the argmax of its row of logits ([..., V]) up to a float tie.

    A tie: within 2 units in the last place of the dtype the logits were computed in (in bf16 a
    logit of 13 is representable only to 0.0625, so a tree step's multi-row attention and a
    one-token step can round two candidates into either order), and never less than 1e-4 (fp32
    reduction-order noise). This is the one rule every greedy-exactness check applies.
    """
    logits = logits.float()
    best = logits.amax(-1)  # [...]
    tolerance = (2 * torch.finfo(dtype).eps * best.abs()).clamp_min(1e-4)
    return logits.gather(-1, tokens[..., None])[..., 0] >= best - tolerance


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """Index of each row's largest logit ([..., V] -> [...]), the first one on an exact tie, as
    `argmax`. `max(-1)` has the same documented semantics and runs ~4x faster over a bf16
    vocabulary on CPU (45 against 180 us for SmolLM2's 49152 logits), once per step on the hot path.
    """
    return logits.max(-1).indices


def _path_parts(tokens, row_of_node, retrieve):
    parent = retrieve[:, :-1]  # [paths, depth]
    child = retrieve[:, 1:]  # [paths, depth], -1 = pad
    valid = child >= 0
    # a valid child's parent is scored (a row below the scored count); a pad's row may be a leaf's: row 0
    parent_rows = torch.where(valid, row_of_node[parent.clamp(min=0)], 0)  # [paths, depth]
    child_tokens = tokens[child.clamp(min=0)]  # [paths, depth]
    return valid, parent_rows, child_tokens


def greedy_path(tokens: torch.Tensor, logits: torch.Tensor, row_of_node: torch.Tensor,
                retrieve: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The longest path whose every token is the verifier's argmax after its parent, on the device.

    tokens: [n]; logits: [scored, V]; row_of_node: [n] (-1 = unscored); retrieve: [paths, depth + 1].
    Returns (row of `retrieve`, accepted drafts on it), each [1]: no host synchronisation. Siblings are
    distinct tokens, so the accepted chain is unique and equals what plain greedy decoding would produce.
    """
    valid, parent_rows, child_tokens = _path_parts(tokens, row_of_node, retrieve)
    match = valid & (child_tokens == argmax_rows(logits)[parent_rows])
    lengths = match.long().cumprod(1).sum(1)  # [paths]
    best = lengths.argmax().view(1)
    return best, lengths.index_select(0, best)


def greedy_accept(tokens: torch.Tensor, logits: torch.Tensor, row_of_node: torch.Tensor,
                  retrieve: torch.Tensor) -> torch.Tensor:
    """greedy_path's accepted node indices [a], root first (reads the length back to the host)."""
    best, length = greedy_path(tokens, logits, row_of_node, retrieve)
    return retrieve[int(best), : int(length) + 1]


def typical_path(tokens: torch.Tensor, logits: torch.Tensor, row_of_node: torch.Tensor, retrieve: torch.Tensor,
                 temperature: float, epsilon: float = TYPICAL_EPSILON,
                 alpha: float = TYPICAL_ALPHA) -> tuple[torch.Tensor, torch.Tensor]:
    """Hydra/Medusa typical acceptance: accept x after parent p when
    p(x) > min(epsilon, alpha * exp(-H(p))), p the verifier distribution at `temperature`.

    The longest accepted prefix wins; ties go to the highest summed log-probability. Returns (row of
    `retrieve`, accepted drafts on it), each [1], without a host synchronisation (greedy_path's shapes).
    Not distribution-preserving (docs/design.md §2). At temperature 0 use greedy_path.
    """
    assert temperature > 0
    valid, parent_rows, child_tokens = _path_parts(tokens, row_of_node, retrieve)
    log_probs = torch.log_softmax(logits.float() / temperature, dim=-1)  # [scored, V]
    probs = log_probs.exp()
    entropy = -torch.special.xlogy(probs, probs).sum(-1)  # [scored]; 0 log 0 = 0 for masked logits
    threshold = torch.clamp(alpha * torch.exp(-entropy), max=epsilon)  # [scored]
    child_log_probs = log_probs[parent_rows, child_tokens]  # [paths, depth]
    accept = valid & (probs[parent_rows, child_tokens] > threshold[parent_rows])
    prefix = accept.long().cumprod(1)  # [paths, depth], 1 while still accepted
    lengths = prefix.sum(1)  # [paths]
    score = torch.where(prefix.bool(), child_log_probs, 0.0).sum(1)  # a masked token's -inf never meets a 0
    score = torch.where(lengths == lengths.max(), score, -float("inf"))  # nothing accepted: every path ties, row 0
    best = score.argmax().view(1)
    return best, lengths.index_select(0, best)


def typical_accept(tokens: torch.Tensor, logits: torch.Tensor, row_of_node: torch.Tensor, retrieve: torch.Tensor,
                   temperature: float, epsilon: float = TYPICAL_EPSILON, alpha: float = TYPICAL_ALPHA) -> torch.Tensor:
    """typical_path's accepted node indices [a], root first (reads the length back to the host)."""
    best, length = typical_path(tokens, logits, row_of_node, retrieve, temperature, epsilon, alpha)
    return retrieve[int(best), : int(length) + 1]


def exact_draws(tokens: torch.Tensor, logits: torch.Tensor, row_of_node: torch.Tensor, parent_of: torch.Tensor,
                temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    """What exact acceptance's walk reads, computed on the device in one go: [2, n] holding, per node,
    p(its token | its parent) under the verifier at `temperature` (the root: 1) and a uniform draw."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)  # [scored, V]
    parent_rows = row_of_node[parent_of.clamp(min=0)].clamp(min=0)  # [n]; every child's parent is scored
    child_p = torch.where(parent_of >= 0, probs[parent_rows, tokens], 1.0)
    uniforms = torch.rand(tokens.shape[0], generator=generator, device=probs.device)
    return torch.stack([child_p, uniforms])


def exact_walk(tokens: list[int], child_p: list[float], uniforms: list[float],
               children: tuple[tuple[int, ...], ...]) -> tuple[list[int], list[int]]:
    """Multi-candidate speculative sampling down the tree; preserves the verifier's distribution at T.

    From the root, a node's children are tried in rank order (SpecInfer / EAGLE-2 recursive
    rejection). Hydra drafts them deterministically (the heads' top-k, distinct tokens), so each
    child is a one-hot proposal: child x is accepted with probability r(x) under the current
    residual r, which starts as p (the verifier at T after the node) and, after x is rejected,
    becomes p with x removed, renormalised. So P(child i accepted) = p(x_i) exactly, and if all
    are rejected the next token comes from p without them: every token keeps its probability
    under p. An accepted child becomes the node and the walk repeats.

    Host only, on exact_draws' values: tokens, child_p, uniforms: [n] per node; children: per node,
    child nodes in rank order. Returns (accepted nodes, root first; the tokens rejected after the last
    one), and the caller samples the next token from the last node's distribution at T with the
    rejected tokens removed.
    """
    node, path = 0, [0]
    while children[node]:
        rejected: list[int] = []
        remaining = 1.0  # residual mass: 1 - sum of p over rejected children
        for child in children[node]:
            x = tokens[child]
            if x in rejected:  # a repeated draft has no residual mass left
                continue
            p = child_p[child]
            if uniforms[child] * remaining < p:
                path.append(child)
                node = child
                break
            rejected.append(x)
            remaining -= p
        else:
            return path, rejected
    return path, []


def exact_accept(tokens, logits: torch.Tensor, row_of_node: torch.Tensor,
                 children: tuple[tuple[int, ...], ...], temperature: float,
                 generator: torch.Generator | None) -> tuple[list[int], list[int]]:
    """exact_walk over exact_draws for one tree step (one read back to the host).

    tokens: [n] node tokens (list or tensor); logits: [scored, V] verifier logits at the scored nodes;
    row_of_node: [n] (-1 = leaf); children: per node, child nodes in rank order.
    """
    assert temperature > 0
    device = logits.device
    tokens = torch.as_tensor(tokens, device=device)
    draws = exact_draws(tokens, logits, row_of_node, _parents(children, device), temperature, generator)
    n = tokens.numel()
    pulled = torch.cat([draws.double().reshape(-1), tokens.double()]).tolist()  # one read-back
    return exact_walk([int(t) for t in pulled[2 * n:]], pulled[:n], pulled[n:2 * n], children)


@functools.lru_cache(maxsize=256)
def _parents(children: tuple[tuple[int, ...], ...], device: torch.device) -> torch.Tensor:
    """Each node's parent ([n], root -1) on `device`, made once per tree: a host-to-device copy waits for
    the device, so not once per step."""
    parent_of = [-1] * len(children)
    for node, kids in enumerate(children):
        for child in kids:
            parent_of[child] = node
    return torch.tensor(parent_of, device=device)


def warp(logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0) -> torch.Tensor:
    """Logits ([..., V], fp32) whose softmax is the sampling distribution: at `temperature`, restricted to the
    `top_k` most likely tokens (0 = all; ties with the k-th all stay), then to the smallest set of those whose
    probability reaches `top_p` (transformers' and vLLM's order); -inf elsewhere. On the device, no read-back.
    Without top_p/top_k it is logits / T, so sampling from it at T=1 draws what sampling at T did."""
    x = logits.float() / temperature
    if 0 < top_k < x.shape[-1]:
        x = x.masked_fill(x < x.topk(top_k, dim=-1).values[..., -1:], float("-inf"))
    if top_p < 1.0:
        ordered, order = x.sort(dim=-1, descending=True)
        probs = ordered.softmax(dim=-1)
        drop = (probs.cumsum(dim=-1) - probs) >= top_p  # the mass before a token already reaches top_p; never the first
        x = x.masked_fill(torch.empty_like(drop).scatter_(-1, order, drop), float("-inf"))
    return x


def sample_token(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    """The token after the last accepted node, [1] on the device: argmax at T=0, else a sample at T.

    logits: [V]. The sample is `torch.multinomial(softmax(logits / T), 1)`'s own method (the argmax of
    p / q, q ~ Exp(1), one draw per token), so it draws the same token from the same generator state,
    without multinomial's checks that read the probabilities back to the host.
    """
    if temperature <= 0:
        return argmax_rows(logits).view(1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    q = torch.empty_like(probs).exponential_(1, generator=generator)
    return argmax_rows(probs / q).view(1)


def next_token(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> int:
    """sample_token, read back to the host."""
    return int(sample_token(logits, temperature, generator))


def row_generator(seed: int, row_id: str, device) -> torch.Generator:
    """A generator seeded from the run seed and the row id, so reruns and retries reproduce."""
    gen = torch.Generator(device=device)
    gen.manual_seed((seed * 1_000_003 + zlib.crc32(str(row_id).encode())) % (2**63))
    return gen
