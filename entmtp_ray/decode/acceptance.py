"""A step's acceptance: which drafted path the verifier accepts, and the token that follows it.

`accept(request, verified)` is the one call (the accept phase of decode/loop.py's step). It runs the request's
rule, one function each: `greedy` (T=0: the longest path of argmax tokens, exactly plain greedy's), `typical`
(Hydra/Medusa's threshold, when sampling and asked for) and `exact` (multi-candidate speculative sampling, the
default when sampling: the verifier's distribution kept). Each computes on the device and reads its answer back to
the host once (`read_back`, by name); a last node without logits costs one more, and exact acceptance's walk one
before it. The rules' tensor parts below take the tree's tokens and the verifier's logits at the *scored* nodes
(those with children: only their distributions decide acceptance), addressed through `row_of_node`; a candidate
path is a row of the tree's retrieve indices (root -> leaf, -1 padded). A step's accepted nodes are a chain from
the root; its length is the step's accepted length (the root counts as the bonus token the base model always
contributes). No model inside.
"""

from __future__ import annotations

import functools
import time
import zlib

import torch

from entmtp_ray.config import TYPICAL_ALPHA, TYPICAL_EPSILON, DecodingConfig
from entmtp_ray.decode.results import Accepted, Request
from entmtp_ray.decode.verify import Verified, verifier_stat


def accept(request: Request, verified: Verified) -> Accepted:
    """The step's accepted path and the token after it (the request's next root), under the request's rule."""
    if not verified.buffers.children[0]:  # the one-node tree drafted nothing: the root alone, no rule to run
        zero = torch.zeros(1, dtype=torch.long, device=verified.tokens.device)
        return _along(request, verified, zero, zero)
    cfg = request.cfg
    return RULES["greedy" if cfg.temperature <= 0 else cfg.acceptance](request, verified)


def greedy(request: Request, verified: Verified) -> Accepted:
    """Greedy acceptance: the longest path whose every token is the verifier's argmax after its parent."""
    buffers = verified.buffers
    return _along(request, verified, *greedy_path(verified.tokens, verified.logits[:buffers.num_scored],
                                                  buffers.row_of_node, buffers.retrieve_indices))


def typical(request: Request, verified: Verified) -> Accepted:
    """Typical acceptance at the request's temperature, epsilon and alpha (typical_path)."""
    cfg, buffers = request.cfg, verified.buffers
    return _along(request, verified, *typical_path(verified.tokens, verified.logits[:buffers.num_scored],
                                                   buffers.row_of_node, buffers.retrieve_indices, cfg.temperature,
                                                   cfg.typical_epsilon, cfg.typical_alpha))


def exact(request: Request, verified: Verified) -> Accepted:
    """Exact acceptance: the walk down the tree on the host (exact_accept's read-back) over the distribution
    --top-p/--top-k warp at T (given as T=1 logits), then the token after its path sampled from the last node's
    distribution, or from its residual where every child was rejected, read back with the path's tokens."""
    cfg, buffers, tokens = request.cfg, verified.buffers, verified.tokens
    warped = warp(verified.logits[:buffers.num_scored], cfg.temperature, cfg.top_p, cfg.top_k)
    path, rejected = exact_accept(tokens, warped, buffers.row_of_node, buffers.children, 1.0, request.generator)
    last = path[-1]
    chain = buffers.chains[last]  # the walk's path: the nodes root..last
    logits = warp(_logits_at(request, verified, last), cfg.temperature, cfg.top_p, cfg.top_k)  # [V]
    if rejected:  # every child of `last` was tried and rejected: sample from the residual
        logits = logits.index_fill(0, tokens[buffers.child_nodes[last]], float("-inf"))
    parts = {"next": sample_token(logits, 1.0, request.generator), "tokens": tokens[chain]}
    if request.logits_stat is not None:
        parts["stats"] = _path_stats(request.logits_stat, request, verified, chain)
    got = read_back(parts)
    return Accepted(chain, path, [int(t) for t in got["tokens"]], int(got["next"][0]), got.get("stats", []))


RULES = {"greedy": greedy, "typical": typical, "exact": exact}


def _along(request: Request, verified: Verified, best: torch.Tensor, length: torch.Tensor) -> Accepted:
    """The path a path rule chose (row `best` of the retrieve indices, `length` drafts on it, each [1] on the
    device) with its tokens, the token after it and the traced statistic at its nodes, read back once. The token
    after is computed with them when the last node has logits, which is right but for a leaf without them and free
    at T=0; under sampling it would spend the generator's draws, so only when surely right (leaf logits). A last
    node without logits costs a second read-back: its logits, the token after it and its statistic."""
    cfg, buffers, tokens, stat = request.cfg, verified.buffers, verified.tokens, request.logits_stat
    path = buffers.retrieve_indices.index_select(0, best)[0]  # [depth + 1], -1 padded after the leaf
    nodes = path.clamp(min=0)
    last_row = buffers.row_of_node[nodes].index_select(0, length)  # [1]; -1: the last node has no logits
    guess = buffers.leaf_logits or cfg.temperature <= 0
    parts = {"length": length, "nodes": nodes, "tokens": tokens[nodes]}
    if guess:
        parts["next"] = sample_next(cfg, verified.logits.index_select(0, last_row.clamp(min=0))[0], request.generator)
    if stat is not None:
        parts["stats"] = _path_stats(stat, request, verified, nodes)
    got = read_back(parts)  # the step's one read-back
    a = int(got["length"][0]) + 1
    node_ids = [int(i) for i in got["nodes"][:a]]
    accepted = [int(t) for t in got["tokens"][:a]]
    stats = got.get("stats", [])
    last = node_ids[-1]
    if guess and buffers.node_rows[last] >= 0:
        return Accepted(path[:a], node_ids, accepted, int(got["next"][0]), stats[:a])
    logits = _logits_at(request, verified, last)
    more = {"next": sample_next(cfg, logits, request.generator)}
    if stat is not None:
        more["stats"] = verifier_stat(stat, logits[None])
    after = read_back(more)
    return Accepted(path[:a], node_ids, accepted, int(after["next"][0]),
                    stats[:a - 1] + after["stats"] if stat is not None else [])


def _logits_at(request: Request, verified: Verified, node: int) -> torch.Tensor:
    """The verifier logits ([V]) after `node`: its row, or a projection of its hidden state when it has none."""
    row = verified.buffers.node_rows[node]
    return verified.logits[row] if row >= 0 else request.plan.lm_head(verified.hidden[node])


def _path_stats(stat: str, request: Request, verified: Verified, nodes: torch.Tensor) -> torch.Tensor:
    """The statistic at each of `nodes` ([k] on the device) that has logits (garbage at the others); its
    time counts as scheduling (on CUDA: the time to queue it)."""
    start = time.perf_counter()
    rows = verified.buffers.row_of_node[nodes].clamp(min=0)
    values = verifier_stat(stat, verified.logits.index_select(0, rows))
    request.schedule_s += time.perf_counter() - start
    return values


def sample_next(cfg: DecodingConfig, logits: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """The next token ([1] on the device) from the verifier's logits ([V]): the argmax at T=0, else a sample of
    the distribution at T warped by --top-p/--top-k."""
    if cfg.temperature <= 0:
        return sample_token(logits, 0.0, None)
    return sample_token(warp(logits, cfg.temperature, cfg.top_p, cfg.top_k), 1.0, generator)


def read_back(parts: dict[str, torch.Tensor]) -> dict[str, list[float]]:
    """Device tensors, read back to the host in one synchronisation, by name (as float64: token ids and node
    indices below 2**53 come back exact)."""
    flat = [p.reshape(-1) for p in parts.values()]
    values = torch.cat([p.double() for p in flat]).tolist()
    got, start = {}, 0
    for name, part in zip(parts, flat):
        got[name], start = values[start:start + part.numel()], start + part.numel()
    return got


# ---- the rules on tensors: no model, no host synchronisation (but exact_accept's one read-back) ----------------

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


def row_generator(seed: int, row_id: str, device) -> torch.Generator:
    """A generator seeded from the run seed and the row id, so reruns and retries reproduce."""
    gen = torch.Generator(device=device)
    gen.manual_seed((seed * 1_000_003 + zlib.crc32(str(row_id).encode())) % (2**63))
    return gen
