"""Issue 19: a Vicuna-shaped model (no GQA, rope theta 1e4, RMS eps 1e-6, 2048 positions, a
sentencepiece-only tokenizer, the Vicuna chat format) with Hydra++ heads in the published layout
(config.json + torch.save'd hydra_lm_head.pt) through jobs/generate.py (run in this process, on the session's
Ray): the tree policy's greedy output equals AR's token for token, and AR's equals transformers' greedy generate.

Random heads on a random base accept almost nothing, so a wrong accepted path (KV cache kept, the
drafter advanced, tokens emitted) would go unseen. Here the base model mostly, but not always,
emits SUCC[previous token] (its embeddings carry that map to the lm_head; the decoder layers are
large enough to break it, so outputs depend on the prompt), and each head drafts SUCC of the last
token it is given: drafts are accepted several deep, and rejected where the base model departs.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from entmtp_ray.decode.tree import load_topology
from entmtp_ray.model.heads import load_heads
from entmtp_ray.model.loading import VICUNA_SYSTEM, load_model

from helpers.checkpoints import make_sentencepiece_vicuna, write_checkpoint
from helpers.jobs import read_output, run_here

pytestmark = pytest.mark.slow

NUM_HEADS = NUM_LAYERS = 4  # as ankner/hydra-vicuna-7b-v1.3; the hydra tree drafts 4 deep
MAX_NEW_TOKENS = 24
PROMPTS = {"add": "What is 2+3?", "code": "Write a Python function that adds two numbers.",
           "colours": "Name three colours.", "joke": "Tell me a joke about cats."}
LAYER_STD = 0.15  # decoder weights: at 0.1 every prompt gives the same SUCC chain, at 0.2 it is lost


def successor(vocab: int) -> torch.Tensor:
    """SUCC[t]: a permutation of the ordinary tokens (never <unk>, <s>, </s>, so rows run to the limit)."""
    ordinary = vocab - 3
    return torch.tensor([3 + ((t - 3) * 7 + 11) % ordinary if t >= 3 else 3 + t for t in range(vocab)])


def _unit(rows: torch.Tensor) -> torch.Tensor:
    return rows / rows.norm(dim=1, keepdim=True)


def make_successor_vicuna(root):
    """make_sentencepiece_vicuna's directory (its shapes and tokenizer), its weights redrawn so that
    greedy decoding mostly follows SUCC. Returns (model_dir, embeddings [V, H])."""
    model_dir = make_sentencepiece_vicuna(root)
    model = LlamaForCausalLM.from_pretrained(model_dir)
    vocab, hidden = model.config.vocab_size, model.config.hidden_size
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.model.layers.named_parameters():
            base = 1.0 if name.endswith("norm.weight") else 0.0
            param.copy_(base + (0.1 if base else LAYER_STD) * torch.randn(param.shape, generator=gen))
        embed = torch.randn(vocab, hidden, generator=gen)
        model.model.embed_tokens.weight.copy_(embed)
        lm_head = 0.05 * torch.randn(vocab, hidden, generator=gen)
        model.lm_head.weight.copy_(lm_head.index_add_(0, successor(vocab), 3.0 * _unit(embed)))
    model.save_pretrained(model_dir)
    return model_dir, embed


def published_successor_heads(directory, model_dir, embed: torch.Tensor):
    """Hydra++ (prefix-mlp) heads for the model above in the published layout, fp16 as published: the
    tensors of helpers.checkpoints.published_state at this model's shapes (random, small), except that each
    head's first residual map passes the last embedding of its input through and its vocab projection
    maps E(t) to SUCC[t]."""
    config = LlamaConfig.from_pretrained(model_dir)
    vocab, hidden = embed.shape
    gen = torch.Generator().manual_seed(1)

    def rand(*shape, std=0.02):
        return std * torch.randn(*shape, generator=gen)

    state = {}
    prefix = "prefix_embeding_layer."  # sic, the reference's spelling
    for key, value in LlamaDecoderLayer(config, layer_idx=0).state_dict().items():
        state[f"{prefix}layers.0.{key}"] = 1.0 + rand(*value.shape) if key.endswith("layernorm.weight") \
            else rand(*value.shape, std=0.1)
    head_dim = hidden // config.num_attention_heads
    state[f"{prefix}layers.0.self_attn.rotary_emb.inv_freq"] = 1e4 ** -(torch.arange(0, head_dim, 2) / head_dim)
    state[f"{prefix}norm.weight"] = 1.0 + rand(hidden)
    state[f"{prefix}embed_tokens.weight"] = embed.clone()
    state["input_embed_fn.weight"] = embed.clone()
    to_succ = torch.zeros(vocab, hidden).index_add_(0, successor(vocab), _unit(embed))
    for i in range(NUM_HEADS):
        width = (i + 2) * hidden
        passthrough = torch.cat([torch.zeros(hidden, width - hidden), torch.eye(hidden)], dim=1)
        state[f"hydra_mlp.{i}.1.res_connection.weight"] = passthrough + rand(hidden, width)
        state[f"hydra_mlp.{i}.1.res_connection.bias"] = rand(hidden)
        state[f"hydra_mlp.{i}.1.linear.weight"] = rand(hidden, width)
        state[f"hydra_mlp.{i}.1.linear.bias"] = rand(hidden)
        block_w, block_b = rand(hidden, hidden), rand(hidden)
        for j in range(3, 2 * NUM_LAYERS, 2):  # Dropout, ResBlock, ...: the tied H->H block stored per use
            state[f"hydra_mlp.{i}.{j}.linear.weight"] = block_w.clone()
            state[f"hydra_mlp.{i}.{j}.linear.bias"] = block_b.clone()
        state[f"hydra_lm_head.{i}.1.weight"] = to_succ + rand(vocab, hidden)
        state[f"hydra_lm_head.{i}.1.bias"] = rand(vocab)
    state = {key: value.half() for key, value in state.items()}
    return write_checkpoint(directory, state, hydra_num_heads=NUM_HEADS, hydra_num_layers=NUM_LAYERS,
                            base_model_name_or_path=str(model_dir))


def generate(tmp_path, model_dir, policy: str, *extra: str) -> dict[str, dict]:
    """One fp32 job over PROMPTS; its rows by id."""
    output = tmp_path / f"out-{policy}"
    proc = run_here(["--dataset", str(tmp_path / "prompts.jsonl"), "--id-column", "id", "--model",
                     str(model_dir), "--policy", policy, "--dtype", "fp32", "--device", "cpu",
                     "--max-new-tokens", str(MAX_NEW_TOKENS), "--output", str(output), *extra])
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["rows"] == len(PROMPTS) and summary["errors"] == 0 and summary["duplicates"] == 0
    rows = {r["id"]: r for r in read_output(output)}
    assert sorted(rows) == sorted(PROMPTS)
    for row_id, row in rows.items():
        assert row["error"] is None and row["prompt"] == PROMPTS[row_id] and row["policy"] == policy
        assert row["num_output_tokens"] == len(row["output_token_ids"]) == MAX_NEW_TOKENS
    return rows


def test_vicuna_with_published_heads_tree_output_equals_ar(tmp_path, ray_cluster):
    model_dir, embed = make_successor_vicuna(tmp_path)
    heads_dir = published_successor_heads(tmp_path / "hydra-heads", model_dir, embed)
    assert sorted(p.name for p in heads_dir.iterdir()) == ["config.json", "hydra_lm_head.pt"]
    assert not (model_dir / "tokenizer.json").exists() and "vicuna" in model_dir.name
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"id": k, "prompt": v}) + "\n"
                                                    for k, v in PROMPTS.items()))

    loaded = load_model(str(model_dir), dtype="fp32", device="cpu")
    cfg = loaded.model.config
    assert (cfg.num_key_value_heads, cfg.rope_parameters, cfg.rms_norm_eps, cfg.max_position_embeddings) == \
        (cfg.num_attention_heads, {"rope_theta": 1e4, "rope_type": "default"}, 1e-6, 2048)
    assert loaded.chat_format == "vicuna_v1.1"
    heads = load_heads(heads_dir, loaded.model)
    assert (heads.config.arch, heads.config.num_heads, heads.config.num_layers) == ("prefix-mlp", NUM_HEADS, NUM_LAYERS)

    ar = generate(tmp_path, model_dir, "ar")
    hydra = generate(tmp_path, model_dir, "hydra", "--heads", str(heads_dir))

    succ = successor(cfg.vocab_size).tolist()
    tree_nodes = len(load_topology("hydra").paths) + 1
    for row_id, prompt in PROMPTS.items():
        ids = loaded.encode_prompt(prompt)
        text = loaded.tokenizer.decode(ids, skip_special_tokens=True)
        assert ids[0] == 1 and text == f"{VICUNA_SYSTEM} USER: {prompt} ASSISTANT:", text
        want = loaded.model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=MAX_NEW_TOKENS,
                                     pad_token_id=2)[0, len(ids):].tolist()
        a, h = ar[row_id], hydra[row_id]
        assert a["num_prompt_tokens"] == h["num_prompt_tokens"] == len(ids)
        assert a["output_token_ids"] == want, row_id
        assert h["output_token_ids"] == a["output_token_ids"], row_id
        assert h["output_text"] == a["output_text"]
        # the prefill emits the first token; after it AR verified one node a step, and hydra its whole
        # tree (root included) every step, never falling back to a smaller one
        assert a["steps"] == a["verified_nodes"] == MAX_NEW_TOKENS - 1 and a["heads"] is None
        assert dict(h["tree_usage"]) == {"hydra": h["steps"]} and h["verified_nodes"] == tree_nodes * h["steps"]
        assert h["heads"] == str(heads_dir) and len(h["accepted_per_position"]) == NUM_HEADS
        assert sum(h["step_accepted_lengths"]) == MAX_NEW_TOKENS - 1
        # the base model leaves SUCC somewhere in every row, so the heads' drafts are also rejected
        out = a["output_token_ids"]
        assert any(succ[x] != y for x, y in zip(out, out[1:])), row_id
    # drafts were accepted, several deep: the steps' accepted paths are what made the equal output
    assert sum(h["steps"] for h in hydra.values()) < 0.6 * sum(a["steps"] for a in ar.values())
    assert max(max(h["step_accepted_lengths"]) for h in hydra.values()) == NUM_HEADS + 1
    assert len({tuple(a["output_token_ids"]) for a in ar.values()}) == len(PROMPTS)  # the prompt matters
