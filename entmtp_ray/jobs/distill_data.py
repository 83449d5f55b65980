"""Self-distillation data for head training: the base model's own greedy replies to the `tune`
prompts of a task (never its `eval` rows), written as Parquet that jobs/train_heads.py --self-distill
reads. Resumable: rerun the same command and it continues.

    python jobs/distill_data.py --task gsm8k --dataset path/to/gsm8k/train.jsonl \\
        --limit 1200 --out runs/distill/gsm8k
"""

from __future__ import annotations

import argparse
import re
import sys
import time

import pyarrow as pa


import torch

from entmtp_ray.cli import quiet_logging
from entmtp_ray.config import EMBEDDED_MODEL
from entmtp_ray.model.loading import load_model
from entmtp_ray.pipeline.tasks import TASKS, load_prompts, sample
from entmtp_ray.train.trainer import distill


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", choices=sorted(TASKS))
    p.add_argument("--dataset", help="local file or hub id (with --task gsm8k: a GSM8K copy)")
    p.add_argument("--prompt-column", default=None, help="default 'prompt' (GSM8K: 'question')")
    p.add_argument("--split", default="train")
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--match", default=None, help="only prompts this regular expression finds (case-insensitive), "
                   "e.g. code questions for code-drafting heads; --limit then samples among those")
    p.add_argument("--seed", type=int, default=123)
    p.add_argument("--model", default=EMBEDDED_MODEL)
    p.add_argument("--dtype", default="auto", help="base model dtype for generation (bf16 is about 2x faster on CPU)")
    p.add_argument("--out", required=True)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-prompt-tokens", type=int, default=384, help="skip longer prompts (training cuts "
                   "sequences at --max-len, so their replies would go unseen)")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    quiet_logging()
    if args.threads:
        torch.set_num_threads(args.threads)
    prompts = load_prompts(args.task, args.dataset, split=args.split, prompt_column=args.prompt_column,
                           limit=None if args.match else args.limit, seed=args.seed, subset="tune")
    if args.match:
        try:
            pattern = re.compile(args.match, re.IGNORECASE)
        except re.error as e:
            p.error(f"--match {args.match!r}: not a regular expression ({e})")
        found = [bool(pattern.search(text or "")) for text in prompts.column("prompt").to_pylist()]
        prompts = sample(prompts.filter(pa.array(found)), args.limit, args.seed)
        print(f"--match: {sum(found)} of {len(found)} prompts match, {len(prompts)} kept", file=sys.stderr)
    loaded = load_model(args.model, dtype=args.dtype)
    started = time.time()
    n = distill(loaded, prompts, args.out, args.batch_size, args.max_new_tokens, args.max_prompt_tokens,
                task=args.task)
    print(f"{n} replies written to {args.out} in {time.time() - started:.0f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
