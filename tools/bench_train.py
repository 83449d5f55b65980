"""What a head-training step costs under each lever, side by side in one run.

    python tools/bench_train.py --sharegpt 96 --steps 4 --repeats 3 --threads 2

Modes, each timed on the same batches from the same initial heads, interleaved round by round (the
median of the rounds is reported): the full vocabulary with the base model run every step (the recipe
before the draft vocabulary and the cache), then the draft vocabulary, the teacher's top-k, the teacher
cache, each adding to the one before; then bf16 autocast off, and batches four times larger
(timed per --batch-tokens padded tokens, so every mode is comparable). Also reports how much of the teacher's
probability mass the draft vocabulary and its top k keep, which is what chooses k. The last stdout
line is a JSON report.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time

import torch

from entmtp_ray.cli import quiet_logging
from entmtp_ray.config import EMBEDDED_MODEL
from entmtp_ray.model.heads import init_heads
from entmtp_ray.model.loading import draft_vocab_for, load_model, machine_name
from entmtp_ray.train.cache import TeacherCache
from entmtp_ray.train.trainer import (TrainConfig, batches, chat_sequence, new_optimizer, pad, rank_targets,
                                      run_teacher, sharegpt_conversations, train_step)

TOP_KS = (1, 4, 8, 16, 32, 64, 128, 256)


def modes(draft_vocab: int, top_k: int) -> dict[str, dict]:
    """name -> (draft vocabulary size, teacher top-k, cached, bf16): each lever on top of the previous."""
    return {
        "full vocab, base every step": dict(vocab=0, top_k=0, cached=False, bf16=True),
        f"draft vocab {draft_vocab}": dict(vocab=draft_vocab, top_k=0, cached=False, bf16=True),
        f"+ teacher top-{top_k}": dict(vocab=draft_vocab, top_k=top_k, cached=False, bf16=True),
        "+ teacher cache": dict(vocab=draft_vocab, top_k=top_k, cached=True, bf16=True),
        "cache, fp32 (no autocast)": dict(vocab=draft_vocab, top_k=top_k, cached=True, bf16=False),
        "cache, batches x4": dict(vocab=draft_vocab, top_k=top_k, cached=True, bf16=True, batch_scale=4),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=EMBEDDED_MODEL)
    p.add_argument("--dtype", default="bf16", help="the frozen base model's dtype (training runs it in bf16)")
    p.add_argument("--sharegpt", type=int, default=96, help="ShareGPT conversations (tune subset) to draw batches from")
    p.add_argument("--steps", type=int, default=4, help="timed steps per mode per round")
    p.add_argument("--repeats", type=int, default=3, help="rounds (the median is reported)")
    p.add_argument("--batch-tokens", type=int, default=1024)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--draft-vocab", type=int, default=8192)
    p.add_argument("--top-k", type=int, default=32)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    quiet_logging()
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(args.model, dtype=args.dtype)
    model, pad_id = loaded.model, loaded.tokenizer.pad_token_id or 0
    sequences = [s for s in (chat_sequence(loaded, c, args.max_len) for c in sharegpt_conversations(args.sharegpt))
                 if s is not None]
    try:  # the ranking shipped beside the model's heads (from all their training text), else this sample's
        ids = draft_vocab_for(args.model, None, args.draft_vocab)
    except (FileNotFoundError, ValueError):
        ids = None
    if ids is None:
        ids = [t for t, _ in rank_targets(sequences)[: args.draft_vocab]]
        if len(ids) < args.draft_vocab:
            p.error(f"--draft-vocab {args.draft_vocab}: only {len(ids)} distinct targets in {len(sequences)} "
                    "conversations and no draft_vocab.json beside the model's heads; pass more --sharegpt or a "
                    "smaller --draft-vocab")
    vocabularies = {0: None, args.draft_vocab: torch.tensor(ids)}
    lengths = [len(s.token_ids) for s in sequences]
    timed, inputs = {}, {}
    for scale in (1, 4):
        timed[scale] = batches(lengths, scale * args.batch_tokens, seed=0, epoch=0)[: args.steps]
        inputs[scale] = [pad([sequences[k] for k in b], pad_id, loaded.device) for b in timed[scale]]
    mass = teacher_mass(model, inputs[1], vocabularies[args.draft_vocab])
    with tempfile.TemporaryDirectory() as tmp:
        cache = TeacherCache.build(tmp, args.model, model, sequences, pad_id, vocabularies[args.draft_vocab],
                                   args.top_k, True, progress=False)
        seconds: dict[str, list[float]] = {name: [] for name in modes(args.draft_vocab, args.top_k)}
        for _ in range(args.repeats):
            for name, mode in modes(args.draft_vocab, args.top_k).items():
                scale = mode.get("batch_scale", 1)
                per_step = time_steps(loaded, mode, vocabularies[mode["vocab"]], timed[scale], inputs[scale], cache)
                padded = statistics.mean(int(t.numel()) for t, _ in inputs[scale])
                seconds[name].append(per_step * args.batch_tokens / padded)
    base = statistics.median(seconds["full vocab, base every step"])
    report = {
        "model": args.model, "dtype": args.dtype, "threads": torch.get_num_threads(), "cpu": machine_name(),
        "device": str(loaded.device), "batch_tokens": args.batch_tokens, "steps": args.steps, "repeats": args.repeats,
        "padded_tokens_per_step": statistics.mean(int(t.numel()) for t, _ in inputs[1]),
        "target_tokens_per_step": statistics.mean(int(m.sum()) for _, m in inputs[1]),
        # seconds per --batch-tokens padded tokens (a step's worth, whatever the mode's batches)
        "seconds_per_step": {name: round(statistics.median(v), 3) for name, v in seconds.items()},
        "speedup_vs_before": {name: round(base / statistics.median(v), 2) for name, v in seconds.items()},
        "teacher_mass": mass,
        "cache_bytes_per_token": round(cache.stats["bytes"] / cache.stats["tokens"], 1),
    }
    print(f"{'mode':<30} {'s/step':>7} {'x before':>8}   (s per {args.batch_tokens} padded tokens)", file=sys.stderr)
    for name in seconds:
        print(f"{name:<30} {report['seconds_per_step'][name]:>7.3f} {report['speedup_vs_before'][name]:>8.2f}",
              file=sys.stderr)
    print(json.dumps(report))
    return 0


@torch.no_grad()
def teacher_mass(model, inputs, vocab: torch.Tensor) -> dict:
    """Mean share of the base distribution kept by the draft vocabulary, and by its top k for each k."""
    kept, per_k = [], {k: [] for k in TOP_KS if k <= len(vocab)}
    for tokens, mask in inputs:
        teacher = run_teacher(model, tokens, mask, vocab, 0, True)
        restricted = teacher.probs * teacher.kept_mass[:, None]  # back to shares of the whole distribution
        kept.append(teacher.kept_mass)
        ranked = restricted.sort(-1, descending=True).values.cumsum(-1)
        for k in per_k:
            per_k[k].append(ranked[:, k - 1])
    return {"draft_vocab": round(float(torch.cat(kept).mean()), 4),
            "top_k": {k: round(float(torch.cat(v).mean()), 4) for k, v in per_k.items()}}


def time_steps(loaded, mode: dict, vocab, timed, inputs, cache) -> float:
    """Seconds per step of `mode` over the timed batches, from the same fresh heads each time."""
    cfg = TrainConfig(lr=1e-3, warmup_steps=0, steps=len(timed), dropout=0.0, bf16=mode["bf16"],
                      draft_vocab=mode["vocab"], teacher_top_k=mode["top_k"])
    heads = init_heads(loaded.model, seed=0).to(loaded.device)
    heads.train()
    optimizer, scheduler = new_optimizer(heads, cfg)
    started = time.perf_counter()
    for batch, (tokens, mask) in zip(timed, inputs):
        teacher = (cache.teacher(batch, mask) if mode["cached"]
                   else run_teacher(loaded.model, tokens, mask, vocab, mode["top_k"], mode["bf16"]))
        train_step(heads, loaded.model, tokens, mask, teacher, vocab, cfg, optimizer, scheduler)
    return (time.perf_counter() - started) / len(timed)


if __name__ == "__main__":
    sys.exit(main())
