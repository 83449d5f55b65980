"""The static-shape verify forward (decode/static.py), run eagerly on the CPU: the code a CUDA graph captures.

Only the capture itself is left for a GPU (jobs/gpu_check.py): here the static cache, the position-indexed
writes and the whole-capacity mask must decode exactly what the dynamic forward decodes.
"""

from __future__ import annotations

import pytest
import torch

from test_syncs import POLICIES, RULES, decode_counting, tiny  # noqa: F401  (tiny: a fixture)
from entmtp_ray.decode.static import STATIC_CAPACITY, static_mask
from entmtp_ray.decode.loop import SpecDecoder
from entmtp_ray.decode.policy import FixedTree
from entmtp_ray.decode.tree import build_buffers, make_topology
from entmtp_ray.model.llama import attention_mask


def test_the_static_mask_is_the_dynamic_mask_padded_to_the_capacity():
    buffers = build_buffers(make_topology([[0], [1], [0, 0], [1, 0], [1, 1]]))
    n, capacity = buffers.num_nodes, 16
    for start in (0, 1, 7, capacity - n):
        for groups in (1, 3):
            dynamic = attention_mask(buffers.tree_mask, start, n, "cpu", groups)  # [groups * n, start + n]
            static = static_mask(buffers.tree_mask, torch.tensor([start]), torch.arange(capacity), groups)
            assert static.shape == (groups * n, capacity)
            assert torch.equal(static[:, :start + n], dynamic) and not static[:, start + n:].any()


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("rule", list(RULES))
def test_static_verify_decodes_what_the_dynamic_one_does(tiny, policy, rule):
    """fp32: the same tokens, trees and accepted lengths, with the same one read-back per step."""
    dynamic = decode_counting(tiny, policy, rule, leaf_logits=True)
    static = decode_counting(tiny, policy, rule, leaf_logits=True, static=True)
    assert static[0] == dynamic[0]
    assert [s[:2] for s in static[1]] == [s[:2] for s in dynamic[1]]
    assert static[2] == dynamic[2]


def test_the_static_cache_spans_the_models_context_and_a_prompt_must_fit(tiny):
    loaded, drafter = tiny
    decoder = SpecDecoder(loaded, drafter, FixedTree("fixed", make_topology([[0], [1]])), static=True, graphs=False)
    assert decoder.cache.capacity == min(loaded.max_positions, STATIC_CAPACITY)
    from entmtp_ray.config import DecodingConfig
    with pytest.raises(ValueError, match=f"leaves no room in the model's {decoder.cache.capacity}-token context"):
        decoder.prefill([1] * decoder.cache.capacity, DecodingConfig(policy="ar"))


def test_capturing_graphs_needs_cuda(tiny):
    loaded, drafter = tiny
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        SpecDecoder(loaded, drafter, FixedTree("fixed", make_topology([[0]])), static=True, graphs=True)
