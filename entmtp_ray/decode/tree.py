"""Draft-tree topologies and their static buffers. Knows nothing about models, Ray or Parquet.

A topology is a prefix-closed list of paths; a path is a tuple of child ranks from the root
(the base model's own next token, node 0, never listed). Nodes are numbered root first, then
by (depth, path), so the nodes of one depth are contiguous and grouped by parent in parent
order, ranks ascending. Every buffer a decoding step needs is built once per topology;
switching trees is a dictionary lookup.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch

from entmtp_ray.assets import asset

TreePath = tuple[int, ...]  # child ranks from the root, one per depth; () is the root itself


def path_order(path: TreePath) -> tuple[int, TreePath]:
    """The canonical node order: by depth, then by ranks (a depth's nodes contiguous, grouped by parent)."""
    return (len(path), path)


# Trees shipped with the package (entmtp_ray/assets/trees/*.json, sources named inside each file).
BUILTIN_TREE_FILES = {"hydra": "hydra.json", "medusa": "medusa.json"}


@dataclass(frozen=True)
class Topology:
    """A validated, canonically ordered draft tree: the one identity of a tree for policies, banks,
    growth and the decoder (two topologies are the same tree when name and paths are equal)."""

    name: str
    paths: tuple[TreePath, ...]  # sorted by path_order; the root is implicit

    @cached_property
    def path_set(self) -> frozenset[TreePath]:
        """The paths as a set, for membership tests (greedy replay asks one per step)."""
        return frozenset(self.paths)

    @property
    def num_nodes(self) -> int:
        return len(self.paths) + 1

    @property
    def depth(self) -> int:
        return max((len(p) for p in self.paths), default=0)

    def to_json(self) -> dict:
        return {"name": self.name, "paths": [list(p) for p in self.paths]}


def make_topology(paths, name: str = "custom", max_depth: int | None = None) -> Topology:
    """Validate `paths` and return the canonical topology.

    Checks: every path is a non-empty sequence of non-negative ints, no duplicates, prefix
    closure (every proper prefix is listed), contiguous ranks (rank r implies ranks 0..r-1 at
    the same parent) and, when `max_depth` is given, depth <= max_depth (number of heads).
    """
    canon: list[TreePath] = []
    for raw in paths:
        if not isinstance(raw, (list, tuple)) or not raw:
            raise ValueError(f"tree '{name}': path {raw!r} must be a non-empty list of child ranks")
        if not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in raw):
            raise ValueError(f"tree '{name}': path {list(raw)} must hold non-negative integers")
        canon.append(tuple(raw))
    seen = set(canon)
    if len(seen) != len(canon):
        dup = next(p for p in canon if canon.count(p) > 1)
        raise ValueError(f"tree '{name}': path {list(dup)} is listed twice; remove the duplicate")
    for p in canon:
        if len(p) > 1 and p[:-1] not in seen:
            raise ValueError(
                f"tree '{name}': path {list(p)} has no parent {list(p[:-1])}; "
                "trees must be prefix-closed, add the parent path"
            )
        if p[-1] > 0 and p[:-1] + (p[-1] - 1,) not in seen:
            raise ValueError(
                f"tree '{name}': path {list(p)} skips rank {p[-1] - 1} at its parent; "
                f"ranks must be contiguous, add {list(p[:-1] + (p[-1] - 1,))}"
            )
        if max_depth is not None and len(p) > max_depth:
            raise ValueError(
                f"tree '{name}': path {list(p)} has depth {len(p)} but the heads draft at most "
                f"{max_depth} tokens; use a shallower tree or heads with more heads (--heads)"
            )
    return Topology(name=name, paths=tuple(sorted(canon, key=path_order)))


def is_tree(paths) -> bool:
    """Whether `paths` make a valid tree (make_topology's checks, without the message)."""
    try:
        make_topology(paths)
    except ValueError:
        return False
    return True


def chain_topology(depth: int) -> Topology:
    """The single path of top-1 drafts, `depth` tokens deep (depth 0 = plain AR)."""
    return make_topology([(0,) * d for d in range(1, depth + 1)], name=f"chain{depth}" if depth else "ar")


def load_topology(spec: str | Topology, max_depth: int | None = None) -> Topology:
    """A built-in tree by name (`hydra`, `medusa`, `ar`, `chainN`), a JSON file, or a Topology
    (e.g. a bank's tree), checked against `max_depth`.

    A JSON file holds either a list of paths or an object with a "paths" list (and optional "name").
    """
    if isinstance(spec, Topology):
        return make_topology(spec.paths, spec.name, max_depth)
    if spec == "ar":
        return chain_topology(0)
    if spec.startswith("chain") and spec[5:].isdigit():
        return make_topology(chain_topology(int(spec[5:])).paths, spec, max_depth)
    if spec in BUILTIN_TREE_FILES:
        text = asset("trees", BUILTIN_TREE_FILES[spec]).read_text()
        return make_topology(json.loads(text)["paths"], spec, max_depth)
    path = Path(spec)
    if not path.is_file():
        raise ValueError(
            f"unknown tree '{spec}': use one of {sorted(['ar', 'chainN', *BUILTIN_TREE_FILES])} "
            "or the path of a JSON file holding a list of paths"
        )
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"tree file {path} is not valid JSON ({exc}); it must hold a list of paths") from exc
    paths = data.get("paths") if isinstance(data, dict) else data
    if not isinstance(paths, list):
        raise ValueError(f"tree file {path}: expected a list of paths or an object with a 'paths' list")
    name = data.get("name", path.stem) if isinstance(data, dict) else path.stem
    return make_topology(paths, name, max_depth)


@dataclass(frozen=True)
class DraftLevel:
    """What drafting depth d needs: which parents expand and where their children land."""

    head_index: int  # head that drafts this depth (d - 1)
    parent_paths: torch.Tensor  # [num_parents, d] node indices root..parent
    top_k: int  # max children of any parent at this depth
    child_select: torch.Tensor  # [num_children] flat indices into [num_parents * top_k]
    node_start: int  # first node index of this depth (nodes of a depth are contiguous)


@dataclass(frozen=True)
class TreeBuffers:
    """Static tensors of one topology, built once."""

    topology: Topology
    num_nodes: int
    depth_of: torch.Tensor  # [num_nodes] depth of each node, root = 0 (position offset)
    parent_of: torch.Tensor  # [num_nodes] parent node index, root = -1
    tree_mask: torch.Tensor  # [num_nodes, num_nodes] bool, node sees its ancestors and itself
    retrieve_indices: torch.Tensor  # [num_leaves, depth + 1] node indices root->leaf, -1 = pad
    levels: tuple[DraftLevel, ...]  # one per depth 1..depth
    scored_nodes: torch.Tensor  # [num_scored] nodes with children: their verifier logits decide acceptance
    # the nodes whose verifier logits the verify forward computes: the scored ones first (rows
    # 0..num_scored-1), then the root of the one-node tree, or with `leaf_logits` every leaf
    logit_nodes: torch.Tensor  # [rows]
    row_of_node: torch.Tensor  # [num_nodes] row in the verifier logits, -1 for a node without logits
    node_rows: tuple[int, ...]  # row_of_node on the host
    children: tuple[tuple[int, ...], ...]  # per node, its child nodes in rank order (exact acceptance walks them)
    chains: tuple[torch.Tensor, ...]  # per node, the nodes root..it ([depth + 1]): an accepted path ending there
    child_nodes: tuple[torch.Tensor, ...]  # per node, `children` on the device

    @property
    def num_scored(self) -> int:
        return self.scored_nodes.numel()

    @property
    def leaf_logits(self) -> bool:
        """Whether every node has verifier logits (the step then needs no second read-back for a leaf)."""
        return min(self.node_rows) >= 0


def build_buffers(topology: Topology, device: torch.device | str = "cpu", leaf_logits: bool = False) -> TreeBuffers:
    """The topology's buffers on `device`. `leaf_logits`: the verify forward computes logits at every node,
    not just at the scored ones, so the token after any accepted path is known without reading the path
    back first (one host synchronisation per greedy step; the CUDA default, docs/design.md §8)."""
    index = {(): 0}
    for i, p in enumerate(topology.paths, start=1):
        index[p] = i
    n = topology.num_nodes
    depth_of = torch.zeros(n, dtype=torch.long)
    parent_of = torch.full((n,), -1, dtype=torch.long)
    mask = torch.eye(n, dtype=torch.bool)
    children: dict[TreePath, int] = {}
    for p, i in index.items():
        if not p:
            continue
        depth_of[i] = len(p)
        parent_of[i] = index[p[:-1]]
        for k in range(len(p)):
            mask[i, index[p[:k]]] = True
        children[p[:-1]] = children.get(p[:-1], 0) + 1

    leaves = [p for p in index if p not in children]
    width = topology.depth + 1
    retrieve = torch.full((len(leaves), width), -1, dtype=torch.long)
    for row, leaf in enumerate(sorted(leaves, key=path_order)):
        for k in range(len(leaf) + 1):
            retrieve[row, k] = index[leaf[:k]]

    levels = []
    for d in range(1, topology.depth + 1):
        parents = sorted((p for p in children if len(p) == d - 1), key=lambda p: p)
        top_k = max(children[p] for p in parents)
        parent_paths = torch.tensor([[index[p[:k]] for k in range(d)] for p in parents], dtype=torch.long)
        select = [row * top_k + r for row, p in enumerate(parents) for r in range(children[p])]
        node_start = min(index[p] for p in topology.paths if len(p) == d)
        levels.append(
            DraftLevel(
                head_index=d - 1,
                parent_paths=parent_paths.to(device),
                top_k=top_k,
                child_select=torch.tensor(select, dtype=torch.long, device=device),
                node_start=node_start,
            )
        )
    scored = sorted(index[p] for p in children)
    unscored = sorted(set(range(n)) - set(scored))
    logit_nodes = scored + (unscored if leaf_logits else unscored[:1] if n == 1 else [])
    child_nodes = tuple(tuple(index[p + (r,)] for r in range(children.get(p, 0))) for p in sorted(index, key=index.get))
    chains = tuple(tuple(index[p[:k]] for k in range(len(p) + 1)) for p in sorted(index, key=index.get))
    row_of_node = torch.full((n,), -1, dtype=torch.long)
    row_of_node[logit_nodes] = torch.arange(len(logit_nodes))
    return TreeBuffers(
        topology=topology,
        num_nodes=n,
        depth_of=depth_of.to(device),
        parent_of=parent_of.to(device),
        tree_mask=mask.to(device),
        retrieve_indices=retrieve.to(device),
        levels=tuple(levels),
        scored_nodes=torch.tensor(scored, dtype=torch.long, device=device),
        logit_nodes=torch.tensor(logit_nodes, dtype=torch.long, device=device),
        row_of_node=row_of_node.to(device),
        node_rows=tuple(row_of_node.tolist()),
        children=child_nodes,
        chains=tuple(torch.tensor(c, dtype=torch.long, device=device) for c in chains),
        child_nodes=tuple(torch.tensor(c, dtype=torch.long, device=device) for c in child_nodes),
    )
