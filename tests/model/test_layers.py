"""layers.py holds a checkpoint as transformers does (the job's actors load through it, 3 s fewer imports before the
first row, issue 50): the same parameters, rotary tables, norms and seeded layers, the same prompt ids, and the
same tokens out of the engine either way."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm

from entmtp_ray.config import EMBEDDED_MODEL, DecodingConfig, ModelConfig
from entmtp_ray.model import layers, loading
from entmtp_ray.model.layers import DecoderLayer, LlamaParams, RMSNorm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_checkpoint_loads_into_the_parameters_transformers_gives(tiny_model_dirs, dtype):
    for path in [tiny_model_dirs[0], loading.resolve_model_path(EMBEDDED_MODEL)]:  # untied, tied embeddings
        ours, theirs = layers.load(path, dtype), AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        mine, want = ours.state_dict(), theirs.state_dict()
        assert mine.keys() == want.keys()
        for name, tensor in mine.items():
            assert tensor.dtype == want[name].dtype and torch.equal(tensor, want[name]), (path, name)
        tied = theirs.lm_head.weight is theirs.model.embed_tokens.weight
        assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == tied == ours.config.tie_word_embeddings
        positions, like = torch.arange(0, 8000, 7)[None], torch.zeros(1, dtype=dtype)
        for mine_t, want_t in zip(ours.model.rotary_emb(like, positions), theirs.model.rotary_emb(like, positions)):
            assert mine_t.dtype == dtype and torch.equal(mine_t, want_t)
        for field in dataclasses.fields(LlamaParams):
            got, expected = getattr(ours.config, field.name), getattr(theirs.config, field.name, None)
            if field.name == "rope_theta":
                expected = theirs.config.rope_parameters["rope_theta"]
            assert got == expected, (path, field.name)
        assert ours.generation_config.eos_token_id == theirs.generation_config.eos_token_id
        assert not ours.training and not any(p.requires_grad for p in ours.parameters())


def test_a_seeded_layer_and_a_norm_are_transformers_own(tiny_llama):
    config = tiny_llama.config
    torch.manual_seed(3)
    ours = DecoderLayer(LlamaParams.of(config.to_dict()))
    torch.manual_seed(3)
    theirs = LlamaDecoderLayer(config, layer_idx=0)
    mine, want = ours.state_dict(), theirs.state_dict()
    assert mine.keys() == want.keys() and all(torch.equal(mine[k], want[k]) for k in mine)
    for dtype in (torch.float32, torch.bfloat16):
        norm, reference = RMSNorm(64, 1e-5).to(dtype), LlamaRMSNorm(64, eps=1e-5).to(dtype)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(64))
            reference.weight.copy_(norm.weight)
        x = (10 * torch.randn(5, 64)).to(dtype)
        assert torch.equal(norm(x), reference(x))


def test_what_the_containers_do_not_hold_goes_to_transformers(tmp_path):
    path = loading.resolve_model_path(EMBEDDED_MODEL)
    raw = json.loads((loading.Path(path) / "config.json").read_text())
    assert layers.problem(raw, loading.Path(path)) is None
    scaled = {**raw, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}}
    assert layers.problem(scaled, loading.Path(path)) == "a scaled rotary embedding"
    assert layers.problem({**raw, "rope_scaling": {"type": "linear", "factor": 2.0}}, loading.Path(path))
    assert layers.problem({**raw, "model_type": "qwen2"}, loading.Path(path)) == "model_type 'qwen2'"
    assert layers.problem(raw, tmp_path) == "no safetensors or PyTorch weights"
    assert not loading._own_modules(path, transformers_forward=True)
    assert loading._own_modules(path, transformers_forward=False)


def test_an_engine_decodes_the_same_tokens_from_the_same_prompt_ids_either_way():
    from helpers.engines import make_engine

    decoding = DecodingConfig(task="humaneval", max_new_tokens=24)
    ours = make_engine(ModelConfig(), decoding, transformers_forward=False)
    theirs = make_engine(ModelConfig(), decoding)
    assert isinstance(ours.loaded.model, layers.CausalLM) and not isinstance(theirs.loaded.model, layers.CausalLM)
    path = loading.resolve_model_path(EMBEDDED_MODEL)
    reference = AutoTokenizer.from_pretrained(path)
    prompts = ["Write a function that reverses a string.", "  Ünïcode, tabs\tand\nnewlines  ",
               [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"}]]
    for prompt in prompts:
        ids = ours.loaded.encode_prompt(prompt)
        assert ids == theirs.loaded.encode_prompt(prompt)
        turns = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        assert ids == reference(reference.apply_chat_template(turns, tokenize=False, add_generation_prompt=True),
                                add_special_tokens=False).input_ids
        assert ours.generate("r", prompt).output_token_ids == theirs.generate("r", prompt).output_token_ids
    assert ours.loaded.eos_token_ids == theirs.loaded.eos_token_ids and ours.loaded.max_positions == 8192


def test_sharded_and_pytorch_checkpoints_load_as_the_safetensors_one(tiny_model_dirs, tmp_path):
    """Vicuna v1.3 ships PyTorch shards with an index (and its rotary inv_freq stored); other models safetensors
    shards: the same parameters from each."""
    import shutil

    from safetensors.torch import load_file, save_file

    source = tiny_model_dirs[0]
    state = load_file(source / "model.safetensors")
    names = sorted(state)
    halves = [names[: len(names) // 2], names[len(names) // 2:]]
    for kind in ("safetensors", "bin"):
        target = tmp_path / kind
        target.mkdir()
        shutil.copy(source / "config.json", target)
        weight_map = {}
        for i, half in enumerate(halves):
            file = f"model-{i}.{kind}"
            part = {k: state[k].clone() for k in half}
            if kind == "bin":
                part[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = torch.ones(8)  # as old checkpoints hold it
                torch.save(part, target / file)
            else:
                save_file(part, target / file)
            weight_map.update({k: file for k in part})
        index = "model.safetensors.index.json" if kind == "safetensors" else "pytorch_model.bin.index.json"
        (target / index).write_text(json.dumps({"weight_map": weight_map}))
        loaded = layers.load(target, torch.float32).state_dict()
        assert loaded.keys() == state.keys() and all(torch.equal(loaded[k], state[k]) for k in state), kind
