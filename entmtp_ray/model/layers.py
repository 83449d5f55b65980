"""The Llama-family module tree the engine decodes with, loaded from a checkpoint's files without transformers'
modelling.

The engine never calls transformers' forward: model/llama.py runs its own over the weights. An actor that loaded the
model through `AutoModelForCausalLM` paid some 3 s of imports on 2 cores first (transformers' config and modelling
stack pulls torch.distributed.tensor and torch._dynamo), before its first row (issue 50). These containers hold the
same parameters under the same names as transformers' Llama (either loads the other's state dict), built in the
same order (a seeded construction draws the same weights), with its default rotary tables computed as it computes
them. transformers stays the loader wherever its forward or generate runs (training, the bench's baselines) and for
any checkpoint `problem` names (another rotary scaling, another architecture).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

WEIGHT_FILES = (
    "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


@dataclass
class LlamaParams:
    """The config.json fields the engine reads (named as transformers names them, so code reads either config)."""
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    eos_token_id: int | list[int] | None

    @classmethod
    def of(cls, raw: dict) -> LlamaParams:
        heads = raw["num_attention_heads"]
        rope = raw.get("rope_parameters") or {}
        return cls(raw["model_type"], raw["hidden_size"], raw["intermediate_size"], raw["num_hidden_layers"], heads,
                   raw.get("num_key_value_heads") or heads, raw.get("head_dim") or raw["hidden_size"] // heads,
                   raw.get("rms_norm_eps", 1e-6), raw["vocab_size"], raw.get("max_position_embeddings", 2048),
                   float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))), raw.get("tie_word_embeddings", False),
                   raw.get("attention_bias", False), raw.get("mlp_bias", False), raw.get("eos_token_id"))


def problem(raw: dict, directory: Path) -> str | None:
    """Why these containers do not hold the checkpoint in `directory` (config `raw`) as transformers would; None
    when they do."""
    if raw.get("model_type") not in ("llama", "mistral"):
        return f"model_type {raw.get('model_type')!r}"
    rope = raw.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default" or raw.get("rope_scaling"):
        return "a scaled rotary embedding"
    if raw.get("hidden_act", "silu") != "silu":
        return f"hidden_act {raw.get('hidden_act')!r}"
    if raw.get("quantization_config"):
        return "a quantized checkpoint"
    if not any((directory / name).is_file() for name in WEIGHT_FILES):
        return "no safetensors or PyTorch weights"
    return None


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # transformers' LlamaRMSNorm, operation for operation
        normed = x.to(torch.float32)
        normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * normed.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, p: LlamaParams):
        super().__init__()
        self.head_dim = p.head_dim
        self.scaling = p.head_dim ** -0.5
        self.q_proj = nn.Linear(p.hidden_size, p.num_attention_heads * p.head_dim, bias=p.attention_bias)
        self.k_proj = nn.Linear(p.hidden_size, p.num_key_value_heads * p.head_dim, bias=p.attention_bias)
        self.v_proj = nn.Linear(p.hidden_size, p.num_key_value_heads * p.head_dim, bias=p.attention_bias)
        self.o_proj = nn.Linear(p.num_attention_heads * p.head_dim, p.hidden_size, bias=p.attention_bias)


class MLP(nn.Module):
    def __init__(self, p: LlamaParams):
        super().__init__()
        self.gate_proj = nn.Linear(p.hidden_size, p.intermediate_size, bias=p.mlp_bias)
        self.up_proj = nn.Linear(p.hidden_size, p.intermediate_size, bias=p.mlp_bias)
        self.down_proj = nn.Linear(p.intermediate_size, p.hidden_size, bias=p.mlp_bias)
        self.act_fn = nn.SiLU()


class DecoderLayer(nn.Module):
    """One decoder layer's weights (the base model's, and the Hydra++ heads' prefix layer)."""

    def __init__(self, p: LlamaParams):
        super().__init__()
        self.self_attn = Attention(p)
        self.mlp = MLP(p)
        self.input_layernorm = RMSNorm(p.hidden_size, p.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(p.hidden_size, p.rms_norm_eps)


class RotaryEmbedding(nn.Module):
    """cos, sin of positions, as transformers' default Llama rotary embedding computes them (fp32, then the
    input's dtype)."""

    def __init__(self, p: LlamaParams):
        super().__init__()
        inv_freq = 1.0 / (p.rope_theta ** (torch.arange(0, p.head_dim, 2, dtype=torch.float) / p.head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype=x.dtype), emb.sin().to(dtype=x.dtype)


class Decoder(nn.Module):
    def __init__(self, p: LlamaParams):
        super().__init__()
        # built only to be loaded (`load`): an empty table, not a random one (on the meta device, nn.Embedding's
        # normal_ init alone imports torch._dynamo: a second of the imports this module exists to avoid)
        self.embed_tokens = nn.Embedding(p.vocab_size, p.hidden_size, _weight=torch.empty(p.vocab_size, p.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(p) for _ in range(p.num_hidden_layers))
        self.norm = RMSNorm(p.hidden_size, p.rms_norm_eps)


@dataclass
class GenerationParams:
    eos_token_id: int | list[int] | None


class CausalLM(nn.Module):
    """`model` (embeddings, layers, final norm, rotary tables) and `lm_head`, as transformers nests them."""

    def __init__(self, p: LlamaParams, eos_token_id=None):
        super().__init__()
        self.config = p
        self.generation_config = GenerationParams(p.eos_token_id if eos_token_id is None else eos_token_id)
        self.model = Decoder(p)
        self.lm_head = nn.Linear(p.hidden_size, p.vocab_size, bias=False)


def _state(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    for name in WEIGHT_FILES:
        path = directory / name
        if not path.is_file():
            continue
        files = sorted(set(json.loads(path.read_text())["weight_map"].values())) if name.endswith(".json") else [name]
        state = {}
        for file in files:
            state.update(load_file(directory / file) if file.endswith(".safetensors")
                         else torch.load(directory / file, map_location="cpu", weights_only=True, mmap=True))
        return state
    raise FileNotFoundError(f"{directory}: none of {WEIGHT_FILES}")


def load(directory: str | Path, dtype: torch.dtype) -> CausalLM:
    """The checkpoint in `directory` (problem() is None for it) in `dtype`, on CPU, in eval mode without gradients."""
    directory = Path(directory)
    raw = json.loads((directory / "config.json").read_text())
    p = LlamaParams.of(raw)
    generation = directory / "generation_config.json"
    eos = json.loads(generation.read_text()).get("eos_token_id") if generation.is_file() else None
    with torch.device("meta"):
        model = CausalLM(p, eos)
    state = {k: v.to(dtype) for k, v in _state(directory).items() if not k.endswith("rotary_emb.inv_freq")}
    if p.tie_word_embeddings:  # a tied checkpoint may store the head or not
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    if p.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight  # one parameter, as transformers ties them
    model.model.rotary_emb = RotaryEmbedding(p)  # computed, not stored
    return model.eval().requires_grad_(False)
