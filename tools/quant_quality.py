"""What --quantize costs in quality: the base model's NLL on held-out text under each scheme.

The text is each task's eval prompts (no bank or head saw them) answered by the unquantized model's greedy AR
decoding: what a labelling job would write. Each scheme scores those same tokens teacher-forced through its own
products; the report gives nats per token, the change from the unquantized model, and how often the scheme's
argmax is the unquantized model's token. The heads' tau under a scheme is `python -m entmtp_ray eval-heads --quantize S`.

    python tools/quant_quality.py --tasks gsm8k humaneval sharegpt --limit 16 --output runs/quant/quality.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from entmtp_ray.bench.compare import continuation_logits
from entmtp_ray.cli import quiet_logging
from entmtp_ray.config import EMBEDDED_MODEL, DecodingConfig
from entmtp_ray.decode.loop import SpecDecoder
from entmtp_ray.decode.policy import FixedTree
from entmtp_ray.decode.tree import load_topology
from entmtp_ray.model.kernels import quantize_model
from entmtp_ray.model.loading import load_model
from entmtp_ray.model.quant import SCHEMES
from entmtp_ray.pipeline.tasks import TASKS, load_prompts


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=EMBEDDED_MODEL)
    p.add_argument("--dtype", default="bf16", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--device", default="auto")
    p.add_argument("--tasks", nargs="+", default=["gsm8k", "humaneval", "sharegpt"], choices=sorted(TASKS))
    p.add_argument("--limit", type=int, default=16, help="eval prompts per task")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=list(SCHEMES))
    p.add_argument("--gsm8k-data", default=None, help="local copy of GSM8K (default: the hub)")
    p.add_argument("--seed", type=int, default=123)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--output", default=None, help="JSON report to write")
    return p.parse_args(argv)


@torch.inference_mode()
def scheme_scores(loaded, texts: list[tuple[list[int], list[int]]]) -> dict:
    """Token-weighted mean NLL (nats) of every output after its prompt, and the share of tokens that are the
    model's argmax, under the model's current quantization."""
    nll, agree, tokens = 0.0, 0, 0
    for ids, output in texts:
        logits = continuation_logits(loaded, ids, output).float()
        target = torch.tensor(output, device=logits.device)
        nll += float(torch.nn.functional.cross_entropy(logits, target, reduction="sum"))
        agree += int((logits.argmax(-1) == target).sum())
        tokens += len(output)
    return {"nll": nll / tokens, "argmax_agrees": agree / tokens, "tokens": tokens}


def main(argv=None) -> int:
    args = parse(argv)
    quiet_logging()
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.time()
    loaded = load_model(args.model, args.dtype, args.device)
    decoder = SpecDecoder(loaded, None, FixedTree("ar", load_topology("ar")))
    cfg = DecodingConfig(policy="ar", max_new_tokens=args.max_new_tokens)
    report = {"model": args.model, "dtype": str(loaded.dtype).removeprefix("torch."), "limit": args.limit,
              "max_new_tokens": args.max_new_tokens, "text": "eval prompts' greedy AR outputs, unquantized",
              "rows": []}
    for task in args.tasks:
        dataset = args.gsm8k_data if task == "gsm8k" else None
        table = load_prompts(task, dataset, split="train" if dataset else "test", limit=args.limit, seed=args.seed,
                             subset="eval")
        quantize_model(loaded.model, "none")
        texts = []
        for prompt in table.column("prompt").to_pylist():
            ids = loaded.encode_prompt(prompt)
            output = decoder.generate(ids, cfg).output_token_ids
            if output:
                texts.append((ids, output))
        baseline = None
        for scheme in args.schemes:
            quantize_model(loaded.model, scheme)
            loaded.quantize = scheme
            scores = scheme_scores(loaded, texts)
            baseline = scores["nll"] if scheme == "none" else baseline
            report["rows"].append({"task": task, "scheme": scheme, "prompts": len(texts), **scores,
                                   "nll_change": None if baseline is None else scores["nll"] - baseline})
            print(json.dumps(report["rows"][-1]), file=sys.stderr, flush=True)
    quantize_model(loaded.model, "none")
    loaded.quantize = "none"
    report["seconds"] = round(time.time() - started, 1)
    print(markdown(report))
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(report, indent=1) + "\n")
    return 0


def markdown(report: dict) -> str:
    lines = ["| task | scheme | tokens | NLL (nats/token) | change vs none | argmax = unquantized token |",
             "|---|---|---:|---:|---:|---:|"]
    for r in report["rows"]:
        change = "" if r["nll_change"] is None or r["scheme"] == "none" else f"{r['nll_change']:+.4f}"
        lines.append(f"| {r['task']} | {r['scheme']} | {r['tokens']} | {r['nll']:.4f} | {change} | "
                     f"{r['argmax_agrees']:.3f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
