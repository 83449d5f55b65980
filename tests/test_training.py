"""Head training on a tiny model: targets are assistant tokens, the loss falls, weights round-trip,
and an interrupted run resumed from its checkpoint ends where an uninterrupted one does."""

from __future__ import annotations

import pytest
import torch

from entmtp_ray.train import trainer as training
from entmtp_ray.model.heads import init_heads, load_heads
from entmtp_ray.model.loading import load_model
from entmtp_ray.train.trainer import TrainConfig, chat_sequence, evaluate, train

CHATS = [
    [{"role": "user", "content": f"Count from {i} to {i + 5}."},
     {"role": "assistant", "content": " ".join(str(k) for k in range(i, i + 6))}] for i in range(12)
]


@pytest.fixture(scope="module")
def tiny(tiny_model_dirs):
    """The tiny random model with a sharpened vocab projection, so its next-token distribution is
    peaked like a trained model's (a near-uniform teacher leaves the heads nothing to learn)."""
    loaded = load_model(str(tiny_model_dirs[0]), dtype="fp32", device="cpu")
    with torch.no_grad():
        loaded.model.lm_head.weight.mul_(40.0)
    return loaded


@pytest.fixture(scope="module")
def sequences(tiny):
    return [chat_sequence(tiny, chat, max_len=128) for chat in CHATS]


def fresh_heads(tiny, seed=3):
    return init_heads(tiny.model, num_heads=3, num_layers=2, shared_lm_head=True, seed=seed, base_name="tiny")


def test_only_assistant_tokens_are_targets(tiny, sequences):
    seq = sequences[2]
    targets = [t for t, m in zip(seq.token_ids, seq.target_mask) if m]
    assert tiny.tokenizer.decode(targets, skip_special_tokens=True).strip() == "2 3 4 5 6 7"
    prompt_part = seq.token_ids[: seq.target_mask.index(True)]
    assert prompt_part == tiny.encode_prompt(CHATS[2][0]["content"])


def test_a_few_steps_lower_the_loss(tiny, sequences, tmp_path):
    heads = fresh_heads(tiny)
    pad_id = tiny.tokenizer.pad_token_id or 0
    before = evaluate(heads, tiny.model, sequences, 512, pad_id)
    cfg = TrainConfig(lr=3e-3, warmup_steps=2, steps=25, batch_tokens=256, dropout=0.0, bf16=False, checkpoint_every=10)
    train(heads, tiny.model, sequences, cfg, tmp_path, pad_id, progress=False)
    after = evaluate(heads, tiny.model, sequences, 512, pad_id)
    assert all(a < 0.8 * b for a, b in zip(after["loss"], before["loss"])), (before, after)
    assert all(a > b for a, b in zip(after["top1"], before["top1"])), (before, after)
    reloaded = load_heads(tmp_path, tiny.model)
    rows = torch.randn(5, 3 * 64)
    assert torch.equal(reloaded.logits(1, rows, tiny.model.lm_head), heads.logits(1, rows, tiny.model.lm_head))


def test_heads_saved_in_bf16_are_half_the_size_and_load_as_the_rounded_weights(tiny, tmp_path):
    from entmtp_ray.model.heads import WEIGHTS_FILE, save_heads

    heads = fresh_heads(tiny)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(0.1 * torch.randn_like(p))
    save_heads(heads, tmp_path / "fp32")
    save_heads(heads, tmp_path / "bf16", torch.bfloat16)
    size = {d: (tmp_path / d / WEIGHTS_FILE).stat().st_size for d in ("fp32", "bf16")}
    assert size["bf16"] < 0.55 * size["fp32"]
    reloaded = load_heads(tmp_path / "bf16", tiny.model)
    for (name, want), got in zip(heads.state_dict().items(), reloaded.state_dict().values()):
        assert got.dtype == torch.float32, name
        assert torch.equal(got, want.to(torch.bfloat16).float()), name


def test_resume_continues_from_checkpoint(tiny, sequences, tmp_path, monkeypatch):
    pad_id = tiny.tokenizer.pad_token_id or 0
    cfg = TrainConfig(lr=2e-3, warmup_steps=1, steps=8, batch_tokens=128, dropout=0.2, bf16=False, checkpoint_every=3)
    whole = fresh_heads(tiny)
    train(whole, tiny.model, sequences, cfg, tmp_path / "whole", pad_id, progress=False)

    original = training._save_checkpoint

    def crash_after_first(*args):
        original(*args)
        raise KeyboardInterrupt

    monkeypatch.setattr(training, "_save_checkpoint", crash_after_first)
    interrupted = fresh_heads(tiny)
    with pytest.raises(KeyboardInterrupt):
        train(interrupted, tiny.model, sequences, cfg, tmp_path / "resumed", pad_id, progress=False)
    monkeypatch.setattr(training, "_save_checkpoint", original)
    resumed = fresh_heads(tiny, seed=99)  # different init: everything must come from the checkpoint
    state = train(resumed, tiny.model, sequences, cfg, tmp_path / "resumed", pad_id, resume=True, progress=False)
    assert state["step"] == 8 and [h["step"] for h in state["history"]] == list(range(1, 9))
    for (name, a), b in zip(whole.state_dict().items(), resumed.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-6), name


def test_head_losses_match_a_position_by_position_reference(tiny, sequences):
    """Head i at position t: input [h_t, E(x_t+1), ..., E(x_t+1+i)], target the base distribution
    for x_t+i+2, only where x_t+i+2 is a target token; checked with plain loops (padded batch)."""
    heads = fresh_heads(tiny, seed=5)
    batch = [sequences[0], sequences[5]]
    tokens, mask = training.pad(batch, 0, "cpu")
    losses, accuracy, counts = training.head_losses(heads, tiny.model, tokens, mask)
    with torch.no_grad():
        for i in range(heads.config.num_heads):
            total, n = 0.0, 0
            for seq in batch:
                ids = torch.tensor(seq.token_ids)
                hidden = tiny.model.model(input_ids=ids[None]).last_hidden_state[0]
                cos_sin = training.rotary(tiny.model.model.rotary_emb, hidden[None], torch.arange(len(ids)))
                ctx = heads.prefix_norm(heads.prefix_layer(hidden[None], position_embeddings=cos_sin))[0]
                emb = tiny.model.model.embed_tokens(ids)
                for t in range(len(ids) - i - 2):
                    if not seq.target_mask[t + i + 2]:
                        continue
                    row = torch.cat([ctx[t]] + [emb[t + 1 + j] for j in range(i + 1)])
                    student = torch.log_softmax(heads.logits(i, row[None], tiny.model.lm_head)[0], -1)
                    teacher = torch.log_softmax(tiny.model.lm_head(hidden[t + i + 1]), -1)
                    total += float(-(teacher.exp() * student).sum())
                    n += 1
            assert counts[i] == n
            assert abs(losses[i].item() - total / n) < 1e-3 * max(1.0, total / n)
