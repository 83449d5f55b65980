"""Greedy and typical acceptance with crafted logits over small trees; next-token choice."""

from __future__ import annotations

import math

import pytest
import torch

from entmtp_ray.decode.acceptance import argmax_rows
from entmtp_ray.decode.tree import build_buffers, load_topology, make_topology
from helpers.rules import greedy_accept, next_token, typical_accept

V = 8
T = torch.tensor


def peaked(*argmaxes: int, low: float = 0.0, high: float = 5.0) -> torch.Tensor:
    """Logits [len(argmaxes), V] whose row r has its argmax at argmaxes[r]."""
    logits = torch.full((len(argmaxes), V), low)
    for r, a in enumerate(argmaxes):
        logits[r, a] = high
    return logits


def logits_from_probs(rows: list[list[float]], temperature: float) -> torch.Tensor:
    """Logits whose softmax at `temperature` is exactly `rows` (each row sums to 1)."""
    probs = torch.tensor(rows, dtype=torch.float64)
    return (temperature * probs.log()).float()


# Tree A: nodes 0 root, 1 (0), 2 (1), 3 (0,0). Scored: 0 -> row 0, 1 -> row 1.
# retrieve: [[0, 2, -1], [0, 1, 3]]
@pytest.fixture(scope="module")
def tree_a():
    b = build_buffers(make_topology([[0], [1], [0, 0]]))
    assert b.retrieve_indices.tolist() == [[0, 2, -1], [0, 1, 3]]
    return b


# Tree B: 0 root, 1 (0), 2 (1), 3 (2), 4 (0,0), 5 (0,1), 6 (1,0), 7 (0,0,0).
# scored 0, 1, 2, 4 -> rows 0, 1, 2, 3; retrieve [[0,3,-1,-1],[0,1,5,-1],[0,2,6,-1],[0,1,4,7]]
@pytest.fixture(scope="module")
def tree_b():
    b = build_buffers(make_topology([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]))
    assert b.row_of_node.tolist() == [0, 1, 2, -1, 3, -1, -1, -1]
    return b


TOKENS_A = T([5, 1, 2, 3])  # root 5; (0) -> 1, (1) -> 2, (0,0) -> 3
TOKENS_B = T([7, 1, 2, 3, 4, 5, 6, 0])  # node i carries token i (root 7, node 7 token 0)


def greedy(tokens, logits, b):
    return greedy_accept(tokens, logits, b.row_of_node, b.retrieve_indices).tolist()


def typical(tokens, logits, b, temperature=0.7, **kw):
    return typical_accept(tokens, logits, b.row_of_node, b.retrieve_indices, temperature, **kw).tolist()


# --- greedy -----------------------------------------------------------------------------------

def test_greedy_full_path(tree_a):
    assert greedy(TOKENS_A, peaked(1, 3), tree_a) == [0, 1, 3]


def test_greedy_partial(tree_a):
    assert greedy(TOKENS_A, peaked(1, 6), tree_a) == [0, 1]


def test_greedy_none_returns_root(tree_a):
    assert greedy(TOKENS_A, peaked(6, 3), tree_a) == [0]


def test_greedy_depth_one_leaf_in_first_row(tree_a):
    assert greedy(TOKENS_A, peaked(2, 3), tree_a) == [0, 2]


def test_greedy_only_the_parents_row_matters(tree_a):
    # node 1's row prefers token 3; but the root row prefers 2, so node 1 (token 1) is not accepted
    assert greedy(TOKENS_A, peaked(2, 3), tree_a) == [0, 2]
    assert greedy(TOKENS_A, peaked(4, 3), tree_a) == [0]


def test_greedy_three_depths(tree_b):
    # root row -> 1, node 1 row -> 4, node 4 row -> 0: the deepest path [0,1,4,7] (last row)
    assert greedy(TOKENS_B, peaked(1, 4, 6, 0), tree_b) == [0, 1, 4, 7]
    # root row -> 1, node 1 row -> 5: leaf (0,1), row 1 of retrieve (not the first)
    assert greedy(TOKENS_B, peaked(1, 5, 6, 0), tree_b) == [0, 1, 5]
    # root row -> 2, node 2 row -> 6: leaf (1,0), row 2
    assert greedy(TOKENS_B, peaked(2, 4, 6, 0), tree_b) == [0, 2, 6]
    # root row -> 3: depth-1 leaf (2), row 0
    assert greedy(TOKENS_B, peaked(3, 4, 6, 0), tree_b) == [0, 3]
    # root row -> 1, node 1 row -> 4, node 4 row -> 5 (not node 7's token 0): stop at depth 2
    assert greedy(TOKENS_B, peaked(1, 4, 6, 5), tree_b) == [0, 1, 4]
    # nothing matches
    assert greedy(TOKENS_B, peaked(6, 4, 6, 0), tree_b) == [0]


def test_greedy_ar_tree():
    b = build_buffers(load_topology("ar"))
    out = greedy_accept(T([42]), torch.zeros(0, V), b.row_of_node, b.retrieve_indices)
    assert out.tolist() == [0]


def test_a_star_tree_has_one_scored_node_and_accepts_below_it():
    """Only the root has children: one row of logits decides, and a match is accepted (a one-row
    input is no one-node tree)."""
    b = build_buffers(make_topology([[0], [1], [2]]))
    tokens = T([9, 4, 6, 2])
    assert greedy(tokens, peaked(6), b) == [0, 2] and greedy(tokens, peaked(5), b) == [0]
    assert typical(tokens, peaked(2), b) == [0, 3] and typical(tokens, peaked(5), b) == [0]


def test_greedy_ignores_pad_columns(tree_b):
    # A pad (-1) gathers node 0's token; row 0's leaf (2) is at depth 1 only. If the root row's argmax
    # is the root's own token, nothing may be accepted past the real path.
    tokens = T([3, 1, 2, 3, 4, 5, 6, 0])  # root token 3 == node 3's token
    assert greedy(tokens, peaked(3, 3, 3, 3), tree_b) == [0, 3]


# --- typical ----------------------------------------------------------------------------------

def _row(p_tokens: dict[int, float]) -> list[float]:
    """A V-row with the given token probabilities, the rest spread evenly over the other tokens."""
    rest = [t for t in range(V) if t not in p_tokens]
    share = (1.0 - sum(p_tokens.values())) / len(rest)
    return [p_tokens.get(t, share) for t in range(V)]


def test_typical_full_partial_none(tree_a):
    t = 0.7
    confident = _row({1: 0.9})  # root row: token 1 very likely, others 0.0143 each (< 0.09)
    accept3 = _row({3: 0.9})
    reject3 = _row({6: 0.95})  # token 3 has 0.05/7 ~ 0.007
    assert typical(TOKENS_A, logits_from_probs([confident, accept3], t), tree_a, t) == [0, 1, 3]
    assert typical(TOKENS_A, logits_from_probs([confident, reject3], t), tree_a, t) == [0, 1]
    assert typical(TOKENS_A, logits_from_probs([_row({6: 0.95}), accept3], t), tree_a, t) == [0]


def test_typical_accepts_non_argmax_tokens(tree_b):
    """Typical acceptance is not greedy: a token well above the threshold passes without being the argmax."""
    t = 0.7
    rows = [_row({1: 0.6, 2: 0.3}), _row({4: 0.55, 5: 0.4}), _row({6: 0.9}), _row({0: 0.2, 3: 0.75})]
    assert typical(TOKENS_B, logits_from_probs(rows, t), tree_b, t) == [0, 1, 4, 7]
    assert greedy(TOKENS_B, logits_from_probs(rows, t), tree_b) == [0, 1, 4]


def test_typical_winner_not_in_first_row(tree_b):
    t = 0.7
    # root row accepts 2 only, node 2 row accepts 6: leaf (1,0) is retrieve row 2
    rows = [_row({2: 0.97}), _row({0: 0.97}), _row({6: 0.97}), _row({1: 0.97})]
    assert typical(TOKENS_B, logits_from_probs(rows, t), tree_b, t) == [0, 2, 6]


def test_typical_ar_tree():
    b = build_buffers(load_topology("ar"))
    out = typical_accept(T([42]), torch.zeros(0, V), b.row_of_node, b.retrieve_indices, 0.7)
    assert out.tolist() == [0]


def test_typical_rejects_zero_temperature(tree_a):
    with pytest.raises(AssertionError):
        typical(TOKENS_A, peaked(1, 3), tree_a, temperature=0.0)


def _threshold(probs: list[float], epsilon: float, alpha: float) -> float:
    h = -sum(p * math.log(p) for p in probs if p > 0)
    return min(epsilon, alpha * math.exp(-h))


def test_typical_epsilon_boundary():
    """Low entropy: alpha*exp(-H) > epsilon, so the threshold is epsilon itself; p just above vs below."""
    b = build_buffers(make_topology([[0]]))  # root + one child (token 1)
    tokens = T([0, 1])
    t = 0.7
    for p, expected in [(0.0905, [0, 1]), (0.0895, [0])]:
        row = _row({1: p, 5: 0.9})
        assert _threshold(row, 0.09, 0.3) == 0.09
        assert typical(tokens, logits_from_probs([row], t), b, t) == expected, p


def test_typical_entropy_boundary():
    """High entropy: the threshold is alpha*exp(-H) < epsilon; find p = threshold(p) and step either side."""
    b = build_buffers(make_topology([[0]]))
    tokens = T([0, 1])
    t = 0.7

    def row(p):  # token 1 has p, the other 7 share the rest: entropy near ln 8
        return _row({1: p})

    lo, hi = 1e-3, 1.0 / V
    for _ in range(100):
        mid = (lo + hi) / 2
        if mid > _threshold(row(mid), 0.09, 0.3):
            hi = mid
        else:
            lo = mid
    p_star = (lo + hi) / 2
    assert 0.03 < p_star < 0.05 and _threshold(row(p_star), 0.09, 0.3) < 0.09  # alpha term binds
    above, below = p_star * 1.002, p_star * 0.998
    assert typical(tokens, logits_from_probs([row(above)], t), b, t) == [0, 1]
    assert typical(tokens, logits_from_probs([row(below)], t), b, t) == [0]
    # the same probabilities with a larger epsilon/alpha are rejected / with smaller accepted
    assert typical(tokens, logits_from_probs([row(above)], t), b, t, alpha=0.4) == [0]
    assert typical(tokens, logits_from_probs([row(below)], t), b, t, epsilon=0.01) == [0, 1]


def test_typical_threshold_uses_temperature():
    """The same logits pass at T=1 and fail at a low temperature, which sharpens p away from the token."""
    b = build_buffers(make_topology([[0]]))
    tokens = T([0, 1])
    logits = torch.zeros(1, V)
    logits[0, 1] = 1.0
    logits[0, 2] = 2.0  # p(1) = e/(e + e^2 + 6) ~ 0.16 at T=1; ~0.0 at T=0.1
    assert typical(tokens, logits, b, 1.0) == [0, 1]
    assert typical(tokens, logits, b, 0.1) == [0]


def test_typical_tie_break_by_summed_log_prob():
    # 0 root, 1 (0), 2 (1), 3 (0,0), 4 (1,0); two equally long paths [0,1,3] and [0,2,4]
    b = build_buffers(make_topology([[0], [1], [0, 0], [1, 0]]))
    assert b.retrieve_indices.tolist() == [[0, 1, 3], [0, 2, 4]]
    tokens = T([7, 1, 2, 3, 4])
    t = 0.7
    # depth 1 favours node 1 (0.5 vs 0.4), depth 2 favours node 4 enough to win the sum:
    # path 1: log 0.5 + log 0.3 = -1.897; path 2: log 0.4 + log 0.9 = -1.022
    rows = [_row({1: 0.5, 2: 0.4}), _row({3: 0.3, 5: 0.6}), _row({4: 0.9})]
    assert typical(tokens, logits_from_probs(rows, t), b, t) == [0, 2, 4]
    # flip depth 2 so the first row wins the sum
    rows = [_row({1: 0.5, 2: 0.4}), _row({3: 0.9}), _row({4: 0.3, 5: 0.6})]
    assert typical(tokens, logits_from_probs(rows, t), b, t) == [0, 1, 3]


def test_typical_longer_beats_likelier():
    # path [0,1,3] accepts 2 tokens with low probabilities; [0,2,4] accepts 1 with high; longest wins
    b = build_buffers(make_topology([[0], [1], [0, 0], [1, 0]]))
    tokens = T([7, 1, 2, 3, 4])
    t = 0.7
    rows = [_row({1: 0.15, 2: 0.8}), _row({3: 0.2, 5: 0.75}), _row({6: 0.97})]
    assert typical(tokens, logits_from_probs(rows, t), b, t) == [0, 1, 3]


def test_typical_tie_among_prefixes_ignores_rejected_tail():
    """Only the accepted prefix enters the score: a path's rejected tail must not change which path wins."""
    # tree B paths [0,1,5] and [0,2,6] each accept exactly 1 token
    b = build_buffers(make_topology([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]))
    tokens = TOKENS_B
    t = 0.7
    rows = [_row({1: 0.3, 2: 0.6}), _row({7: 0.98}), _row({7: 0.98}), _row({7: 0.98})]
    # nodes 1, 2 accepted (3 has 0.1/6 = 0.017, rejected); no depth-2 acceptance; node 2 likelier
    assert typical(tokens, logits_from_probs(rows, t), b, t) == [0, 2]


def test_typical_with_masked_logits():
    b = build_buffers(make_topology([[0]]))
    logits = torch.full((1, V), -float("inf"))
    logits[0, 1] = 2.0
    logits[0, 2] = 1.0  # p(1) = 0.73: clearly typical
    assert typical(T([0, 1]), logits, b, 1.0) == [0, 1]


# --- next token -------------------------------------------------------------------------------

def test_next_token_greedy():
    logits = torch.zeros(V)
    logits[5] = 3.0
    assert next_token(logits, 0.0, None) == 5
    assert next_token(logits, -1.0, None) == 5


def test_next_token_sampling_is_seeded_and_in_support():
    logits = torch.full((V,), -float("inf"))
    logits[[1, 4, 6]] = T([0.0, 0.5, 1.0])
    draws = [next_token(logits, 0.7, g) for g in [torch.Generator().manual_seed(3)] for _ in range(300)]
    assert set(draws) == {1, 4, 6}
    again = [next_token(logits, 0.7, g) for g in [torch.Generator().manual_seed(3)] for _ in range(300)]
    assert draws == again
    other = [next_token(logits, 0.7, g) for g in [torch.Generator().manual_seed(4)] for _ in range(300)]
    assert other != draws


def test_next_token_sampling_frequencies_follow_temperature():
    logits = torch.zeros(V)
    logits[2] = 1.0
    gen = torch.Generator().manual_seed(0)
    n = 4000
    draws = torch.tensor([next_token(logits, 0.5, gen) for _ in range(n)])
    expected = torch.softmax(logits / 0.5, -1)[2].item()  # e^2 / (e^2 + 7) ~ 0.51
    assert abs((draws == 2).float().mean().item() - expected) < 0.03


def test_a_float_tie_is_two_units_in_the_last_place_of_the_logits_dtype():
    from entmtp_ray.decode.acceptance import greedy_up_to_tie

    logits = torch.tensor([[13.0, 13.0 - 0.12, 1.0], [13.0, 13.0 - 0.3, 1.0], [0.5, 0.5 - 5e-5, 0.0]])
    tokens = torch.tensor([1, 1, 1])
    # bf16 eps is 2**-7: 2 ulps of 13 are 0.203; fp32's are 3e-6, so its 1e-4 floor decides
    assert greedy_up_to_tie(logits, tokens, torch.bfloat16).tolist() == [True, False, True]
    assert greedy_up_to_tie(logits, tokens, torch.float32).tolist() == [False, False, True]
    assert greedy_up_to_tie(logits, torch.tensor([2, 0, 2]), torch.bfloat16).tolist() == [False, True, False]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_rows_picks_the_first_of_tied_maxima_as_argmax(dtype):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 49152, generator=gen).to(dtype)
    for r in range(64):  # r % 4 + 1 exact copies of the row's maximum at random places, some before it
        places = torch.randint(0, 49152, (r % 4 + 1,), generator=gen)
        logits[r, places] = logits[r].max()
    logits[0] = float("-inf")
    logits[0, [9, 7]] = 0.0
    got = argmax_rows(logits)
    assert torch.equal(got, logits.argmax(-1))
    assert int(got[0]) == 7
    assert all(int(argmax_rows(row)) == int(row.argmax()) for row in logits[:8])


def test_the_tie_rule_takes_any_leading_shape_and_its_bound_is_inclusive():
    from entmtp_ray.decode.acceptance import greedy_up_to_tie

    logits = torch.tensor([[[0.0, -1e-4, -2e-4], [3.0, 1.0, 2.0]], [[1.0, 5.0, 0.0], [0.0, 0.0, 9.0]]])  # [2, 2, 3]
    tokens = torch.tensor([[1, 2], [1, 0]])  # [2, 2]
    # 1e-4 below the best is a tie (the fp32 floor, inclusive); 2e-4 or a whole unit is not
    assert greedy_up_to_tie(logits, tokens, torch.float32).tolist() == [[True, False], [True, False]]
    assert greedy_up_to_tie(logits, torch.tensor([[2, 0], [0, 2]]), torch.float32).tolist() == [[False, True],
                                                                                                   [False, True]]
    assert greedy_up_to_tie(logits[0, 0], torch.tensor(1), torch.float32).item() is True  # one row: [V] and []


def test_typical_needs_the_probability_strictly_above_the_threshold():
    """A draft whose probability equals the threshold exactly is rejected (`p > threshold`)."""
    b = build_buffers(make_topology([[0]]))
    tokens = T([0, 1])
    logits = logits_from_probs([_row({1: 0.2, 5: 0.7})], 0.7)
    p = float(torch.log_softmax(logits.float() / 0.7, -1).exp()[0, 1])  # as typical_accept computes it
    assert typical(tokens, logits, b, 0.7, epsilon=p, alpha=10.0) == [0]  # epsilon binds: alpha exp(-H) > 1
    assert typical(tokens, logits, b, 0.7, epsilon=p * (1 - 1e-6), alpha=10.0) == [0, 1]


def test_exact_rejects_zero_temperature(tree_a):
    from entmtp_ray.decode.acceptance import exact_accept

    with pytest.raises(AssertionError):
        exact_accept(TOKENS_A.tolist(), peaked(1, 3), tree_a.row_of_node, tree_a.children, 0.0, None)


def test_exact_skips_a_repeated_sibling_draft():
    """Hydra's siblings are distinct tokens, but a drafter may repeat one: once rejected, a token has
    no residual mass left, so its repeat must not get a second chance (P(x) stays p(x) = 0.5)."""
    from entmtp_ray.decode.acceptance import exact_accept

    b = build_buffers(make_topology([[0], [1], [2]]))
    logits = logits_from_probs([_row({3: 0.5, 4: 0.3})], 0.7)
    gen = torch.Generator().manual_seed(0)
    firsts = [tuple(exact_accept([0, 3, 3, 4], logits, b.row_of_node, b.children, 0.7, gen)[0]) for _ in range(4000)]
    counts = {path: firsts.count(path) / len(firsts) for path in set(firsts)}
    assert set(counts) <= {(0, 1), (0, 3), (0,)}, counts  # the repeat (node 2) is never accepted
    assert counts[(0, 1)] == pytest.approx(0.5, abs=0.03) and counts[(0, 3)] == pytest.approx(0.3, abs=0.03)


def test_the_read_back_gives_each_part_by_name():
    from entmtp_ray.decode.acceptance import read_back

    got = read_back({"length": T([2]), "nodes": T([0, 3, 5]), "stats": torch.tensor([0.25, 1.5])})
    assert got == {"length": [2.0], "nodes": [0.0, 3.0, 5.0], "stats": [0.25, 1.5]}


def test_top_p_keeps_the_smallest_set_that_reaches_it_and_no_token_past_it():
    from entmtp_ray.decode.acceptance import warp

    # two equal tokens: the first alone reaches p = 0.5 exactly, so the second is dropped; any p above keeps both
    assert torch.isinf(warp(torch.zeros(1, 2), 1.0, top_p=0.5)[0, 1])
    assert not torch.isinf(warp(torch.zeros(1, 2), 1.0, top_p=0.51)).any()


def test_a_greedy_step_whose_path_ends_where_logits_are_reads_back_once():
    """At T=0 the token after the path is computed with it, so a path ending at a node the forward has logits for
    (a scored one, even without leaf logits) costs the step one read-back, not two."""
    from types import SimpleNamespace

    from entmtp_ray.config import DecodingConfig
    from entmtp_ray.decode.acceptance import accept
    from helpers.readbacks import read_backs

    b = build_buffers(make_topology([[0], [0, 0]]))  # root -> 1 -> 2: the root and node 1 scored, node 2 a leaf
    logits = torch.zeros(len(b.logit_nodes), V)
    logits[b.node_rows[0], 3] = logits[b.node_rows[1], 6] = 1.0  # root's argmax is node 1's token; node 1's is not 2's
    request = SimpleNamespace(cfg=DecodingConfig(policy="fixed"), generator=None, logits_stat=None, plan=None,
                              schedule_s=0.0)
    verified = SimpleNamespace(buffers=b, tokens=T([9, 3, 4]), committed=0, hidden=None, logits=logits)
    with read_backs() as calls:
        got = accept(request, verified)
    assert (got.node_ids, got.tokens, got.root) == ([0, 1], [9, 3], 6) and calls == ["tolist"]
