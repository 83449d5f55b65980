"""Which drafted path to accept, and the token that follows it. No model inside.

Inputs are the tree's tokens and the verifier's logits at the *scored* nodes (those with
children: only their distributions decide acceptance), addressed through `row_of_node`.
A candidate path is a row of the tree's retrieve indices (root -> leaf, -1 padded). The
result is the accepted node chain, root first; its length is the step's accepted length
(the root counts as the bonus token the base model always contributes).
"""

from __future__ import annotations

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
    parent_rows = row_of_node[parent.clamp(min=0)].clamp(min=0)  # [paths, depth]; a valid child's parent is scored
    child_tokens = tokens[child.clamp(min=0)]  # [paths, depth]
    return valid, parent_rows, child_tokens


def greedy_accept(tokens: torch.Tensor, logits: torch.Tensor, row_of_node: torch.Tensor,
                  retrieve: torch.Tensor) -> torch.Tensor:
    """Longest path whose every token is the verifier's argmax after its parent.

    tokens: [n]; logits: [scored, V]; row_of_node: [n] (-1 = unscored); retrieve: [paths, depth + 1].
    Returns accepted node indices [a], root first. Siblings are distinct tokens, so the accepted
    chain is unique and equals what plain greedy decoding would produce.
    """
    valid, parent_rows, child_tokens = _path_parts(tokens, row_of_node, retrieve)
    match = valid & (child_tokens == argmax_rows(logits)[parent_rows])
    lengths = match.long().cumprod(1).sum(1)  # [paths]
    best = int(lengths.argmax())
    return retrieve[best, : int(lengths[best]) + 1]


def typical_accept(tokens: torch.Tensor, logits: torch.Tensor, row_of_node: torch.Tensor, retrieve: torch.Tensor,
                   temperature: float, epsilon: float = TYPICAL_EPSILON, alpha: float = TYPICAL_ALPHA) -> torch.Tensor:
    """Hydra/Medusa typical acceptance: accept x after parent p when
    p(x) > min(epsilon, alpha * exp(-H(p))), p the verifier distribution at `temperature`.

    The longest accepted prefix wins; ties go to the highest summed log-probability.
    Not distribution-preserving (docs/design.md §2). At temperature 0 use greedy_accept.
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
    lengths = prefix.sum(1)
    longest = int(lengths.max())
    if longest == 0:
        return retrieve[0, :1]
    score = (child_log_probs * prefix).sum(1)
    score = torch.where(lengths == longest, score, torch.full_like(score, -float("inf")))
    best = int(score.argmax())
    return retrieve[best, : longest + 1]


def exact_accept(tokens: list[int], logits: torch.Tensor, row_of_node: torch.Tensor,
                 children: tuple[tuple[int, ...], ...], temperature: float,
                 generator: torch.Generator | None) -> tuple[list[int], list[int]]:
    """Multi-candidate speculative sampling down the tree; preserves the verifier's distribution at T.

    From the root, a node's children are tried in rank order (SpecInfer / EAGLE-2 recursive
    rejection). Hydra drafts them deterministically (the heads' top-k, distinct tokens), so each
    child is a one-hot proposal: child x is accepted with probability r(x) under the current
    residual r, which starts as p (the verifier at T after the node) and, after x is rejected,
    becomes p with x removed, renormalised. So P(child i accepted) = p(x_i) exactly, and if all
    are rejected the next token comes from p without them: every token keeps its probability
    under p. An accepted child becomes the node and the walk repeats.

    tokens: [n] node tokens; logits: [scored, V] verifier logits at the scored nodes; row_of_node:
    [n] (-1 = leaf); children: per node, child nodes in rank order. Returns (accepted nodes, root
    first; the tokens rejected after the last one), and the caller samples the next token from the
    last node's distribution at T with the rejected tokens removed.
    """
    assert temperature > 0
    node, path = 0, [0]
    while children[node]:
        probs = torch.softmax(logits[int(row_of_node[node])].float() / temperature, dim=-1)  # [V]
        rejected: list[int] = []
        remaining = 1.0  # residual mass: 1 - sum of p over rejected children
        for child in children[node]:
            x = tokens[child]
            if x in rejected:  # a repeated draft has no residual mass left
                continue
            p = float(probs[x])
            if float(torch.rand((), generator=generator, device=probs.device)) * remaining < p:
                path.append(child)
                node = child
                break
            rejected.append(x)
            remaining -= p
        else:
            return path, rejected
    return path, []


def next_token(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> int:
    """The token after the last accepted node: argmax at T=0, else a sample at temperature T.

    logits: [V].
    """
    if temperature <= 0:
        return int(argmax_rows(logits))
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))
