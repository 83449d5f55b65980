"""Head checkpoints and model directories written the way others publish them: Hydra heads in the published
layout (config.json + torch.save'd hydra_lm_head.pt) for the tiny Llama's shapes, and a Vicuna-shaped model
whose tokenizer is only a sentencepiece model."""

from __future__ import annotations

import json

import torch
from transformers import LlamaConfig, LlamaForCausalLM

H, V, NUM_HEADS, NUM_LAYERS = 32, 97, 3, 4
PREFIX = "prefix_embeding_layer."
DECODER_LAYER_SHAPES = {  # a stock LlamaDecoderLayer of the tiny base: 4 heads x 8, 2 kv heads, MLP 64
    "self_attn.q_proj.weight": (32, 32),
    "self_attn.k_proj.weight": (16, 32),
    "self_attn.v_proj.weight": (16, 32),
    "self_attn.o_proj.weight": (32, 32),
    "mlp.gate_proj.weight": (64, 32),
    "mlp.up_proj.weight": (64, 32),
    "mlp.down_proj.weight": (32, 64),
    "input_layernorm.weight": (32,),
    "post_attention_layernorm.weight": (32,),
}


def _rand(gen, *shape, dtype):
    return (0.3 * torch.randn(*shape, generator=gen)).to(dtype)


def published_state(arch: str = "prefix-mlp", dtype=torch.float16, seed: int = 0) -> dict[str, torch.Tensor]:
    """A hydra_lm_head.pt state dict in the published layout, random values, 2-byte floats."""
    gen = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    if arch == "prefix-mlp":
        for key, shape in DECODER_LAYER_SHAPES.items():
            base = 1.0 if key.endswith("layernorm.weight") else 0.0
            state[f"{PREFIX}layers.0.{key}"] = (base + _rand(gen, *shape, dtype=torch.float32)).to(dtype)
        state[f"{PREFIX}layers.0.self_attn.rotary_emb.inv_freq"] = torch.rand(4, generator=gen).to(dtype)
        state[f"{PREFIX}norm.weight"] = (1.0 + _rand(gen, H, dtype=torch.float32)).to(dtype)
        state[f"{PREFIX}embed_tokens.weight"] = _rand(gen, V, H, dtype=dtype)
    state["input_embed_fn.weight"] = _rand(gen, V, H, dtype=dtype)
    first, tied, lm_head = (1, (3, 5, 7), "hydra_lm_head.{i}.1.") if arch == "prefix-mlp" else \
        (0, (1, 2, 3), "hydra_lm_head.{i}.")
    for i in range(NUM_HEADS):
        width = (i + 2) * H
        for part in ("linear", "res_connection"):
            state[f"hydra_mlp.{i}.{first}.{part}.weight"] = _rand(gen, H, width, dtype=dtype) / (i + 2)
            state[f"hydra_mlp.{i}.{first}.{part}.bias"] = _rand(gen, H, dtype=dtype)
        w, b = _rand(gen, H, H, dtype=dtype), _rand(gen, H, dtype=dtype)
        for j in tied:  # the reference stores the tied H->H block once per use
            state[f"hydra_mlp.{i}.{j}.linear.weight"] = w.clone()
            state[f"hydra_mlp.{i}.{j}.linear.bias"] = b.clone()
        state[lm_head.format(i=i) + "weight"] = _rand(gen, V, H, dtype=dtype)
        state[lm_head.format(i=i) + "bias"] = _rand(gen, V, dtype=dtype)
    return state


def write_checkpoint(directory, state, arch: str = "prefix-mlp", **overrides):
    directory.mkdir(parents=True, exist_ok=True)
    config = {"base_model_name_or_path": "tiny/llama", "hydra_head_arch": arch, "hydra_num_heads": NUM_HEADS,
              "hydra_num_layers": NUM_LAYERS, "grounded_heads": True, "hidden_state_offset": 0, **overrides}
    (directory / "config.json").write_text(json.dumps(config))
    torch.save(state, directory / "hydra_lm_head.pt")
    return directory


def make_sentencepiece_vicuna(root):
    """A tiny Vicuna-shaped model directory whose tokenizer is only a sentencepiece `tokenizer.model`, as
    lmsys/vicuna-7b-v1.3 ships it (no tokenizer.json): BPE with byte fallback, <unk>=0, <s>=1, </s>=2,
    a LlamaTokenizer config; the Llama has no GQA, rope theta 1e4, RMS eps 1e-6 and 2048 positions."""
    import sentencepiece as spm

    model_dir = root / "tiny-vicuna-sp"
    model_dir.mkdir()
    corpus = root / "corpus.txt"
    corpus.write_text("\n".join(["A chat between a curious user and an artificial intelligence assistant. USER: "
                                 "What is 2+3? ASSISTANT: It is 5.", "Write a Python function that adds two numbers."]
                                * 50))
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(model_dir / "tokenizer"), vocab_size=400,
                                   model_type="bpe", byte_fallback=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
                                   minloglevel=2)
    (model_dir / "tokenizer.vocab").unlink()
    (model_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "add_bos_token": True, "add_eos_token": False, "legacy": False, "model_max_length": 2048}))
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=4, vocab_size=400, max_position_embeddings=2048, rope_theta=1e4,
                         rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(config).save_pretrained(model_dir)
    return model_dir
