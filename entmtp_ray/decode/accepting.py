"""A step's accepted path and the token after it, from its verify forward (`Verified`), under the request's
acceptance rule: the tensor rules of acceptance.py run on the device, their answer read back to the host once."""

from __future__ import annotations

import time

import torch

from entmtp_ray.config import DecodingConfig
from entmtp_ray.decode.acceptance import exact_accept, greedy_path, sample_token, typical_path, warp
from entmtp_ray.decode.results import Accepted, Request
from entmtp_ray.decode.verify import Verified, verifier_stat


def accept(request: Request, verified: Verified) -> Accepted:
    """The accepted path under the request's acceptance rule and the token after it (the request's next
    root), computed on the device and read back once: greedy and typical acceptance pick a row of the
    retrieve indices there; exact acceptance walks the tree on the host (exact_accept's read-back), and
    the residual's sample is a second one. A last node without logits (a leaf, unless the buffers have
    leaf logits) costs one more."""
    cfg, buffers, tokens = request.cfg, verified.buffers, verified.tokens
    stat = request.logits_stat
    scored = verified.logits[:buffers.num_scored]  # [scored, V]
    if buffers.children[0] and cfg.temperature > 0 and cfg.acceptance == "exact":
        # the walk and the residual sample the warped distribution (--top-p/--top-k) at T, given as T=1 logits
        warped = warp(scored, cfg.temperature, cfg.top_p, cfg.top_k)
        path, rejected = exact_accept(tokens, warped, buffers.row_of_node, buffers.children, 1.0,
                                      request.generator)
        last = path[-1]
        chain = buffers.chains[last]  # the walk's path: the nodes root..last
        logits = warp(_logits_at(request, verified, last), cfg.temperature, cfg.top_p, cfg.top_k)  # [V]
        if rejected:  # every child of `last` was tried and rejected: sample from the residual
            logits = logits.index_fill(0, tokens[buffers.child_nodes[last]], float("-inf"))
        parts = [sample_token(logits, 1.0, request.generator), tokens[chain]]
        if stat is not None:
            parts.append(_path_stats(stat, request, verified, chain))
        pulled = read_back(parts)
        a = len(path)
        return Accepted(chain, path, [int(t) for t in pulled[1:1 + a]], int(pulled[0]), pulled[1 + a:])
    if not buffers.children[0]:  # the one-node tree drafted nothing: the root alone, no rule to run
        best = length = torch.zeros(1, dtype=torch.long, device=tokens.device)
    elif cfg.temperature > 0:
        best, length = typical_path(tokens, scored, buffers.row_of_node, buffers.retrieve_indices,
                                    cfg.temperature, cfg.typical_epsilon, cfg.typical_alpha)
    else:
        best, length = greedy_path(tokens, scored, buffers.row_of_node, buffers.retrieve_indices)
    path = buffers.retrieve_indices.index_select(0, best)[0]  # [depth + 1], -1 padded after the leaf
    nodes = path.clamp(min=0)
    last_row = buffers.row_of_node[nodes].index_select(0, length)  # [1]; -1: the last node has no logits
    # the token after the path when its last node has logits: right but for a leaf without them, and
    # free to compute at T=0; under sampling it would spend the generator's draws, so only when surely right
    guess = buffers.leaf_logits or cfg.temperature <= 0
    parts = [length, nodes, tokens[nodes]]
    if guess:
        parts.append(sample_next(cfg, verified.logits.index_select(0, last_row.clamp(min=0))[0], request.generator))
    if stat is not None:
        parts.append(_path_stats(stat, request, verified, nodes))
    pulled = read_back(parts)  # the step's one read-back
    a, width = int(pulled[0]) + 1, nodes.numel()
    node_ids = [int(i) for i in pulled[1:1 + a]]
    accepted = [int(t) for t in pulled[1 + width:1 + width + a]]
    last, rest = node_ids[-1], pulled[1 + 2 * width:]
    if guess and buffers.node_rows[last] >= 0:
        return Accepted(path[:a], node_ids, accepted, int(rest[0]), rest[1:1 + a])
    # the last node is a leaf without logits (CPU buffers): its logits, the token after it and its statistic
    logits = _logits_at(request, verified, last)
    parts = [sample_next(cfg, logits, request.generator)]
    if stat is not None:
        parts.append(verifier_stat(stat, logits[None]))
    more = read_back(parts)
    stats = rest[guess:guess + a - 1] + more[1:] if stat is not None else []
    return Accepted(path[:a], node_ids, accepted, int(more[0]), stats)


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


def read_back(parts: list[torch.Tensor]) -> list[float]:
    """Device tensors, concatenated and read back to the host in one synchronisation (as float64: token
    ids and node indices below 2**53 come back exact)."""
    return torch.cat([p.reshape(-1).double() for p in parts]).tolist()
