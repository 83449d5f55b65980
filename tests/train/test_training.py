"""Head training on a tiny model: targets are assistant tokens, the loss falls, weights round-trip,
and an interrupted run resumed from its checkpoint ends where an uninterrupted one does."""

from __future__ import annotations

from pathlib import Path

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
        assert torch.equal(a, b), name  # bit for bit


def test_resume_with_other_options_is_refused(tiny, sequences, tmp_path):
    pad_id = tiny.tokenizer.pad_token_id or 0
    cfg = TrainConfig(lr=2e-3, warmup_steps=1, steps=2, batch_tokens=128, bf16=False, checkpoint_every=1)
    train(fresh_heads(tiny), tiny.model, sequences, cfg, tmp_path, pad_id, progress=False)
    with pytest.raises(ValueError, match="another configuration"):
        train(fresh_heads(tiny), tiny.model, sequences, cfg.model_copy(update={"lr": 1e-3}), tmp_path, pad_id,
              resume=True, progress=False)
    longer = train(fresh_heads(tiny), tiny.model, sequences, cfg.model_copy(update={"steps": 3}), tmp_path, pad_id,
                   resume=True, progress=False)  # a larger --steps extends a finished run
    assert longer["step"] == 3


def test_head_losses_match_a_position_by_position_reference(tiny, sequences):
    """Head i at position t: input [h_t, E(x_t+1), ..., E(x_t+1+i)], target the base distribution
    for x_t+i+2, only where x_t+i+2 is a target token; checked with plain loops (padded batch)."""
    heads = fresh_heads(tiny, seed=5)
    batch = [sequences[0], sequences[5]]
    tokens, mask = training.pad(batch, 0, "cpu")
    losses, accuracy, counts = training.head_losses(heads, tiny.model, tokens, mask)
    for i in range(heads.config.num_heads):
        want, n = reference_loss(heads, tiny, batch, i)
        assert counts[i] == n
        assert abs(losses[i].item() - want) < 1e-3 * max(1.0, want)


def reference_loss(heads, tiny, batch, i, vocab=None, top_k=0):
    """Head i's mean soft cross-entropy and target count, position by position with plain loops: the
    student over `vocab` (token ids; None: all), the teacher restricted to it and to its top_k, renormalised."""
    total, n = 0.0, 0
    with torch.no_grad():
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
                student = heads.logits(i, row[None], tiny.model.lm_head)[0]
                teacher = torch.softmax(tiny.model.lm_head(hidden[t + i + 1]), -1)
                if vocab is not None:
                    student, teacher = student[vocab], teacher[vocab]
                if top_k:
                    keep = teacher.topk(top_k).indices
                    dropped = torch.ones_like(teacher, dtype=torch.bool)
                    dropped[keep] = False
                    teacher = teacher.masked_fill(dropped, 0.0)
                teacher = teacher / teacher.sum()
                total += float(-(teacher * torch.log_softmax(student, -1)).sum())
                n += 1
    return total / n, n


def test_head_losses_over_a_draft_vocabulary_and_top_k_teacher(tiny, sequences):
    heads = fresh_heads(tiny, seed=5)
    batch = [sequences[1], sequences[7], sequences[4]]
    tokens, mask = training.pad(batch, 0, "cpu")
    ranked = training.rank_targets(sequences)
    vocab = torch.tensor([t for t, _ in ranked[:10]])
    teacher = training.run_teacher(tiny.model, tokens, mask, vocab, 4, bf16=False)
    assert teacher.probs.shape[1] == 4 and torch.allclose(teacher.probs.sum(-1), torch.ones(len(teacher.probs)))
    assert ((teacher.kept_mass > 0) & (teacher.kept_mass <= 1 + 1e-6)).all()
    losses, _, counts = training.head_losses(heads, tiny.model, tokens, mask, teacher=teacher, vocab=vocab)
    for i in range(heads.config.num_heads):
        want, n = reference_loss(heads, tiny, batch, i, vocab, 4)
        assert counts[i] == n
        assert abs(losses[i].item() - want) < 1e-4 * max(1.0, want), (i, losses[i].item(), want)


def test_rank_targets_counts_assistant_tokens_only(tiny, sequences):
    ranked = training.rank_targets(sequences)
    counts = dict(ranked)
    targets = [t for s in sequences for t, m in zip(s.token_ids, s.target_mask) if m]
    assert sum(counts.values()) == len(targets) and set(counts) == set(targets)
    assert [c for _, c in ranked] == sorted(counts.values(), reverse=True)


def test_the_teacher_cache_gives_the_teacher_the_base_gives(tiny, sequences, tmp_path, monkeypatch):
    from entmtp_ray.train import cache as caching

    monkeypatch.setattr(caching, "SHARD_SEQUENCES", 5)  # 12 sequences: 3 shards
    vocab = torch.tensor([t for t, _ in training.rank_targets(sequences)[:16]])
    built = caching.TeacherCache.build(tmp_path, "tiny", tiny.model, sequences, 0, vocab, 4, bf16=False,
                                       batch_tokens=200, progress=False)
    assert len(built) == len(sequences) and 0 < built.stats["teacher_mass_kept"] <= 1
    batch = [9, 2, 5]
    tokens, mask = training.pad([sequences[k] for k in batch], 0, "cpu")
    cached = built.teacher(batch, mask)
    live = training.run_teacher(tiny.model, tokens, mask, vocab, 4, bf16=False)
    assert torch.equal(cached.rows, live.rows) and torch.equal(cached.top, live.top)
    assert torch.equal(cached.index, live.index)
    assert torch.allclose(cached.probs, live.probs, atol=1e-6)
    lengths = [len(sequences[k].token_ids) for k in batch]
    for row, n in enumerate(lengths):  # padding of the batch is zeros; the sequences' own states match
        assert torch.allclose(cached.hidden[row, :n], live.hidden[row, :n], atol=1e-5)
        assert not cached.hidden[row, n:].any()

    # a killed build resumes at its missing shard, and rebuilds it to the same bytes
    where = Path(built.stats["directory"])
    shard = where / caching._shard_name(5)
    original = shard.read_bytes()
    shard.unlink()
    again = caching.TeacherCache.build(tmp_path, "tiny", tiny.model, sequences, 0, vocab, 4, bf16=False,
                                       batch_tokens=200, progress=False)
    assert shard.read_bytes() == original and torch.equal(again.hidden, built.hidden)
    # other data (or another K) is another cache, never the stale one
    other = caching.TeacherCache.build(tmp_path, "tiny", tiny.model, sequences[:6], 0, vocab, 4, bf16=False,
                                       progress=False)
    assert Path(other.stats["directory"]) != where and len(other) == 6


def test_training_from_the_cache_resumes_bit_for_bit(tiny, sequences, tmp_path, monkeypatch):
    from entmtp_ray.train.cache import TeacherCache

    pad_id = tiny.tokenizer.pad_token_id or 0
    vocab = torch.tensor([t for t, _ in training.rank_targets(sequences)[:32]])
    cache = TeacherCache.build(tmp_path / "cache", "tiny", tiny.model, sequences, pad_id, vocab, 8, bf16=True,
                               progress=False)
    cfg = TrainConfig(lr=3e-3, warmup_steps=1, steps=6, batch_tokens=128, dropout=0.1, bf16=True,
                      checkpoint_every=2, draft_vocab=32, teacher_top_k=8)
    whole = fresh_heads(tiny)
    first = train(whole, tiny.model, sequences, cfg, tmp_path / "whole", pad_id, progress=False, vocab=vocab,
                  cache=cache)
    stopped = fresh_heads(tiny)
    train(stopped, tiny.model, sequences, cfg.model_copy(update={"max_minutes": 1e-9}), tmp_path / "resumed",
          pad_id, progress=False, vocab=vocab, cache=cache)  # stops (and checkpoints) after its first step
    saved = []
    resumed = fresh_heads(tiny, seed=99)
    state = train(resumed, tiny.model, sequences, cfg, tmp_path / "resumed", pad_id, resume=True, progress=False,
                  vocab=vocab, cache=cache, on_save=saved.append)
    assert state["step"] == 6 and saved == [tmp_path / "resumed"]
    assert [h["loss"] for h in state["history"]] == [h["loss"] for h in first["history"]]
    for (name, a), b in zip(whole.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name


def test_train_heads_job_trains_from_its_cache_and_resumes_to_the_same_heads(tiny_model_dirs, tmp_path):
    """The job end to end on the tiny model: draft vocabulary, teacher cache (built once, reused by the
    resumed run), a run stopped by --max-minutes and resumed with --resume ends with the bytes of an
    uninterrupted one; the draft vocabulary and the model card are saved beside the heads."""
    import json

    from entmtp_ray.jobs import train_heads
    from entmtp_ray.model.heads import DRAFT_VOCAB_FILE, WEIGHTS_FILE, load_draft_vocab

    common = ["--model", str(tiny_model_dirs[0]), "--dtype", "fp32", "--sharegpt", "6", "--heldout", "2",
              "--max-len", "96", "--batch-tokens", "192", "--draft-vocab", "64", "--teacher-top-k", "8",
              "--warmup-steps", "1", "--steps", "4", "--dropout", "0.1", "--threads", "1", "--cache",
              str(tmp_path / "cache")]
    assert train_heads.main(common + ["--out", str(tmp_path / "whole")]) == 0
    shards = sorted((tmp_path / "cache").glob("*/shard-*.safetensors"))
    assert shards
    built = [s.stat().st_mtime_ns for s in shards]
    assert train_heads.main(common + ["--out", str(tmp_path / "split"), "--max-minutes", "1e-9"]) == 0
    assert json.loads((tmp_path / "split" / "model_card.json").read_text())["steps"] == 1
    assert train_heads.main(common + ["--out", str(tmp_path / "split"), "--resume"]) == 0
    assert [s.stat().st_mtime_ns for s in shards] == built  # both later runs read the cache, none rebuilt it
    for name in (WEIGHTS_FILE, DRAFT_VOCAB_FILE):
        assert (tmp_path / "whole" / name).read_bytes() == (tmp_path / "split" / name).read_bytes(), name
    card = json.loads((tmp_path / "split" / "model_card.json").read_text())
    assert card["steps"] == 4 and card["config"]["draft_vocab"] == 64 and card["teacher_cache"]["targets"] > 0
    assert card["teacher_cache"]["build_seconds"] >= 0  # timed by the first run, which built the cache
    assert len(load_draft_vocab(tmp_path / "split", None)) == 64


def test_bench_train_times_every_lever_and_reports_the_teacher_mass_each_k_keeps(tiny_model_dirs, capsys):
    import json

    import bench_train  # tools/

    assert bench_train.main(["--model", str(tiny_model_dirs[0]), "--dtype", "fp32", "--sharegpt", "6", "--steps", "1",
                             "--repeats", "1", "--draft-vocab", "32", "--top-k", "8", "--max-len", "96",
                             "--batch-tokens", "128", "--threads", "1"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(report["seconds_per_step"]) == set(bench_train.modes(32, 8))
    assert all(v > 0 for v in report["seconds_per_step"].values())
    mass = report["teacher_mass"]
    kept = [mass["top_k"][str(k)] for k in bench_train.TOP_KS if k <= 32]
    assert kept == sorted(kept) and 0 < kept[-1] <= mass["draft_vocab"] + 1e-4 <= 1 + 1e-4


def test_draft_vocab_job_ranks_the_training_targets(tiny_model_dirs, tiny, tmp_path):
    import shutil

    from entmtp_ray.jobs import draft_vocab
    from entmtp_ray.model.heads import load_draft_vocab

    heads = tmp_path / "heads"
    shutil.copytree(tiny_model_dirs[1], heads)
    assert draft_vocab.main(["--model", str(tiny_model_dirs[0]), "--heads", str(heads), "--sharegpt", "5",
                             "--max-len", "96", "--default-size", "16"]) == 0
    sequences = [s for s in (chat_sequence(tiny, c, 96) for c in training.sharegpt_conversations(5)) if s is not None]
    assert load_draft_vocab(heads, None) == [t for t, _ in training.rank_targets(sequences)[:16]]
    assert training.coverage(training.rank_targets(sequences), (16,))[16] > 0


def test_train_heads_job_fine_tunes_from_init_heads_and_counts_their_tokens(tiny_model_dirs, tmp_path):
    """--init-heads starts from trained heads, not fresh ones: a step at a negligible learning rate leaves
    their weights where they were, and the model card adds the tokens they had seen to this run's. A wrong
    folder fails before the teacher cache is built."""
    import json

    from entmtp_ray.jobs import train_heads

    common = ["--model", str(tiny_model_dirs[0]), "--dtype", "fp32", "--sharegpt", "6", "--heldout", "2",
              "--max-len", "96", "--batch-tokens", "192", "--draft-vocab", "64", "--teacher-top-k", "8",
              "--warmup-steps", "1", "--dropout", "0.1", "--threads", "1", "--cache", str(tmp_path / "cache"),
              "--num-heads", "2", "--num-layers", "1"]
    with pytest.raises(FileNotFoundError, match="no heads in"):  # before any data or cache work
        train_heads.main(common + ["--cache", str(tmp_path / "early"), "--out", str(tmp_path / "bad"),
                                   "--init-heads", str(tmp_path / "missing")])
    assert not (tmp_path / "early").exists()
    assert train_heads.main(common + ["--out", str(tmp_path / "first"), "--steps", "3"]) == 0
    assert train_heads.main(common + ["--out", str(tmp_path / "tuned"), "--steps", "1", "--lr", "1e-12",
                                      "--init-heads", str(tmp_path / "first")]) == 0
    base = load_model(str(tiny_model_dirs[0]), dtype="fp32", device="cpu").model
    a, b = load_heads(tmp_path / "first", base), load_heads(tmp_path / "tuned", base)
    fresh = init_heads(base, num_heads=2, num_layers=1, seed=0).state_dict()
    moved = [n for n, p in a.state_dict().items() if not torch.equal(p, fresh[n])]
    assert moved  # the first run trained its heads away from a fresh start
    for name, p in a.state_dict().items():
        torch.testing.assert_close(b.state_dict()[name], p, rtol=0, atol=1e-6, msg=name)
    cards = {d: json.loads((tmp_path / d / "model_card.json").read_text()) for d in ("first", "tuned")}
    start = cards["tuned"]["init_heads"]
    assert start["path"] == str(tmp_path / "first") and len(start["weights_sha256"]) == 64
    # the prompts that trained them, beside the heads, for a bank to leave out: the first 6 tune conversations
    # (both runs read the same), and the tuned heads carry their init heads' too
    from entmtp_ray.train.trainer import sharegpt_records

    seen = {d: json.loads((tmp_path / d / "seen_prompts.json").read_text()) for d in ("first", "tuned")}
    assert seen["first"]["sharegpt"] == sorted(i for i, _ in sharegpt_records(6)) == seen["tuned"]["sharegpt"]
    assert "--init-heads" in seen["tuned"]["source"] and "--init-heads" not in seen["first"]["source"]
    assert start["target_tokens_seen_in_total"] == cards["first"]["target_tokens_seen"] > 0
    assert (cards["tuned"]["target_tokens_seen_in_total"]
            == cards["first"]["target_tokens_seen"] + cards["tuned"]["target_tokens_seen"])
