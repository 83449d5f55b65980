"""Rank the tokens of the heads' training text by frequency and save the ranking beside the heads.

    python jobs/draft_vocab.py --heads heads/smollm2-135m-instruct --sharegpt 2500 \
        --self-distill runs/distill/gsm8k runs/distill/humaneval runs/distill/sharegpt --default-size 8192

Drafting then projects onto the --draft-vocab K most frequent tokens only (default: --default-size),
a V/K cheaper vocabulary projection per draft depth. Counts are over assistant (target) tokens, the
text the heads learn to draft. Pass the same data the heads were trained on (their model card says).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


from entmtp_ray.model.heads import save_draft_vocab
from entmtp_ray.config import EMBEDDED_MODEL
from entmtp_ray.model.loading import load_model
from entmtp_ray.train.trainer import (chat_sequence, coverage, generated_conversations, rank_targets,
                                      sharegpt_conversations)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=EMBEDDED_MODEL)
    p.add_argument("--heads", required=True, help="heads directory to write draft_vocab.json into")
    p.add_argument("--sharegpt", type=int, default=2000, help="ShareGPT conversations (tune subset), as in training")
    p.add_argument("--self-distill", nargs="*", default=[], help="jobs/generate.py output directories, as in training")
    p.add_argument("--max-len", type=int, default=512, help="tokens per conversation, as in training")
    p.add_argument("--default-size", type=int, default=8192, help="tokens drafting uses unless --draft-vocab says")
    args = p.parse_args(argv)
    heads = Path(args.heads)
    if not (heads / "heads_config.json").is_file():
        p.error(f"--heads {heads}: no heads_config.json there; pass a heads directory of ours")
    started = time.time()
    loaded = load_model(args.model, dtype="fp32", device="cpu")
    conversations = list(sharegpt_conversations(args.sharegpt)) + list(generated_conversations(args.self_distill))
    ranked = rank_targets(s for s in (chat_sequence(loaded, turns, args.max_len) for turns in conversations)
                          if s is not None)
    if len(ranked) < args.default_size:
        p.error(f"--default-size {args.default_size}: only {len(ranked)} distinct tokens occur in this text; "
                "pass a smaller size or more data")
    total = sum(c for _, c in ranked)
    covered = coverage(ranked)
    source = {"sharegpt_conversations": args.sharegpt, "self_distill": args.self_distill, "max_len": args.max_len,
              "conversations": len(conversations), "coverage_of_targets": covered}
    save_draft_vocab([t for t, _ in ranked], [c for _, c in ranked], heads, source, args.default_size)
    print(json.dumps({"heads": str(heads), "target_tokens": total, "distinct": len(ranked), "coverage": covered,
                      "default_size": args.default_size, "seconds": round(time.time() - started, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
