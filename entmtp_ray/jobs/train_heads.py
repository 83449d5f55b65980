"""Train Hydra++ heads for a base model (base frozen, soft cross-entropy against its own
next-token distribution, assistant tokens only). CPU or GPU; checkpoints and --resume.

    python jobs/train_heads.py --out heads/smollm2-135m-instruct --sharegpt 4000 \\
        --self-distill runs/distill-gsm8k runs/distill-sharegpt --max-minutes 80

--self-distill takes output directories of jobs/generate.py (the base model's own replies to
training prompts). The last stdout line is a JSON summary; a model card is written beside the heads.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path


import torch

from entmtp_ray.cli import add_config_args, config_from_args, quiet_logging
from entmtp_ray.model.heads import SEEN_PROMPTS_FILE, init_heads, load_heads, save_draft_vocab, weights_file
from entmtp_ray.config import ModelConfig
from entmtp_ray.model.loading import load_model, machine_name
from entmtp_ray.pipeline.manifest import content_hash
from entmtp_ray.train.cache import TeacherCache
from entmtp_ray.train.trainer import (TrainConfig, chat_sequence, coverage, distilled_ids, evaluate,
                                      generated_conversations, rank_targets, sharegpt_conversations, sharegpt_records,
                                      train)


def write_seen_prompts(out: Path, *found: dict[str, set[str]] | str | None) -> None:
    """SEEN_PROMPTS_FILE beside the heads: the prompt ids, by task, that trained them (this run's ShareGPT
    conversations and self-distillation prompts, and with --init-heads, theirs), which jobs/build_bank.py leaves out
    of a bank's calibration. A str: a heads folder whose own list is added."""
    seen: dict[str, set[str]] = {}
    for part in found:
        if isinstance(part, str):
            listed = Path(part) / SEEN_PROMPTS_FILE
            part = {k: set(v) for k, v in json.loads(listed.read_text()).items() if isinstance(v, list)} \
                if listed.is_file() else {}
        for task, ids in (part or {}).items():
            seen.setdefault(task, set()).update(ids)
    out.mkdir(parents=True, exist_ok=True)
    (out / SEEN_PROMPTS_FILE).write_text(json.dumps(
        {"source": "jobs/train_heads.py: the prompts of its ShareGPT conversations and self-distillation folders"
                   + (" and of its --init-heads" if any(isinstance(p, str) for p in found) else ""),
         **{task: sorted(ids) for task, ids in sorted(seen.items()) if ids}}, indent=0) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # the frozen base model in bf16 by default: the teacher and hidden states at half the cost on CPU (heads
    # train in fp32 under --bf16 autocast)
    add_config_args(p, ModelConfig, only=("model", "dtype"), defaults={"dtype": "bf16"})
    p.add_argument("--out", required=True, help="directory for the heads, checkpoints and model card")
    p.add_argument("--sharegpt", type=int, default=2000, help="ShareGPT conversations to train on")
    p.add_argument("--self-distill", nargs="*", default=[], help="jobs/generate.py output directories")
    p.add_argument("--distill-repeat", type=int, default=1, help="times each self-distillation reply is in the "
                   "data (weighs the tasks' own text against ShareGPT)")
    p.add_argument("--save-dtype", default="bf16", choices=["fp32", "bf16", "fp16"],
                   help="dtype of the saved heads (bf16 halves the file; loading casts back)")
    p.add_argument("--heldout", type=int, default=100, help="held-out ShareGPT conversations (eval subset) for the per-head accuracy")
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--own-lm-heads", action="store_true", help="one vocab projection per head (large) instead "
                   "of sharing the base lm_head")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--resume", action="store_true", help="continue from --out's checkpoint, bit for bit (same "
                   "options; a larger --steps extends the schedule)")
    p.add_argument("--cache", default=None, help="teacher cache directory (default: OUT/teacher-cache): the base "
                   "model's hidden states and top-k distributions, computed once and reused by every pass and run")
    p.add_argument("--no-cache", action="store_true", help="run the frozen base model on every step instead")
    p.add_argument("--init-heads", default=None, help="start from these heads instead of fresh ones (this "
                   "project's format or a published Hydra checkpoint): fine-tune shipped heads on new data; "
                   "their architecture replaces --num-heads, --num-layers and --own-lm-heads")
    add_config_args(p, TrainConfig)
    args = p.parse_args(argv)
    quiet_logging()
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = config_from_args(TrainConfig, args)
    if args.no_cache and args.cache:
        p.error("--cache and --no-cache: pass one (--no-cache runs the base model every step and reads no cache)")
    started = time.time()

    loaded = load_model(args.model, dtype=args.dtype)
    # before any data or cache work, so a wrong --init-heads fails at once; with --resume, train() loads the
    # checkpoint over these
    if args.init_heads:
        heads, start = load_heads(args.init_heads, loaded.model), starting_point(Path(args.init_heads))
    else:
        heads, start = init_heads(loaded.model, args.num_heads, args.num_layers, shared_lm_head=not args.own_lm_heads,
                                  seed=cfg.seed, base_name=args.model), None
    sharegpt = list(sharegpt_records(args.sharegpt))
    conversations = [turns for _, turns in sharegpt] + args.distill_repeat * list(
        generated_conversations(args.self_distill))
    random.Random(cfg.seed).shuffle(conversations)
    training = [s for s in (chat_sequence(loaded, c, cfg.max_len) for c in conversations) if s is not None]
    # held-out text: ShareGPT conversations of the eval subset, which no training or calibration sees
    heldout = [s for s in (chat_sequence(loaded, c, cfg.max_len) for c in sharegpt_conversations(args.heldout, "eval"))
               if s is not None]
    print(f"{len(training)} training sequences ({sum(sum(s.target_mask) for s in training)} target tokens), "
          f"{len(heldout)} held out; {time.time() - started:.0f}s to prepare", file=sys.stderr)

    ranked = rank_targets(training)
    if cfg.draft_vocab > len(ranked):
        p.error(f"--draft-vocab {cfg.draft_vocab}: only {len(ranked)} distinct target tokens in this data; "
                "pass a smaller size, or 0 for the full vocabulary")
    vocab = torch.tensor([t for t, _ in ranked[: cfg.draft_vocab]]) if cfg.draft_vocab else None
    total = sum(c for _, c in ranked)
    covered = coverage(ranked)
    vocab_source = {"sharegpt_conversations": args.sharegpt, "self_distill": args.self_distill,
                    "max_len": cfg.max_len, "conversations": len(conversations), "coverage_of_targets": covered}

    def write_draft_vocab(directory: Path) -> None:  # the ranking beside every saved set of heads
        save_draft_vocab([t for t, _ in ranked], [c for _, c in ranked], directory, vocab_source,
                         cfg.draft_vocab or min(8192, len(ranked)))

    out = Path(args.out)
    write_seen_prompts(out, {"sharegpt": {i for i, _ in sharegpt}}, distilled_ids(args.self_distill),
                       args.init_heads)
    pad_id = loaded.tokenizer.pad_token_id or 0
    cache = None
    if not args.no_cache:
        cache = TeacherCache.build(args.cache or out / "teacher-cache", args.model, loaded.model, training, pad_id,
                                   vocab, cfg.teacher_top_k, cfg.bf16)
        print(f"teacher cache: {json.dumps(cache.stats)}", file=sys.stderr)
    heads.to(loaded.device)
    state = train(heads, loaded.model, training, cfg, out, pad_id, resume=args.resume,
                  save_dtype={"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.save_dtype],
                  vocab=vocab, cache=cache, on_save=write_draft_vocab)
    scores = evaluate(heads, loaded.model, heldout, cfg.batch_tokens, pad_id, vocab)
    card = {
        "base_model": args.model,
        "data": {"sharegpt_conversations": args.sharegpt, "self_distill": args.self_distill,
                 "distill_repeat": args.distill_repeat,
                 "training_sequences": len(training), "heldout_sequences": len(heldout),
                 "target_tokens": total, "draft_vocab_coverage_of_targets": covered},
        "teacher_cache": cache.stats if cache is not None else None,
        "init_heads": start,
        "target_tokens_seen": state["tokens"],
        # with --init-heads: these heads' whole training, theirs and this run's
        "target_tokens_seen_in_total": state["tokens"] + (start or {}).get("target_tokens_seen_in_total", 0),
        "steps": state["step"],
        "train_seconds": state["seconds"],
        "base_dtype": args.dtype,
        "hardware": {"device": str(loaded.device), "threads": torch.get_num_threads(),
                     "cpu": machine_name()},
        "config": cfg.model_dump(),
        "heldout_top1_per_head": scores["top1"],  # the heads' argmax over the draft vocabulary, as drafting
        "heldout_loss_per_head": scores["loss"],
    }
    (out / "model_card.json").write_text(json.dumps(card, indent=2) + "\n")
    print(json.dumps(card))
    return 0


def starting_point(directory: Path) -> dict:
    """What --init-heads started from, for the model card: the folder, its weights' sha256, and the tokens its
    own model card says it was trained on (0 when it has none, e.g. a published checkpoint)."""
    card_file = directory / "model_card.json"
    card = json.loads(card_file.read_text()) if card_file.is_file() else {}
    return {"path": str(directory), "weights_sha256": content_hash(weights_file(directory)),
            "target_tokens_seen_in_total": card.get("target_tokens_seen_in_total", card.get("target_tokens_seen", 0))}


if __name__ == "__main__":
    sys.exit(main())
