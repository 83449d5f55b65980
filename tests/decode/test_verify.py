"""The verify seam (decode/verify.py): every tree a decoder scores goes through its verifier, a lone request is a
batch of one, several requests in one call score as each would alone, and the static verifier refuses what it
cannot score. The tiny random Llama in fp32 (conftest.py's `tiny`)."""

from __future__ import annotations

import pytest
import torch

from entmtp_ray.config import DecodingConfig
from entmtp_ray.decode.loop import SpecDecoder
from entmtp_ray.decode.policy import FixedTree
from entmtp_ray.decode.static import StaticVerifier
from entmtp_ray.decode.verify import DynamicVerifier, Tree
from helpers.readbacks import PROMPT, TREE  # tiny: conftest.py


class Recording:
    """A verifier that records each call's batch size and passes it on."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def add(self, trees):
        self.inner.add(trees)

    def __call__(self, trees):
        self.calls.append(len(trees))
        return self.inner(trees)


@pytest.mark.parametrize("static", [False, True])
def test_every_step_of_a_generation_verifies_through_the_decoders_verifier(tiny, static):
    loaded, drafter = tiny
    cfg = DecodingConfig(policy="fixed", tree="unused", max_new_tokens=24)
    plain = SpecDecoder(loaded, drafter, FixedTree("fixed", TREE), static=static, graphs=False)
    expected = plain.generate(PROMPT, cfg).output_token_ids
    decoder = SpecDecoder(loaded, drafter, FixedTree("fixed", TREE), static=static, graphs=False)
    assert isinstance(decoder.verifier, StaticVerifier if static else DynamicVerifier)
    decoder.verifier = Recording(decoder.verifier)
    result = decoder.generate(PROMPT, cfg)
    assert result.output_token_ids == expected
    assert decoder.verifier.calls == [1] * len(result.steps)  # one tree a step, a batch of one


def _pending(decoder, prompt, cfg):
    """A prefilled request of `decoder` and its drafted tree, ready to verify."""
    request = decoder.prefill(prompt, cfg)
    buffers = decoder.buffers[TREE]
    return request, Tree(decoder.cache, buffers, decoder.drafter.draft(buffers, request.root), request.plan)


@torch.inference_mode()
def test_requests_scored_in_one_call_score_as_each_does_alone(tiny):
    loaded, drafter = tiny
    cfg = DecodingConfig(policy="fixed", tree="unused", max_new_tokens=8)
    base = SpecDecoder(loaded, drafter, FixedTree("fixed", TREE))
    lanes = [base.lane() for _ in range(3)]
    prompts = [PROMPT, PROMPT + [4, 6], PROMPT[:3]]  # different lengths: different committed prefixes
    trees = [_pending(lane, p, cfg)[1] for lane, p in zip(lanes, prompts)]
    lengths = [t.cache.length for t in trees]
    together = DynamicVerifier(loaded.model)(trees)
    assert [t.cache.length for t in trees] == lengths  # scoring keeps nothing: commit does
    for tree, length, joint in zip(trees, lengths, together):
        alone = DynamicVerifier(loaded.model)([tree])[0]
        assert joint.committed == alone.committed == length
        assert joint.tokens is tree.tokens and joint.buffers is tree.buffers
        assert joint.logits.shape == (tree.buffers.logit_nodes.numel(), loaded.model.config.vocab_size)
        torch.testing.assert_close(joint.hidden, alone.hidden, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(joint.logits, alone.logits, rtol=1e-5, atol=1e-5)
        assert torch.equal(joint.logits.argmax(-1), alone.logits.argmax(-1))


@torch.inference_mode()
def test_the_static_verifier_scores_one_request_over_its_own_cache(tiny):
    loaded, drafter = tiny
    cfg = DecodingConfig(policy="fixed", tree="unused", max_new_tokens=8)
    static = SpecDecoder(loaded, drafter, FixedTree("fixed", TREE), static=True, graphs=False)
    dynamic = SpecDecoder(loaded, drafter, FixedTree("fixed", TREE))
    _, mine = _pending(static, PROMPT, cfg)
    _, foreign = _pending(dynamic, PROMPT, cfg)
    with pytest.raises(ValueError, match="one request's tree over its own cache"):
        static.verifier([mine, mine])
    with pytest.raises(ValueError, match="one request's tree over its own cache"):
        static.verifier([foreign])
    ours, theirs = static.verifier([mine])[0], dynamic.verifier([foreign])[0]
    assert ours.committed == theirs.committed == len(PROMPT)
    torch.testing.assert_close(ours.logits, theirs.logits, rtol=1e-5, atol=1e-5)
