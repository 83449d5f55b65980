"""The native decoder step (entmtp_ray/model/step.py): the Python layers' result up to rounding, and every tree row
bitwise the one-token step at its position, its kept k/v included (design §7)."""

import random

import pytest
import torch

from entmtp_ray.model import native, products, step
from entmtp_ray.model.kernels import prepare, quantize_model, set_model_activations
from entmtp_ray.model.kv_cache import KVCache
from entmtp_ray.model.llama import forward_hidden
from helpers.tiny import as_gguf_blocks, make_tiny_llama

pytestmark = pytest.mark.skipif(native.kernel() is None, reason="no C++ compiler: the native step is not built")


def _cache(model, capacity=64) -> KVCache:
    c = model.config
    return KVCache(c.num_hidden_layers, c.num_key_value_heads, c.hidden_size // c.num_attention_heads, capacity,
                   torch.float32, "cpu")


@pytest.fixture(scope="module", params=["none", "int8", "int4", "gguf-blocks", "int4-int8", "gguf-blocks-int8"])
def model(request):
    model = make_tiny_llama()
    weights = request.param.removesuffix("-int8")
    if weights == "gguf-blocks":  # fp32 weights that are Q4_1 blocks: the step multiplies the blocks
        as_gguf_blocks(model)
    elif weights != "none":
        quantize_model(model, weights)
    if request.param.endswith("-int8"):  # the products' inputs rounded to int8
        set_model_activations(model, "int8")
    model.scheme_under_test = request.param
    return model


_KINDS = {"none": products.KINDS[torch.float32, "none"], "int8": products.KINDS["int8"],
          "int4": products.KINDS["int4"], "gguf-blocks": products.KINDS["int4"],
          "int4-int8": products.KINDS["int4", "int8"], "gguf-blocks-int8": products.KINDS["int4", "int8"]}


def test_the_step_serves_the_model_and_gives_the_python_layers_result(model, monkeypatch):
    plan = prepare(model)
    assert step.for_model(model, plan) is not None
    kinds = {p.native.kind for layer in plan.layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down)}
    assert kinds == {_KINDS[model.scheme_under_test]}
    if model.scheme_under_test.startswith("gguf-blocks"):
        int8 = model.scheme_under_test.endswith("-int8")
        assert plan.lm_head.native.kind == products.KINDS[("q8_0", "int8") if int8 else "q8_0"]
    tokens, positions = torch.tensor([5, 17, 3, 60, 2]), torch.arange(5)
    with torch.inference_mode():
        native_cache, python_cache = _cache(model), _cache(model)
        native = forward_hidden(model, native_cache, tokens, positions, plan=plan)
        monkeypatch.setattr(step, "for_model", lambda *_: None)  # the Python layers, on the same products
        python = forward_hidden(model, python_cache, tokens, positions, plan=plan)
    assert torch.allclose(native, python, atol=1e-4, rtol=1e-4)
    assert torch.allclose(native_cache.k[:, :, :5], python_cache.k[:, :, :5], atol=1e-4, rtol=1e-4)
    assert torch.allclose(native_cache.v[:, :, :5], python_cache.v[:, :, :5], atol=1e-4, rtol=1e-4)


def _random_tree(rng: random.Random, nodes: int) -> list[int]:
    """Each node's parent (-1: the root's), parents before children."""
    return [-1] + [rng.randrange(i) for i in range(1, nodes)]


def test_every_tree_row_and_its_kv_are_bitwise_the_one_token_step_at_its_position(model):
    rng = random.Random(0)
    prompt = torch.tensor([rng.randrange(97) for _ in range(7)])
    plan = prepare(model)
    with torch.inference_mode():
        for nodes in (2, 5, 13, 40):
            parents = _random_tree(rng, nodes)
            depth = [0] * nodes
            for i, p in enumerate(parents):
                depth[i] = 0 if p < 0 else depth[p] + 1
            mask = torch.eye(nodes, dtype=torch.bool)
            for i, p in enumerate(parents):
                if p >= 0:
                    mask[i] |= mask[p]
            tokens = torch.tensor([rng.randrange(97) for _ in range(nodes)])
            tree_cache = _cache(model, 128)
            forward_hidden(model, tree_cache, prompt, torch.arange(7), plan=plan)
            tree_cache.commit(7)
            tree = forward_hidden(model, tree_cache, tokens, 7 + torch.tensor(depth), mask, plan=plan)
            for leaf in rng.sample(range(nodes), min(nodes, 4)):
                path = [leaf]
                while parents[path[-1]] >= 0:
                    path.append(parents[path[-1]])
                cache = _cache(model, 128)
                forward_hidden(model, cache, prompt, torch.arange(7), plan=plan)
                cache.commit(7)
                for node in reversed(path):  # the path's tokens as one-token steps
                    row = forward_hidden(model, cache, tokens[node:node + 1], torch.tensor([7 + depth[node]]),
                                         plan=plan)
                    assert torch.equal(row[0], tree[node]), (nodes, node)
                    slot = cache.length
                    assert torch.equal(cache.k[:, :, slot], tree_cache.k[:, :, 7 + node]), (nodes, node)
                    assert torch.equal(cache.v[:, :, slot], tree_cache.v[:, :, 7 + node]), (nodes, node)
                    cache.commit(1)
