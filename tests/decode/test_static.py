"""The static-shape verify forward (decode/static.py), run eagerly on the CPU: the code a CUDA graph captures.

Only the capture itself is left for a GPU (tools/gpu_check.py): here the static cache, the position-indexed
writes and the whole-capacity mask must decode exactly what the dynamic forward decodes.
"""

from __future__ import annotations

import pytest
import torch

from entmtp_ray.config import DecodingConfig
from entmtp_ray.decode.static import STATIC_CAPACITY, static_capacity, static_mask
from entmtp_ray.decode.loop import SpecDecoder
from entmtp_ray.decode.policy import FixedTree
from entmtp_ray.decode.tree import build_buffers, make_topology
from entmtp_ray.model.llama import attention_mask
from helpers.readbacks import POLICIES, RULES, decode_counting  # tiny: conftest.py


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
    with pytest.raises(ValueError, match=f"leaves no room in the model's {decoder.cache.capacity}-token context"):
        decoder.prefill([1] * decoder.cache.capacity, DecodingConfig(policy="ar"))


def test_capturing_graphs_needs_cuda(tiny):
    loaded, drafter = tiny
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        SpecDecoder(loaded, drafter, FixedTree("fixed", make_topology([[0]])), static=True, graphs=True)


TREE5 = make_topology([[0], [1], [0, 0], [1, 0]])


def _greedy(decoder, prompt, new_tokens):
    return decoder.generate(prompt, DecodingConfig(policy="fixed", tree="unused", max_new_tokens=new_tokens)).output_token_ids


def test_a_jobs_static_cache_holds_its_longest_prompt_and_new_tokens_rounded_not_the_models_context():
    assert static_capacity(1400, 256, 64, 2048) == 1792  # Vicuna: 1,720 positions needed, 7 x 256
    assert static_capacity(1400, 256, 64, 8192) == 1792  # the embedded model: not its 8,192
    assert static_capacity(100, 28, 4, 2048) == 256
    assert static_capacity(1900, 256, 64, 2048) == 2048  # never past the context


@pytest.fixture
def long_context(tiny, monkeypatch):
    """The tiny model with a 1,024-position context (its rotary tables take any position)."""
    monkeypatch.setattr(tiny[0].model.config, "max_position_embeddings", 1024)
    return tiny


def test_the_engines_decoder_sizes_its_static_cache_from_the_job(long_context, monkeypatch):
    from entmtp_ray.pipeline import assemble

    loaded, drafter = long_context
    sized = []
    monkeypatch.setattr(assemble, "SpecDecoder", lambda *a, capacity=None, **k: sized.append(capacity))
    assemble.Stack(loaded, drafter, "untrained", 0).decoder(
        FixedTree("fixed", TREE5), DecodingConfig(policy="hydra", max_input_tokens=100, max_new_tokens=40))
    assert sized == [256]  # 100 + 40 + 5 rounded up, of the 1,024-position context
    static = SpecDecoder(loaded, drafter, FixedTree("fixed", TREE5), static=True, graphs=False, capacity=sized[0])
    assert static.cache.capacity == 256 < loaded.max_positions


def test_a_request_longer_than_the_static_cache_grows_it_and_decodes_what_the_dynamic_path_does(long_context):
    loaded, drafter = long_context
    prompt = list(range(5, 45))
    dynamic = _greedy(SpecDecoder(loaded, drafter, FixedTree("fixed", TREE5)), prompt, 60)
    decoder = SpecDecoder(loaded, drafter, FixedTree("fixed", TREE5), static=True, graphs=False, capacity=64)
    assert decoder.cache.capacity == 64
    assert _greedy(decoder, prompt, 60) == dynamic  # 40 + 60 + 5 positions: more than 64
    assert decoder.cache.capacity == 256 and decoder.verifier.cache is decoder.cache
    assert len(dynamic) == 60  # it ran to its token limit, not to a full 'context'


def test_prefill_and_step_run_outside_inference_mode_over_tensors_made_inside_it(tiny):
    """In graphs mode the verifier's inputs are inference tensors; a caller that steps the decoder itself (a sync
    count) must not hit 'Inplace update to inference tensor outside InferenceMode'."""
    loaded, drafter = tiny
    prompt = list(range(5, 25))
    want = _greedy(SpecDecoder(loaded, None, FixedTree("ar", make_topology([]))), prompt, 24)
    with torch.inference_mode():
        decoder = SpecDecoder(loaded, drafter, FixedTree("fixed", TREE5), static=True, graphs=False)
    assert torch.is_inference(decoder.verifier.start)
    request = decoder.prefill(prompt, DecodingConfig(policy="fixed", tree="unused", max_new_tokens=24))
    while request.finish is None:
        decoder.step(request)
    assert request.output == want


def test_decoders_for_other_policies_share_one_static_cache_and_verifier_and_decode_exactly(tiny):
    loaded, drafter = tiny
    prompt = list(range(5, 25))
    ar = FixedTree("ar", make_topology([]))
    want = _greedy(SpecDecoder(loaded, None, ar), prompt, 30)
    first = SpecDecoder(loaded, drafter, FixedTree("fixed", TREE5), static=True, graphs=False, capacity=128)
    others = [first.for_policy(FixedTree("chain", make_topology([[0], [0, 0]]))), first.for_policy(ar)]
    assert all(d.cache is first.cache and d.verifier is first.verifier for d in others)
    assert isinstance(others[1].drafter, type(first.drafter)) is False  # AR drafts nothing: no heads' work
    for decoder in [first, *others, first]:
        assert _greedy(decoder, prompt, 30) == want


def test_a_banks_timing_builds_one_decoder_and_shares_it_for_every_other_tree(tiny, tmp_path, monkeypatch):
    from types import SimpleNamespace

    from entmtp_ray.pipeline import calibration
    from entmtp_ray.pipeline.assemble import Stack

    loaded, drafter = tiny
    made = []
    original = SpecDecoder.for_policy
    monkeypatch.setattr(SpecDecoder, "for_policy", lambda self, policy: made.append(self) or original(self, policy))
    engine = SimpleNamespace(concurrency=1, stack=Stack(loaded, drafter, "untrained", 0), loaded=loaded,
                             encode=lambda prompt: list(range(5, 5 + len(prompt))))
    trees = {"ar": make_topology([], "ar"), "chain": make_topology([[0], [0, 0]], "chain"), "five": TREE5}
    steps, prefill = calibration.step_seconds(engine, trees, ["x" * 12, "y" * 16], 8, tmp_path)
    assert set(steps) == set(trees) and all(s > 0 for s in steps.values()) and prefill > 0
    assert len(made) == 2 and made[0] is made[1]  # the largest tree's decoder, shared by the two others
