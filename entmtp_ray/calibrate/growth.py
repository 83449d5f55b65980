"""Tree growth from measured acceptance: the paper's Algorithm 1 and the Pareto frontier. Pure
Python over rank tables; no model here (rollouts.py measures the tables, this module decides).

An *acceptance table* has one row per calibration position t of a self-rollout: the rank of the
true next token in each head's top-k along the true path (row[k] for depth k+1; -1 = not within
the ranks we keep). A tree accepts d drafts at t when the rank prefix row[:d] is one of its paths,
so a tree's expected accepted length is 1 + the fraction of rows matching each of its paths,
summed. Adding a path p whose parent is in the tree gains exactly count(rows starting with p) / N.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import combinations

from entmtp_ray.decode.tree import Topology, TreePath, is_tree, path_order


class AcceptanceTable:
    """Rank tuples of calibration positions, counted by prefix (so every query is a lookup)."""

    def __init__(self, rows: Iterable[Sequence[int]], max_depth: int):
        self.max_depth = max_depth
        self.rows = 0
        self.prefix_counts: Counter[TreePath] = Counter()
        for row in rows:
            self.rows += 1
            prefix: list[int] = []
            for rank in list(row)[:max_depth]:
                if rank < 0:
                    break
                prefix.append(int(rank))
                self.prefix_counts[tuple(prefix)] += 1
        if self.rows == 0:
            raise ValueError("an acceptance table needs at least one calibration position")

    def gain(self, path: TreePath) -> float:
        """Expected extra accepted tokens per step from adding `path` (its parent already present)."""
        return self.prefix_counts.get(tuple(path), 0) / self.rows

    def accepted_length(self, paths: Iterable[TreePath]) -> float:
        """Expected accepted length (bonus token included) of a prefix-closed tree."""
        return 1.0 + sum(self.gain(p) for p in paths)


def _candidates(tree: set[TreePath], max_depth: int) -> list[TreePath]:
    """Paths that keep the tree valid when added: the next rank under every present node (root included)."""
    out = []
    for parent in [(), *tree]:
        if len(parent) >= max_depth:
            continue
        rank = 0
        while parent + (rank,) in tree:
            rank += 1
        out.append(parent + (rank,))
    return out


def _preference(table: AcceptanceTable, path: TreePath) -> tuple:
    """Higher gain first; ties: shallower, then smaller rank sum, then the path itself (deterministic)."""
    return (-table.gain(path), len(path), sum(path), path)


def grow_trees(table: AcceptanceTable, budget: int, max_depth: int | None = None) -> list[tuple[TreePath, ...]]:
    """Algorithm 1: add the best child one node at a time. Returns the tree after each addition
    (trees[k] has k+1 paths, i.e. k+2 nodes with the root), up to `budget` nodes in all."""
    depth = max_depth if max_depth is not None else table.max_depth
    tree: set[TreePath] = set()
    order: list[TreePath] = []
    trees = []
    while len(tree) + 1 < budget:
        best = min(_candidates(tree, depth), key=lambda p: _preference(table, p))
        tree.add(best)
        order.append(best)
        trees.append(tuple(sorted(order, key=path_order)))
    return trees


def brute_force_best(table: AcceptanceTable, budget: int, max_depth: int, max_rank: int) -> tuple[float, set]:
    """The best expected accepted length over every valid tree of `budget` nodes whose ranks are
    below `max_rank` (exponential: for tests on small budgets only). Returns (value, set of best trees)."""
    universe = [p for p in _all_paths(max_depth, max_rank)]
    best, winners = -1.0, set()
    for subset in combinations(universe, budget - 1):
        paths = set(subset)
        if not is_tree(paths):
            continue
        value = table.accepted_length(paths)
        if value > best + 1e-12:
            best, winners = value, {frozenset(paths)}
        elif abs(value - best) <= 1e-12:
            winners.add(frozenset(paths))
    return best, winners


def _all_paths(max_depth: int, max_rank: int) -> list[TreePath]:
    level: list[TreePath] = [()]
    out = []
    for _ in range(max_depth):
        level = [p + (r,) for p in level for r in range(max_rank)]
        out += level
    return out


def pareto_frontier(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points (cost, value) that no other point beats: none with cost <= and value >=,
    one of them strictly. Sorted by cost; among exact duplicates the first is kept."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], -points[i][1], i))
    keep, best = [], float("-inf")
    for i in order:
        if points[i][1] > best:
            keep.append(i)
            best = points[i][1]
    return keep


# ---- replaying a policy over measured rollouts -------------------------------------------------

@dataclass
class ReplayStep:
    """What a policy sees of one replayed step (the fields of policy.StepView)."""

    tree: str
    accepted_length: int
    entropy: list[float]
    top1_prob: list[float]
    path: tuple[int, ...] = ()


@dataclass
class Replay:
    tokens: int = 0
    steps: int = 0
    seconds: float = 0.0
    switches: int = 0
    usage: Counter = field(default_factory=Counter)

    @property
    def tau(self) -> float:
        return self.tokens / self.steps if self.steps else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def accepted_length(row: Sequence[int], tree: Topology) -> int:
    """Tokens a greedy step adds when the true path's ranks are `row` and the tree is `tree`."""
    d = 0
    while d < len(row) and row[d] >= 0 and tuple(row[: d + 1]) in tree.path_set:
        d += 1
    return d + 1


def accepted_lengths(rows: Sequence[Sequence[int]], trees: Iterable[Topology]) -> dict[str, list[int]]:
    """accepted_length of every tree (by name) at every rollout position, computed once for many replays."""
    return {tree.name: [accepted_length(row, tree) for row in rows] for tree in trees}


def replay(rows: Sequence[Sequence[int]], entropy: Sequence[float], top1: Sequence[float], policy,
           step_seconds: dict[str, float], into: Replay | None = None,
           lengths: dict[str, list[int]] | None = None) -> Replay:
    """Greedy decoding of one rollout under `policy`, step by step, without the model.

    At T=0 the output does not depend on the trees, so each step's accepted length is a table
    lookup (rows[i] for the step whose root is rollout token i) and the signal sees the verifier
    statistics of the accepted tokens; time is the measured cost of a step with the chosen tree.
    `lengths` (from accepted_lengths) saves recomputing the lookups when one rollout is replayed
    under many policies.
    """
    out = into or Replay()
    policy.reset()
    i, previous, end = 0, None, len(rows)
    while i + 1 < end:  # rollout token i is the root; the prefill emitted token 0
        tree = policy.choose()
        name = tree.name
        a = lengths[name][i] if lengths is not None else accepted_length(rows[i], tree)
        policy.observe(ReplayStep(name, min(a, end - 1 - i), list(entropy[i: i + a]), list(top1[i: i + a])))
        out.steps += 1
        out.tokens += min(a, end - 1 - i)  # the last step is cut at the rollout's end, as decoding cuts it
        out.seconds += step_seconds[name]
        out.usage[name] += 1
        out.switches += previous is not None and previous != name
        previous = name
        i += a
    return out
