"""The fast path against its slow references: prepacked bf16 projections, fused q/k/v and gate/up
weights (shared, and rebuilt when a weight changes), and drafting over a draft vocabulary."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from entmtp_ray.decode.drafting import HydraDrafter
from entmtp_ray.model.heads import DRAFT_VOCAB_FILE, init_heads, load_draft_vocab, save_draft_vocab
from entmtp_ray.model.kv_cache import KVCache
from entmtp_ray.model.heads import HeadPlan
from entmtp_ray.model.llama import forward_hidden, rotary_tables
from entmtp_ray.model.kernels import Projection, _onednn_packing, fused_projections, linear
from entmtp_ray.decode.tree import build_buffers, load_topology
from entmtp_ray.model import products
from helpers.tiny import make_tiny_llama

# oneDNN's bf16 packing: built in, and a CPU with AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT (not an AVX2-only one)
needs_onednn = pytest.mark.skipif(not _onednn_packing(), reason="oneDNN cannot pack bf16 weights on this CPU")


@needs_onednn
@pytest.mark.parametrize("rows", [1, 2, 3, 17, 65])
def test_packed_bf16_projection_is_bitwise_f_linear(rows):
    gen = torch.Generator().manual_seed(rows)
    weight = (0.05 * torch.randn(96, 80, generator=gen)).bfloat16()
    bias = (0.1 * torch.randn(96, generator=gen)).bfloat16()
    x = torch.randn(1, rows, 80, generator=gen).bfloat16()
    projection = Projection.of(weight, bias)
    assert projection.packed is not None
    with torch.inference_mode():
        assert torch.equal(projection(x), F.linear(x, weight, bias))


@needs_onednn
def test_one_row_rounds_as_it_does_inside_a_tree():
    """oneDNN's own one-row kernel for a K = 1536 product (SmolLM2's down projection) rounds some rows
    differently from the multi-row kernel (22 of these 200 here); a one-token step must not."""
    gen = torch.Generator().manual_seed(0)
    projection = Projection.of((0.03 * torch.randn(576, 1536, generator=gen)).bfloat16(), None)
    with torch.inference_mode():
        for _ in range(200):
            rows = (torch.randn(8, 1536, generator=gen) * torch.rand(1536, generator=gen) ** 4).bfloat16()
            assert torch.equal(projection(rows[:1])[0], projection(rows)[0])
            assert torch.equal(projection(rows[None, :1])[0, 0], projection(rows)[0])  # [1, 1, K] as the layers pass it


@needs_onednn
def test_drafting_projection_takes_native_gemv_for_one_row_only_and_restores_onednn():
    gen = torch.Generator().manual_seed(7)
    weight = (0.05 * torch.randn(96, 80, generator=gen)).bfloat16()
    bias = (0.1 * torch.randn(96, generator=gen)).bfloat16()
    drafting = Projection.of(weight, bias).for_drafting()
    assert drafting.draft_gemv and not Projection.of(weight, bias).draft_gemv
    one, many = torch.randn(1, 1, 80, generator=gen).bfloat16(), torch.randn(1, 5, 80, generator=gen).bfloat16()
    with torch.inference_mode():
        with torch.backends.mkldnn.flags(enabled=False):
            native = F.linear(one, weight, bias)
        assert torch.equal(drafting(one), native)
        assert torch.backends.mkldnn.is_available() and torch._C._get_mkldnn_enabled()  # switched back on
        assert torch.equal(drafting(many), Projection.of(weight, bias)(many))  # rows > 1: the packed kernel
        with pytest.raises(RuntimeError):
            drafting(torch.randn(1, 81).bfloat16())  # a failing call leaves oneDNN on too
        assert torch._C._get_mkldnn_enabled()
    fp32 = Projection.of(weight.float(), bias.float()).for_drafting()
    assert not fp32.draft_gemv  # nothing packed, nothing to bypass


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_tables_rotate_exactly_as_transformers(dtype):
    from transformers.models.llama.modeling_llama import rotate_half

    model = make_tiny_llama(2).to(dtype)
    x = torch.randn(6, 5, model.config.hidden_size // model.config.num_attention_heads).to(dtype)
    positions = torch.tensor([3, 4, 4, 5, 40])  # tree nodes share depths
    cos, sin = model.model.rotary_emb(x, positions[None])
    tab_cos, signed_sin = rotary_tables(model.model.rotary_emb, x, positions)
    assert torch.equal(tab_cos, cos)
    ours = x * tab_cos + x.roll(x.shape[-1] // 2, -1) * signed_sin
    assert torch.equal(ours, x * cos + rotate_half(x) * sin)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_plan_is_the_head_mlp(dtype):
    model = make_tiny_llama(3)
    heads = init_heads(model, num_heads=2, seed=4).eval()
    with torch.no_grad():
        for p in heads.mlps.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    heads.to(dtype)
    rows = torch.randn(4, 3 * model.config.hidden_size).to(dtype)
    if dtype == torch.float32 and products.native_ready():
        # fp32 drafting multiplies Q8_0 blocks of the weights on int8 inputs (integer products; drafts only steer
        # which tokens are verified): the MLP with its weights and each product's inputs rounded so, up to the
        # products' own rounding
        mlp = heads.mlps[1]

        def rounded(x, layer):
            held = products.q8_0(layer.weight)
            weight = held.data.float() * held.scales.repeat_interleave(32, dim=1)
            groups = x.reshape(x.shape[0], -1, 32)
            amax = groups.abs().amax(-1, keepdim=True)
            q = torch.round(groups * torch.where(amax > 0, 127 / amax, torch.zeros_like(amax)))
            return (q * (amax / 127)).reshape(x.shape) @ weight.t() + layer.bias

        with torch.inference_mode():
            x = rounded(rows, mlp.first_res) + torch.nn.functional.silu(rounded(rows, mlp.first_linear))
            for _ in range(mlp.repeats):
                x = x + torch.nn.functional.silu(rounded(x, mlp.block))
            torch.testing.assert_close(HeadPlan.of(mlp)(rows), x, atol=1e-4, rtol=1e-4)
        return
    with torch.inference_mode():
        assert torch.equal(HeadPlan.of(heads.mlps[1])(rows), heads.mlps[1](rows))  # multi-row: same kernels
        tol = 0 if dtype == torch.float32 else 2e-2  # one bf16 row: native GEMV, rounded its own way
        torch.testing.assert_close(HeadPlan.of(heads.mlps[1])(rows[:1]), heads.mlps[1](rows[:1]), atol=tol, rtol=tol)


def _hf_hidden(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(ids[None], output_hidden_states=True).hidden_states[-1][0]


def _ours(model, ids: torch.Tensor) -> torch.Tensor:
    cfg = model.config
    cache = KVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads,
                    64, model.dtype, "cpu")
    with torch.inference_mode():
        return forward_hidden(model, cache, ids, torch.arange(ids.numel()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_forward_matches_transformers_and_shares_weights(dtype):
    model = make_tiny_llama(3).to(dtype)
    ids = torch.arange(5, 25)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(_ours(model, ids), _hf_hidden(model, ids), atol=tol, rtol=tol)
    layer = model.model.layers[0]
    fused = fused_projections(layer)
    storage = fused.qkv.weight.untyped_storage().data_ptr()
    for part in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
        assert part.weight.untyped_storage().data_ptr() == storage  # views, not copies
    assert fused.gate_up.weight.untyped_storage().data_ptr() == layer.mlp.up_proj.weight.untyped_storage().data_ptr()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weights_changed_after_first_use_are_picked_up(dtype):
    """In-place updates (training) and replaced tensors (`.to()`) both reach the fast path."""
    model = make_tiny_llama(4).to(dtype)
    ids = torch.arange(3, 15)
    _ours(model, ids)  # builds the fused and packed weights
    with torch.no_grad():
        model.model.layers[0].self_attn.k_proj.weight.mul_(1.5)  # in place, through a view of the fused tensor
        model.model.layers[1].mlp.down_proj.weight.mul_(-1.0)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(_ours(model, ids), _hf_hidden(model, ids), atol=tol, rtol=tol)
    model.to(torch.float32)  # replaces every weight tensor
    torch.testing.assert_close(_ours(model, ids), _hf_hidden(model, ids), atol=1e-5, rtol=1e-5)


def test_linear_takes_layer_bias():
    layer = torch.nn.Linear(7, 5)
    x = torch.randn(2, 7)
    torch.testing.assert_close(linear(x, layer), layer(x))


# --- draft vocabulary -------------------------------------------------------------------------

def _drafts(model, heads, vocab, tree="hydra"):
    drafter = HydraDrafter(heads, model, vocab)
    hidden = torch.randn(6, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        drafter.begin(hidden, torch.arange(6), capacity=64)
        return drafter.draft(build_buffers(load_topology(tree, max_depth=4)), root=5)


def test_draft_vocab_of_every_token_drafts_what_the_full_projection_drafts():
    model = make_tiny_llama(5)
    heads = init_heads(model, num_heads=4, seed=2).eval()
    with torch.no_grad():
        for p in heads.mlps.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    every = torch.randperm(model.config.vocab_size, generator=torch.Generator().manual_seed(1)).tolist()
    assert torch.equal(_drafts(model, heads, every), _drafts(model, heads, None))


def test_draft_vocab_drafts_only_its_tokens():
    model = make_tiny_llama(6)
    heads = init_heads(model, num_heads=4, seed=3).eval()
    vocab = list(range(0, 97, 3))  # 33 of 97 tokens
    tokens = _drafts(model, heads, vocab)
    assert set(tokens[1:].tolist()) <= set(vocab)


def test_draft_vocab_file_round_trip_and_errors(tmp_path):
    assert load_draft_vocab(tmp_path, None) is None  # no file: full vocabulary
    assert load_draft_vocab(tmp_path, 0) is None
    with pytest.raises(FileNotFoundError, match="jobs/draft_vocab.py"):
        load_draft_vocab(tmp_path, 8)
    save_draft_vocab([9, 4, 7, 1], [40, 30, 20, 10], tmp_path, {"sharegpt_conversations": 1}, default_size=3)
    assert load_draft_vocab(tmp_path, None) == [9, 4, 7]
    assert load_draft_vocab(tmp_path, 2) == [9, 4]
    assert load_draft_vocab(tmp_path, 0) is None
    with pytest.raises(ValueError, match="at most 4"):
        load_draft_vocab(tmp_path, 5)
    data = json.loads((tmp_path / DRAFT_VOCAB_FILE).read_text())
    (tmp_path / DRAFT_VOCAB_FILE).write_text(json.dumps({**data, "format_version": 99}))
    with pytest.raises(ValueError, match="rebuild"):
        load_draft_vocab(tmp_path, None)


def test_verifier_stats_match_the_softmax_definition():
    from entmtp_ray.decode.verify import verifier_stat, verifier_stats

    logits = 4 * torch.randn(5, 300, generator=torch.Generator().manual_seed(0))
    logits[1, 7] = 60.0  # nearly one-hot
    logits[2, :250] = float("-inf")  # masked tokens
    logits[3] = 0.0  # uniform
    probs = torch.softmax(logits.double(), -1)
    entropy = -torch.special.xlogy(probs, probs).sum(-1)
    got_entropy, got_top1 = verifier_stats(logits)
    torch.testing.assert_close(torch.tensor(got_entropy, dtype=torch.double), entropy, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(torch.tensor(got_top1, dtype=torch.double), probs.max(-1).values, atol=1e-6, rtol=1e-5)
    assert abs(got_entropy[3] - torch.log(torch.tensor(300.0)).item()) < 1e-4
    torch.testing.assert_close(verifier_stat("top1", logits).double(), probs.max(-1).values, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(verifier_stat("entropy", logits).double(), entropy, atol=1e-4, rtol=1e-4)
