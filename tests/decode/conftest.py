"""Fixtures of the oracle tests (helpers/oracle.py): the tiny Llama as a LoadedModel and its greedy
continuation of PROMPT, checked against transformers'. Module-scoped, so each module builds its own; a module
that decodes another way (test_stop, test_greedy_exact) defines its own `loaded` and `reference`."""

from __future__ import annotations

import pytest
import torch

from entmtp_ray.config import DecodingConfig
from entmtp_ray.decode.loop import SpecDecoder
from entmtp_ray.decode.policy import FixedTree
from entmtp_ray.decode.tree import load_topology
from helpers.oracle import MAX_NEW, PROMPT
from helpers.tiny import tiny_loaded


@pytest.fixture(scope="module")
def loaded(tiny_llama):
    return tiny_loaded(tiny_llama)


@pytest.fixture(scope="module")
def reference(loaded) -> list[int]:
    """Plain greedy decoding of PROMPT: transformers' generate, and our AR loop must agree."""
    with torch.inference_mode():
        want = loaded.model.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=MAX_NEW,
                                     pad_token_id=0, eos_token_id=None)[0, len(PROMPT):].tolist()
    ar = SpecDecoder(loaded, None, FixedTree("ar", load_topology("ar"))).generate(PROMPT, DecodingConfig(policy="ar",
                                                                                          max_new_tokens=MAX_NEW))
    assert ar.output_token_ids == want and ar.finish_reason == "length"
    assert all(s.accepted_length == 1 for s in ar.steps) and len(ar.steps) == MAX_NEW - 1
    return want
