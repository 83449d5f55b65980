"""The tiny random Llama the fast tests run on, and the tiny model set-ups built from it (conftest.py's
fixtures wrap these)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from transformers import LlamaConfig, LlamaForCausalLM


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


def tiny_loaded(model: LlamaForCausalLM, decode=lambda ids, **_: ""):
    """`model` as a LoadedModel in fp32 on the CPU: raw chat format, no EOS, `decode` as its tokenizer's."""
    from entmtp_ray.model.loading import LoadedModel

    return LoadedModel(name="tiny", model=model, tokenizer=SimpleNamespace(decode=decode), chat_format="raw",
                       dtype=torch.float32, device=torch.device("cpu"), eos_token_ids=frozenset())


def tiny_with_heads():
    """(loaded, drafter): a fresh tiny Llama and 3 random one-layer Hydra heads drafting for it."""
    from entmtp_ray.decode.drafting import HydraDrafter
    from entmtp_ray.model.heads import init_heads

    model = make_tiny_llama()
    return tiny_loaded(model), HydraDrafter(init_heads(model, num_heads=3, num_layers=1, seed=1), model)
