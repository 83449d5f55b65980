"""Topology validation, canonical ordering, loading, and hand-written buffers of small trees."""

from __future__ import annotations

import json

import pytest
import torch

from entmtp_ray.decode.tree import Topology, build_buffers, chain_topology, load_topology, make_topology

T = torch.tensor


def nodes_per_depth(topo) -> list[int]:
    counts = [0] * topo.depth
    for p in topo.paths:
        counts[len(p) - 1] += 1
    return counts


# --- validation -------------------------------------------------------------------------------

def test_missing_parent_names_the_path_and_parent():
    with pytest.raises(ValueError, match=r"path \[0, 0\] has no parent \[0\].*prefix-closed"):
        make_topology([[0, 0]], name="t")



def test_missing_parent_deep():
    with pytest.raises(ValueError, match=r"path \[0, 1, 0\] has no parent \[0, 1\]"):
        make_topology([[0], [0, 0], [0, 1, 0]], name="t")


def test_rank_gap_names_the_path_and_missing_rank():
    with pytest.raises(ValueError, match=r"path \[2\] skips rank 1.*add \[1\]"):
        make_topology([[0], [2]], name="t")
    with pytest.raises(ValueError, match=r"path \[0, 1\] skips rank 0.*add \[0, 0\]"):
        make_topology([[0], [0, 1]], name="t")


def test_duplicate_names_the_path():
    with pytest.raises(ValueError, match=r"path \[0, 0\] is listed twice"):
        make_topology([[0], [0, 0], (0, 0)], name="t")


def test_depth_over_max_depth_names_the_path():
    paths = [[0], [0, 0], [0, 0, 0]]
    with pytest.raises(ValueError, match=r"path \[0, 0, 0\] has depth 3 .* at most 2 tokens"):
        make_topology(paths, name="t", max_depth=2)
    assert make_topology(paths, max_depth=3).depth == 3


@pytest.mark.parametrize("bad", [[0, 1.0], [0, "1"], [0, -1], [0, True], [None]])
def test_non_int_entries_name_the_path(bad):
    with pytest.raises(ValueError, match=r"must hold non-negative integers") as info:
        make_topology([[0], [1], bad], name="t")
    assert str(list(bad)) in str(info.value)


@pytest.mark.parametrize("bad", [[], (), 3, "0"])
def test_empty_or_non_sequence_path(bad):
    with pytest.raises(ValueError, match=r"must be a non-empty list of child ranks"):
        make_topology([[0], bad], name="t")


def test_error_names_the_tree():
    with pytest.raises(ValueError, match=r"tree 'mytree'"):
        make_topology([[1]], name="mytree")


# --- canonical ordering -----------------------------------------------------------------------

def test_canonical_order_is_depth_then_path():
    topo = make_topology([[0, 0, 0], [1, 0], [2], [0, 1], [1], [0, 0], [0]], name="x")
    assert topo.paths == ((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0))
    assert topo.num_nodes == 8
    assert topo.depth == 3
    assert nodes_per_depth(topo) == [3, 3, 1]
    assert topo.to_json() == {"name": "x", "paths": [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]}


def test_order_independent_and_tuples_or_lists():
    a = make_topology([[0], [1], [0, 0]])
    b = make_topology([(0, 0), (1,), (0,)])
    assert a == b
    assert isinstance(a, Topology)


def test_chain_and_ar():
    assert chain_topology(0).paths == () and chain_topology(0).name == "ar"
    assert chain_topology(0).num_nodes == 1 and chain_topology(0).depth == 0
    assert chain_topology(3).paths == ((0,), (0, 0), (0, 0, 0))


# --- loading ----------------------------------------------------------------------------------

def test_load_ar():
    topo = load_topology("ar")
    assert topo.num_nodes == 1 and topo.paths == () and nodes_per_depth(topo) == []


def test_load_chain3():
    topo = load_topology("chain3")
    assert topo.name == "chain3"
    assert topo.paths == ((0,), (0, 0), (0, 0, 0))
    with pytest.raises(ValueError, match="depth 3"):
        load_topology("chain3", max_depth=2)


def test_load_hydra_default_tree():
    topo = load_topology("hydra")
    assert topo.name == "hydra"
    assert topo.num_nodes == 64
    assert nodes_per_depth(topo) == [10, 28, 23, 2]
    assert load_topology("hydra", max_depth=4) == topo
    with pytest.raises(ValueError, match="has depth 4"):
        load_topology("hydra", max_depth=3)


def test_load_medusa_default_tree():
    topo = load_topology("medusa")
    assert topo.num_nodes == 64
    assert nodes_per_depth(topo) == [10, 23, 23, 7]


def test_load_json_list_form(tmp_path):
    f = tmp_path / "mine.json"
    f.write_text(json.dumps([[0, 0], [0], [1]]))
    topo = load_topology(str(f))
    assert topo.name == "mine"
    assert topo.paths == ((0,), (1,), (0, 0))


def test_load_json_object_form(tmp_path):
    f = tmp_path / "t.json"
    f.write_text(json.dumps({"name": "wide", "paths": [[0], [1], [2]]}))
    topo = load_topology(str(f))
    assert topo.name == "wide" and topo.paths == ((0,), (1,), (2,))
    f2 = tmp_path / "noname.json"
    f2.write_text(json.dumps({"paths": [[0]]}))
    assert load_topology(str(f2)).name == "noname"


def test_load_json_file_is_validated(tmp_path):
    f = tmp_path / "bad.json"
    f.write_text(json.dumps([[0], [0, 0], [0, 0, 0]]))
    with pytest.raises(ValueError, match=r"tree 'bad': path \[0, 0, 0\] has depth 3"):
        load_topology(str(f), max_depth=2)
    f.write_text(json.dumps([[1]]))
    with pytest.raises(ValueError, match=r"path \[1\] skips rank 0"):
        load_topology(str(f))


def test_load_malformed_json(tmp_path):
    f = tmp_path / "broken.json"
    f.write_text("[[0], [1,")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_topology(str(f))


@pytest.mark.parametrize("payload", [{"trees": [[0]]}, 3, "paths"])
def test_load_json_without_paths_list(tmp_path, payload):
    f = tmp_path / "nopaths.json"
    f.write_text(json.dumps(payload))
    with pytest.raises(ValueError, match="expected a list of paths"):
        load_topology(str(f))


def test_load_unknown_name_lists_choices(tmp_path):
    with pytest.raises(ValueError, match=r"unknown tree 'nope'.*'ar'.*'chainN'.*'hydra'.*'medusa'"):
        load_topology("nope")
    with pytest.raises(ValueError, match="unknown tree"):
        load_topology(str(tmp_path / "missing.json"))
    for name in ("chainx", "chain", "chain-2"):  # chainN takes a whole number of tokens
        with pytest.raises(ValueError, match=f"unknown tree '{name}'"):
            load_topology(name)


# --- buffers, hand-written --------------------------------------------------------------------

def _assert_eq(actual: torch.Tensor, expected: torch.Tensor):
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert torch.equal(actual, expected), f"\n{actual}\n!=\n{expected}"


def test_buffers_three_node_tree():
    # nodes: 0 = root, 1 = (0), 2 = (1), 3 = (0, 0)
    b = build_buffers(make_topology([[0], [1], [0, 0]]))
    assert b.num_nodes == 4
    _assert_eq(b.depth_of, T([0, 1, 1, 2]))
    _assert_eq(b.parent_of, T([-1, 0, 0, 1]))
    _assert_eq(b.tree_mask, T([
        [1, 0, 0, 0],
        [1, 1, 0, 0],
        [1, 0, 1, 0],
        [1, 1, 0, 1],
    ], dtype=torch.bool))
    # leaves (1) and (0, 0), sorted by (len, path)
    _assert_eq(b.retrieve_indices, T([
        [0, 2, -1],
        [0, 1, 3],
    ]))
    assert len(b.levels) == 2
    l1, l2 = b.levels
    assert (l1.head_index, l1.top_k, l1.node_start) == (0, 2, 1)
    _assert_eq(l1.parent_paths, T([[0]]))
    _assert_eq(l1.child_select, T([0, 1]))
    assert (l2.head_index, l2.top_k, l2.node_start) == (1, 1, 3)
    _assert_eq(l2.parent_paths, T([[0, 1]]))
    _assert_eq(l2.child_select, T([0]))
    _assert_eq(b.scored_nodes, T([0, 1]))
    _assert_eq(b.row_of_node, T([0, 1, -1, -1]))


def test_buffers_three_depths_uneven():
    # nodes: 0 root, 1 (0), 2 (1), 3 (2), 4 (0,0), 5 (0,1), 6 (1,0), 7 (0,0,0)
    b = build_buffers(make_topology([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]))
    assert b.num_nodes == 8
    _assert_eq(b.depth_of, T([0, 1, 1, 1, 2, 2, 2, 3]))
    _assert_eq(b.parent_of, T([-1, 0, 0, 0, 1, 1, 2, 4]))
    _assert_eq(b.tree_mask, T([
        [1, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0, 0, 0],
        [1, 0, 0, 1, 0, 0, 0, 0],
        [1, 1, 0, 0, 1, 0, 0, 0],
        [1, 1, 0, 0, 0, 1, 0, 0],
        [1, 0, 1, 0, 0, 0, 1, 0],
        [1, 1, 0, 0, 1, 0, 0, 1],
    ], dtype=torch.bool))
    # leaves: (2); (0,1), (1,0); (0,0,0)
    _assert_eq(b.retrieve_indices, T([
        [0, 3, -1, -1],
        [0, 1, 5, -1],
        [0, 2, 6, -1],
        [0, 1, 4, 7],
    ]))
    l1, l2, l3 = b.levels
    assert (l1.head_index, l1.top_k, l1.node_start) == (0, 3, 1)
    _assert_eq(l1.parent_paths, T([[0]]))
    _assert_eq(l1.child_select, T([0, 1, 2]))
    # parents (0) with 2 children and (1) with 1: flat [2 parents * top_k 2]
    assert (l2.head_index, l2.top_k, l2.node_start) == (1, 2, 4)
    _assert_eq(l2.parent_paths, T([[0, 1], [0, 2]]))
    _assert_eq(l2.child_select, T([0, 1, 2]))
    assert (l3.head_index, l3.top_k, l3.node_start) == (2, 1, 7)
    _assert_eq(l3.parent_paths, T([[0, 1, 4]]))
    _assert_eq(l3.child_select, T([0]))
    _assert_eq(b.scored_nodes, T([0, 1, 2, 4]))
    _assert_eq(b.row_of_node, T([0, 1, 2, -1, 3, -1, -1, -1]))
    _assert_eq(b.logit_nodes, T([0, 1, 2, 4]))
    assert b.node_rows == (0, 1, 2, -1, 3, -1, -1, -1) and not b.leaf_logits
    assert [c.tolist() for c in b.chains] == [[0], [0, 1], [0, 2], [0, 3], [0, 1, 4], [0, 1, 5], [0, 2, 6],
                                              [0, 1, 4, 7]]
    assert [c.tolist() for c in b.child_nodes] == [[1, 2, 3], [4, 5], [6], [], [7], [], [], []]
    # with leaf logits every node has a row: the scored ones first (acceptance reads rows 0..scored-1)
    leafy = build_buffers(make_topology([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]), leaf_logits=True)
    _assert_eq(leafy.logit_nodes, T([0, 1, 2, 4, 3, 5, 6, 7]))
    _assert_eq(leafy.row_of_node, T([0, 1, 2, 4, 3, 5, 6, 7]))
    assert leafy.num_scored == 4 and leafy.leaf_logits


def test_child_select_skips_padding_of_a_smaller_first_parent():
    # nodes: 0 root, 1 (0), 2 (1), 3 (0,0), 4 (1,0), 5 (1,1); depth 2: (0) has 1 child, (1) has 2
    b = build_buffers(make_topology([[0], [1], [0, 0], [1, 0], [1, 1]]))
    l2 = b.levels[1]
    assert l2.top_k == 2 and l2.node_start == 3
    _assert_eq(l2.parent_paths, T([[0, 1], [0, 2]]))
    _assert_eq(l2.child_select, T([0, 2, 3]))  # row 0 rank 0; row 1 ranks 0, 1
    _assert_eq(b.retrieve_indices, T([[0, 1, 3], [0, 2, 4], [0, 2, 5]]))
    _assert_eq(b.scored_nodes, T([0, 1, 2]))
    _assert_eq(b.row_of_node, T([0, 1, 2, -1, -1, -1]))


def test_buffers_ar_one_node():
    b = build_buffers(load_topology("ar"))
    assert b.num_nodes == 1 and b.levels == ()
    _assert_eq(b.depth_of, T([0]))
    _assert_eq(b.parent_of, T([-1]))
    _assert_eq(b.tree_mask, T([[True]]))
    _assert_eq(b.retrieve_indices, T([[0]]))
    assert b.scored_nodes.numel() == 0 and b.scored_nodes.dtype == torch.long
    # the root has no children, but the token after it needs its logits: it is the one logit node
    _assert_eq(b.logit_nodes, T([0]))
    _assert_eq(b.row_of_node, T([0]))


def test_buffers_consistent_on_hydra_tree():
    """Invariants on the 64-node tree: mask = ancestor closure, levels place children where nodes are."""
    topo = load_topology("hydra")
    b = build_buffers(topo)
    index = {(): 0, **{p: i for i, p in enumerate(topo.paths, start=1)}}
    for p, i in index.items():
        ancestors = {index[p[:k]] for k in range(len(p) + 1)}
        assert set(torch.nonzero(b.tree_mask[i]).flatten().tolist()) == ancestors
    assert b.retrieve_indices.shape == (42, 5)
    for level in b.levels:
        d = level.head_index + 1
        nodes = range(level.node_start, level.node_start + level.child_select.numel())
        assert all(len(topo.paths[n - 1]) == d for n in nodes)
        # the flat slot row * top_k + rank lands on the node whose path is parent + (rank,)
        for slot, node in zip(level.child_select.tolist(), nodes):
            row, rank = divmod(slot, level.top_k)
            parent = level.parent_paths[row, -1].item()
            assert b.parent_of[node].item() == parent
            assert topo.paths[node - 1][-1] == rank
    assert b.scored_nodes.numel() == 64 - 42
