"""Host-device synchronisations per decoding step, counted on CPU.

On CUDA every read of a device value on the host (`.item()`, `.tolist()`, `int(t)`, `float(t)`, `bool(t)`,
...) waits for all queued kernels, so each one costs a launch-latency bubble per step. The decoder reads a
greedy or typical step back once and an exact-acceptance step twice (docs/design.md §8). The calls that
read back are counted here by wrapping them on torch.Tensor; tools/gpu_check.py counts the real
synchronisations on a GPU with torch.cuda.set_sync_debug_mode.
"""

from __future__ import annotations

import pytest
import torch

from entmtp_ray.decode.loop import SpecDecoder
from entmtp_ray.decode.tree import make_topology
from entmtp_ray.model.kernels import prepare
from entmtp_ray.model.products import ROWS_PER_WIDENING
from helpers.readbacks import POLICIES, RULES, TREE, decode_counting, read_backs  # tiny: conftest.py


def test_the_counter_sees_each_way_of_reading_a_tensor():
    t = torch.tensor([3.0, 1.0])
    with read_backs() as calls:
        int(t[0]), float(t[1]), t.tolist(), t[0].item(), bool(t[0] > 1), [0, 1, 2][t.long()[1]]
    assert calls == ["__int__", "__float__", "tolist", "item", "__bool__", "__index__"]


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("rule", list(RULES))
def test_a_step_reads_back_once_and_twice_under_exact_acceptance(tiny, policy, rule):
    """The CUDA configuration (logits at every node): 1 read-back per greedy or typical step, 2 exact
    (the walk's draws, then the residual's sample). Before this change a greedy tree step made 7."""
    output, steps, counts = decode_counting(tiny, policy, rule, leaf_logits=True)
    assert len(counts) >= 10 and len(output) > len(counts)  # the trees were used and accepted drafts
    budget = 2 if rule == "exact" and policy != "ar" else 1
    assert max(counts) <= budget, counts


@pytest.mark.parametrize("policy", ["tree", "entropy-ladder"])
@pytest.mark.parametrize("rule", list(RULES))
def test_leaf_logits_change_the_read_backs_not_the_output(tiny, policy, rule):
    """The CPU configuration (logits at the scored nodes only) reads a leaf's logits after the path: one more
    read-back when the last accepted node is a leaf, the same tokens, trees, statistics and random draws."""
    cuda_like = decode_counting(tiny, policy, rule, leaf_logits=True)
    cpu_like = decode_counting(tiny, policy, rule, leaf_logits=False)
    assert cpu_like[0] == cuda_like[0]
    for (tree, a, entropy, top1), (tree2, a2, entropy2, top12) in zip(cpu_like[1], cuda_like[1], strict=True):
        assert (tree, a) == (tree2, a2)
        assert entropy == pytest.approx(entropy2, abs=1e-5) and top1 == pytest.approx(top12, abs=1e-6)
    assert max(cpu_like[2]) <= 2


def test_on_cpu_row_products_small_trees_project_their_leaves_and_large_ones_do_not(tiny):
    """The CPU default: a tree whose nodes one widening of the row products serves projects every node (an extra
    row costs a tenth of the projection, a leaf's logits after the path another whole one); a larger tree its
    scored nodes only; torch's products (no row products) none; an explicit flag applies to every tree."""
    loaded, drafter = tiny
    small = make_topology([[0], [0, 0]], "small")
    large = make_topology([[i] for i in range(4)] + [[i, j] for i in range(4) for j in range(2)], "large")
    assert small.num_nodes <= ROWS_PER_WIDENING < large.num_nodes
    decoder = SpecDecoder(loaded, drafter, POLICIES["tree"]())
    if prepare(loaded.model).lm_head.native is None:
        pytest.skip("the row products are not built here: no tree projects its leaves")
    assert decoder.leaf_logits_for(small) and not decoder.leaf_logits_for(large)
    assert decoder.buffers[TREE].leaf_logits == (TREE.num_nodes <= ROWS_PER_WIDENING)
    explicit = SpecDecoder(loaded, drafter, POLICIES["tree"](), leaf_logits=False)
    assert not explicit.leaf_logits_for(small)
