"""Shared fixtures for the fast CPU tests: a tiny random Llama base model. The suite never reaches
the network: the hub and datasets libraries run offline (set before they are imported, and
inherited by every job and Ray worker a test starts), so a test that needs the hub fails at once."""

from __future__ import annotations

import os

os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402


def make_tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    """A 2-layer Llama (H=32, 4 query heads, 2 kv heads, V=97) with weights large enough to matter.

    transformers initialises with std 0.02, which makes every comparison trivially close; the
    weights are re-drawn with std 0.2 and the norm gains around 1 so that errors would show.
    """
    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=97, max_position_embeddings=128)
    model = LlamaForCausalLM(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
            else:
                param.copy_(0.2 * torch.randn(param.shape, generator=gen))
    return model.eval()


@pytest.fixture(scope="session")
def tiny_llama() -> LlamaForCausalLM:
    return make_tiny_llama()


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory):
    """(model_dir, heads_dir): a tiny random Llama saved as a local model directory named
    `tiny-vicuna` (so it takes the Vicuna chat format) with the embedded model's tokenizer, and
    4 prefix-mlp heads with their own vocab projections, as the production path has."""
    from transformers import AutoTokenizer

    from entmtp_ray.model.heads import init_heads, save_heads
    from entmtp_ray.model.loading import resolve_model_path

    root = tmp_path_factory.mktemp("local")
    model_dir, heads_dir = root / "tiny-vicuna", root / "heads"
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=49152, max_position_embeddings=512, eos_token_id=2)
    model = LlamaForCausalLM(config)
    model.save_pretrained(model_dir)
    AutoTokenizer.from_pretrained(resolve_model_path("smollm2-135m-instruct")).save_pretrained(model_dir)
    heads = init_heads(model, num_heads=4, shared_lm_head=False, seed=1, base_name=str(model_dir))
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(0.05 * torch.randn_like(p))
    save_heads(heads, heads_dir)
    return model_dir, heads_dir
