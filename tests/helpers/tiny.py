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


def gguf_q4_1(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [out, in] quantized to GGUF Q4_1 blocks and dequantized back to fp32, as llama.cpp's reference
    quantizer and gguf's dequantizer do: per 32 inputs m = the minimum, d = the range / 15 (both stored as fp16),
    q = floor((x - min) / d + 0.5) with the unrounded d, and w = d * q + m in fp32."""
    groups = weight.detach().float().reshape(weight.shape[0], -1, 32)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    d = (high - low) / 15
    inverse = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.floor((groups - low) * inverse + 0.5).clamp(0, 15)
    return (d.half().float() * q + low.half().float()).reshape(weight.shape)


def gguf_q8_0(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [out, in] quantized to GGUF Q8_0 blocks and dequantized back: per 32 inputs d = max |x| / 127 (stored
    as fp16), q = round(x / d) with the unrounded d, w = d * q in fp32."""
    groups = weight.detach().float().reshape(weight.shape[0], -1, 32)
    d = groups.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return (d.half().float() * torch.round(groups * inverse)).reshape(weight.shape)


def as_gguf_blocks(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """`model` with its decoder layers' weights as Q4_1 blocks and its embedding / lm_head as Q8_0 ones, dequantized
    to fp32: the embedded SmolLM2's layout (its GGUF), which the row products keep as blocks (products.exact_blocks)."""
    with torch.no_grad():
        for layer in model.model.layers:
            for module in layer.modules():
                if isinstance(module, torch.nn.Linear):
                    module.weight.copy_(gguf_q4_1(module.weight))
        model.lm_head.weight.copy_(gguf_q8_0(model.lm_head.weight))
        if model.model.embed_tokens.weight is not model.lm_head.weight:
            model.model.embed_tokens.weight.copy_(gguf_q8_0(model.model.embed_tokens.weight))
    return model
