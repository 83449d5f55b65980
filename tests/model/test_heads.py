"""Hydra heads: the published checkpoint mapping against hand-computed references, our own format."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm

from entmtp_ray.model.heads import CONFIG_FILE, init_heads, load_heads, save_heads
from helpers.checkpoints import (DECODER_LAYER_SHAPES, H, NUM_HEADS, NUM_LAYERS, PREFIX, V, published_state,
                                 write_checkpoint)


def reference_head_logits(state, i: int, x: torch.Tensor, arch: str = "prefix-mlp") -> torch.Tensor:
    """x -> res(x) + silu(lin(x)), then 3 x (x + silu(W x + b)), then the head's vocab projection."""
    s = {k: v.float() for k, v in state.items()}
    first, block, lm_head = (1, 3, f"hydra_lm_head.{i}.1.") if arch == "prefix-mlp" else \
        (0, 1, f"hydra_lm_head.{i}.")
    x = (x @ s[f"hydra_mlp.{i}.{first}.res_connection.weight"].T + s[f"hydra_mlp.{i}.{first}.res_connection.bias"]
         + F.silu(x @ s[f"hydra_mlp.{i}.{first}.linear.weight"].T + s[f"hydra_mlp.{i}.{first}.linear.bias"]))
    w, b = s[f"hydra_mlp.{i}.{block}.linear.weight"], s[f"hydra_mlp.{i}.{block}.linear.bias"]
    for _ in range(NUM_LAYERS - 1):
        x = x + F.silu(x @ w.T + b)
    return x @ s[lm_head + "weight"].T + s[lm_head + "bias"]


def expected_mapping(arch: str = "prefix-mlp") -> dict[str, str]:
    """Our parameter name -> the published key it must come from."""
    first, block, lm_head = (1, 3, "hydra_lm_head.{i}.1.") if arch == "prefix-mlp" else \
        (0, 1, "hydra_lm_head.{i}.")
    out = {}
    if arch == "prefix-mlp":
        out.update({f"prefix_layer.{k}": f"{PREFIX}layers.0.{k}" for k in DECODER_LAYER_SHAPES})
        out["prefix_norm.weight"] = f"{PREFIX}norm.weight"
    for i in range(NUM_HEADS):
        for part in ("weight", "bias"):
            out[f"mlps.{i}.first_linear.{part}"] = f"hydra_mlp.{i}.{first}.linear.{part}"
            out[f"mlps.{i}.first_res.{part}"] = f"hydra_mlp.{i}.{first}.res_connection.{part}"
            out[f"mlps.{i}.block.{part}"] = f"hydra_mlp.{i}.{block}.linear.{part}"
            out[f"lm_heads.{i}.{part}"] = lm_head.format(i=i) + part
    return out


@pytest.fixture(scope="module")
def base(tiny_llama):
    return tiny_llama


def test_decoder_layer_shapes_match_transformers(base):
    layer = LlamaDecoderLayer(base.config, layer_idx=0)
    assert {k: tuple(v.shape) for k, v in layer.state_dict().items()} == DECODER_LAYER_SHAPES


# --- published prefix-mlp (Hydra++) -----------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_published_prefix_mlp_maps_every_parameter(tmp_path, base, dtype):
    state = published_state(dtype=dtype)
    heads = load_heads(write_checkpoint(tmp_path / "ckpt", state), base)
    cfg = heads.config
    assert (cfg.arch, cfg.num_heads, cfg.num_layers, cfg.hidden_size, cfg.vocab_size) == \
        ("prefix-mlp", NUM_HEADS, NUM_LAYERS, H, V)
    assert cfg.shared_lm_head is False and cfg.base_model == "tiny/llama"
    ours = heads.state_dict()
    mapping = expected_mapping()
    assert set(ours) == set(mapping)
    for name, src in mapping.items():
        assert ours[name].dtype == torch.float32
        assert torch.equal(ours[name], state[src].float()), name


def test_published_prefix_mlp_head_logits_match_reference(tmp_path, base):
    state = published_state()
    heads = load_heads(write_checkpoint(tmp_path / "ckpt", state), base).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for i in range(NUM_HEADS):
            rows = torch.randn(5, (i + 2) * H, generator=gen)
            got = heads.logits(i, rows, base.lm_head)
            want = reference_head_logits(state, i, rows)
            assert got.shape == (5, V)
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)


def test_published_prefix_layer_matches_transformers_layer(tmp_path, base):
    state = published_state()
    heads = load_heads(write_checkpoint(tmp_path / "ckpt", state), base).eval()
    ref_layer = LlamaDecoderLayer(base.config, layer_idx=0).eval()
    ref_layer.load_state_dict({k: state[f"{PREFIX}layers.0.{k}"].float() for k in DECODER_LAYER_SHAPES})
    ref_norm = LlamaRMSNorm(H, eps=base.config.rms_norm_eps)
    ref_norm.load_state_dict({"weight": state[f"{PREFIX}norm.weight"].float()})

    n = 6
    x = torch.randn(n, H, generator=torch.Generator().manual_seed(2))
    positions = torch.arange(n)
    with torch.no_grad():
        causal = torch.full((n, n), float("-inf")).triu(1)[None, None]  # [1, 1, n, n] additive
        cos_sin = base.model.rotary_emb(x[None], positions[None])
        want = ref_norm(ref_layer(x[None], attention_mask=causal, position_ids=positions[None],
                                  position_embeddings=cos_sin))[0]
        cache = heads.new_cache(16, torch.float32, "cpu")
        got = heads.context(x, positions, cache, base.model.rotary_emb)
        assert cache.length == n
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)

        # incremental: 4 committed, then 2 more, reuses the prefix layer's own cache
        cache2 = heads.new_cache(16, torch.float32, "cpu")
        first = heads.context(x[:4], positions[:4], cache2, base.model.rotary_emb)
        second = heads.context(x[4:], positions[4:], cache2, base.model.rotary_emb)
        assert cache2.length == n
        torch.testing.assert_close(torch.cat([first, second]), want, atol=1e-5, rtol=1e-5)
        one = heads.context(x[:1], positions[:1], heads.new_cache(4, torch.float32, "cpu"), base.model.rotary_emb)
        torch.testing.assert_close(one, want[:1], atol=1e-5, rtol=1e-5)


# --- published mlp (original Hydra) -----------------------------------------------------------

def test_published_mlp_arch(tmp_path, base):
    state = published_state(arch="mlp")
    assert not any(k.startswith(PREFIX) for k in state)
    heads = load_heads(write_checkpoint(tmp_path / "ckpt", state, arch="mlp"), base).eval()
    assert heads.config.arch == "mlp" and heads.prefix_layer is None
    assert heads.new_cache(8, torch.float32, "cpu") is None
    ours = heads.state_dict()
    mapping = expected_mapping("mlp")
    assert set(ours) == set(mapping)
    for name, src in mapping.items():
        assert torch.equal(ours[name], state[src].float()), name
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for i in range(NUM_HEADS):
            rows = torch.randn(4, (i + 2) * H, generator=gen)
            torch.testing.assert_close(heads.logits(i, rows, base.lm_head),
                                       reference_head_logits(state, i, rows, arch="mlp"), atol=1e-4, rtol=1e-5)
        x = torch.randn(3, H, generator=gen)
        assert torch.equal(heads.context(x, torch.arange(3), None, base.model.rotary_emb), x)


def test_published_arch_defaults_to_mlp(tmp_path, base):
    d = write_checkpoint(tmp_path / "ckpt", published_state(arch="mlp"), arch="mlp")
    config = json.loads((d / "config.json").read_text())
    del config["hydra_head_arch"]
    (d / "config.json").write_text(json.dumps(config))
    assert load_heads(d, base).config.arch == "mlp"


# --- published checkpoint errors --------------------------------------------------------------

def test_untied_blocks_are_refused(tmp_path, base):
    state = published_state()
    state["hydra_mlp.1.5.linear.weight"] = state["hydra_mlp.1.5.linear.weight"] + 1
    with pytest.raises(ValueError, match=r"'hydra_mlp\.1\.5\.linear\.weight' differs from "
                                         r"'hydra_mlp\.1\.3\.linear\.weight'.*tied"):
        load_heads(write_checkpoint(tmp_path / "ckpt", state), base)


def test_untied_bias_is_refused(tmp_path, base):
    state = published_state(arch="mlp")
    state["hydra_mlp.2.3.linear.bias"] = torch.zeros_like(state["hydra_mlp.2.3.linear.bias"])
    with pytest.raises(ValueError, match="tied"):
        load_heads(write_checkpoint(tmp_path / "ckpt", state, arch="mlp"), base)


@pytest.mark.parametrize("key", ["hydra_mlp.1.1.res_connection.bias", "hydra_mlp.2.7.linear.weight",
                                 "hydra_lm_head.0.1.weight", "prefix_embeding_layer.norm.weight"])
def test_missing_key_is_named(tmp_path, base, key):
    state = published_state()
    del state[key]
    with pytest.raises(ValueError, match=f"lacks '{key.replace('.', '[.]')}'"):
        load_heads(write_checkpoint(tmp_path / "ckpt", state), base)


def test_missing_prefix_layer_key_is_named(tmp_path, base):
    state = published_state()
    del state[f"{PREFIX}layers.0.mlp.down_proj.weight"]
    with pytest.raises(ValueError, match=r"prefix_embeding_layer\.layers\.0\.mlp\.down_proj\.weight"):
        load_heads(write_checkpoint(tmp_path / "ckpt", state), base)


@pytest.mark.parametrize("key", ["hydra_mlp.0.9.linear.weight", "hydra_lm_head.3.1.weight", "medusa_head.0.weight",
                                 "prefix_embeding_layer.layers.1.mlp.up_proj.weight"])
def test_unknown_key_is_refused(tmp_path, base, key):
    state = published_state()
    state[key] = torch.zeros(2, 2, dtype=torch.float16)
    with pytest.raises(ValueError, match=f"unexpected keys.*{key.replace('.', '[.]')}"):
        load_heads(write_checkpoint(tmp_path / "ckpt", state), base)


def test_ungrounded_heads_are_refused(tmp_path, base):
    d = write_checkpoint(tmp_path / "ckpt", published_state(), grounded_heads=False)
    with pytest.raises(ValueError, match="ungrounded"):
        load_heads(d, base)


def test_unknown_arch_is_refused(tmp_path, base):
    d = write_checkpoint(tmp_path / "ckpt", published_state(), arch="eagle")
    with pytest.raises(ValueError, match=r"'eagle' is not supported.*'mlp', 'prefix-mlp'"):
        load_heads(d, base)


def test_no_heads_in_directory(tmp_path, base):
    with pytest.raises(FileNotFoundError, match="no heads in"):
        load_heads(tmp_path, base)


# --- our own format ---------------------------------------------------------------------------

def _perturb(heads, seed: int):
    """init_heads zeroes the SiLU branches; randomise everything so a round trip is meaningful."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(0.2 * torch.randn(p.shape, generator=gen))


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("arch", ["prefix-mlp", "mlp"])
def test_save_load_round_trip(tmp_path, base, shared, arch):
    heads = init_heads(base, num_heads=3, num_layers=3, arch=arch, shared_lm_head=shared, seed=5, base_name="tiny")
    _perturb(heads, 9)
    heads.eval()
    save_heads(heads, tmp_path / "h")
    loaded = load_heads(tmp_path / "h", base).eval()
    assert loaded.config == heads.config
    assert (loaded.lm_heads is None) == shared
    a, b = heads.state_dict(), loaded.state_dict()
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for i in range(3):
            rows = torch.randn(4, (i + 2) * H, generator=gen)
            assert torch.equal(heads.logits(i, rows, base.lm_head), loaded.logits(i, rows, base.lm_head))
        if arch == "prefix-mlp":
            x, pos = torch.randn(5, H, generator=gen), torch.arange(5)
            ctx_a = heads.context(x, pos, heads.new_cache(8, torch.float32, "cpu"), base.model.rotary_emb)
            ctx_b = loaded.context(x, pos, loaded.new_cache(8, torch.float32, "cpu"), base.model.rotary_emb)
            assert torch.equal(ctx_a, ctx_b)


def test_shared_lm_head_uses_the_base_projection(base):
    heads = init_heads(base, num_heads=2, shared_lm_head=True).eval()
    rows = torch.randn(3, 3 * H)
    with torch.no_grad():
        torch.testing.assert_close(heads.logits(1, rows, base.lm_head), base.lm_head(heads.head_hidden(1, rows)))


def test_own_lm_heads_start_as_the_base_projection(base):
    heads = init_heads(base, num_heads=2, shared_lm_head=False)
    for proj in heads.lm_heads:
        assert torch.equal(proj.weight, base.lm_head.weight) and not proj.bias.any()


def test_init_heads_deterministic_and_rng_neutral(base):
    before = torch.random.get_rng_state()
    a = init_heads(base, num_heads=2, seed=3).state_dict()
    assert torch.equal(torch.random.get_rng_state(), before)
    b = init_heads(base, num_heads=2, seed=3).state_dict()
    c = init_heads(base, num_heads=2, seed=4).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)


def test_init_heads_silu_branches_start_input_independent(base):
    """As in Hydra's ResBlock, the SiLU branches start with zero weights (biases stay random)."""
    heads = init_heads(base, num_heads=1, num_layers=4, arch="mlp").eval()
    rows = torch.randn(2, 2 * H)
    with torch.no_grad():
        m = heads.mlps[0]
        want = m.first_res(rows) + F.silu(m.first_linear.bias) + 3 * F.silu(m.block.bias)
        torch.testing.assert_close(heads.head_hidden(0, rows), want)


def test_load_refuses_heads_of_another_base(tmp_path, base):
    heads = init_heads(base, num_heads=1, arch="mlp")
    save_heads(heads, tmp_path / "h")
    config = json.loads((tmp_path / "h" / CONFIG_FILE).read_text())
    config["vocab_size"] = 50
    (tmp_path / "h" / CONFIG_FILE).write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"hidden/vocab 32/50 do not match the base model's 32/97"):
        load_heads(tmp_path / "h", base)


def test_load_refuses_other_format_version(tmp_path, base):
    save_heads(init_heads(base, num_heads=1, arch="mlp"), tmp_path / "h")
    config = json.loads((tmp_path / "h" / CONFIG_FILE).read_text())
    config["format_version"] = 99
    (tmp_path / "h" / CONFIG_FILE).write_text(json.dumps(config))
    with pytest.raises(ValueError, match="format_version 99"):
        load_heads(tmp_path / "h", base)
