"""Command-line flags shared by the entry points, and the one-machine CLI
(`python -m entmtp_ray generate ...`, one JSON object per prompt on stdout)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import torch
from pydantic import ValidationError
from transformers.utils import logging as transformers_logging

from entmtp_ray.config import DecodingConfig, JobConfig, ModelConfig
from entmtp_ray.pipeline.engine import Engine
from entmtp_ray.model.loading import EMBEDDED_MODEL
from entmtp_ray.decode.policy import BANK_POLICIES, POLICIES
from entmtp_ray.pipeline.tasks import LINE_ERROR, read_jsonl


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", default=EMBEDDED_MODEL, help="hub id, local directory, or %(default)s")
    g.add_argument("--heads", default=None, help="heads directory; default: the ones shipped for --model; "
                   "'untrained' = random heads (exact output, little speedup)")
    g.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"])
    g.add_argument("--device", default="auto", help="cpu | cuda[:N] | auto")
    g.add_argument("--chat-format", default="auto", choices=["auto", "template", "vicuna_v1.1", "raw"])
    g.add_argument("--draft-vocab", type=int, default=None, help="draft over the K most frequent tokens of the "
                   "heads' draft_vocab.json (default: its own size; 0 = full vocabulary)")


def add_decoding_args(p: argparse.ArgumentParser, task_flag: bool = True) -> None:
    g = p.add_argument_group("decoding")
    g.add_argument("--policy", default="hydra", help=f"one of {sorted([*POLICIES, *BANK_POLICIES])}")
    g.add_argument("--tree", default=None, help="tree for --policy fixed: built-in name or JSON file of paths")
    if task_flag:
        g.add_argument("--task", default=None, help="task name (picks the topology bank of entmtp policies)")
    g.add_argument("--bank", default=None, help="bank file for the entmtp policies (default: banks/<model>/<task>.json)")
    g.add_argument("--signal", default=None, choices=["entropy", "top1", "path"],
                   help="scheduling signal of the entmtp policies (default: the bank's)")
    g.add_argument("--trace-signal", action="store_true",
                   help="record the signal before every step (step_signals) for any policy, for reports")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--acceptance", default="greedy", choices=["greedy", "typical", "exact"],
                   help="greedy (T=0), typical (Hydra's, fast, not distribution-preserving) or exact "
                   "(speculative sampling: outputs distributed as the base model's own sampling)")
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--max-input-tokens", type=int, default=1400)
    g.add_argument("--seed", type=int, default=123)


def add_job_args(p: argparse.ArgumentParser) -> None:
    add_input_args(p)
    g = p.add_argument_group("execution")
    g.add_argument("--output", required=True, help="output directory (a Parquet dataset)")
    g.add_argument("--resume", action="store_true", help="complete a partial --output without redoing rows")
    g.add_argument("--min-actors", type=int, default=1)
    g.add_argument("--max-actors", type=int, default=1)
    g.add_argument("--cpus-per-actor", type=float, default=1.0)
    g.add_argument("--gpus-per-actor", type=float, default=0.0)
    g.add_argument("--address", default=None, help="Ray cluster to join ('auto' under ray job submit)")


def add_input_args(p: argparse.ArgumentParser, split: str = "test") -> None:
    """The prompt-source flags of jobs/generate.py (the benchmark takes the same)."""
    g = p.add_argument_group("input")
    g.add_argument("--task", default=None, help="gsm8k | humaneval | sharegpt")
    g.add_argument("--dataset", default=None, help="Parquet/JSONL/CSV path or hub id (with --task: that task's "
                   "data from a local copy)")
    g.add_argument("--split", default=split)
    g.add_argument("--prompt-column", default="prompt")
    g.add_argument("--id-column", default=None, help="unique id column; absent -> stable generated ids")
    g.add_argument("--messages-column", default=None, help="column of chat turns instead of --prompt-column")
    g.add_argument("--limit", type=int, default=None, help="sample N rows, deterministic with --seed")


def job_config_from_args(args) -> JobConfig:
    return JobConfig(task=args.task, dataset=args.dataset, split=args.split, prompt_column=args.prompt_column,
                     id_column=args.id_column, messages_column=args.messages_column, limit=args.limit,
                     seed=args.seed, output=args.output, resume=args.resume, min_actors=args.min_actors,
                     max_actors=args.max_actors, cpus_per_actor=args.cpus_per_actor,
                     gpus_per_actor=args.gpus_per_actor, address=args.address)


def model_config_from_args(args) -> ModelConfig:
    return ModelConfig(model=args.model, heads=args.heads, dtype=args.dtype, device=args.device,
                       chat_format=args.chat_format, draft_vocab=args.draft_vocab)


def configs_from_args(args) -> tuple[ModelConfig, DecodingConfig]:
    model_cfg = model_config_from_args(args)
    decoding = DecodingConfig(policy=args.policy, tree=args.tree, task=args.task, bank=args.bank, signal=args.signal,
                              trace_signal=args.trace_signal, temperature=args.temperature,
                              acceptance=args.acceptance, max_new_tokens=args.max_new_tokens,
                              max_input_tokens=args.max_input_tokens, seed=args.seed)
    return model_cfg, decoding


def read_prompts(args) -> list[tuple[str, object, str | None]]:
    """(id, prompt, error) triples; a malformed line is kept, with its error, so it gets an output row."""
    if args.prompt is not None:
        return [("prompt-0", args.prompt, None)]
    rows = read_jsonl(Path(args.prompts_file))
    return [(str(row.get("id", f"line-{n}")), row.get("prompt"), row.get(LINE_ERROR))
            for n, row in enumerate(rows, start=1)]


def cmd_generate(args) -> int:
    try:
        model_cfg, decoding = configs_from_args(args)
        engine = Engine(model_cfg, decoding)
        prompts = read_prompts(args)
    except (ValueError, ValidationError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    engine.warm_up()
    for row_id, prompt, error in prompts:
        row = engine.error_row(row_id, prompt, error) if error else engine.run(row_id, prompt)
        print(json.dumps(row), flush=True)
    return 0


def cmd_eval_heads(args) -> int:
    from entmtp_ray.train.evaluation import eval_heads, format_report
    from entmtp_ray.pipeline.tasks import TASKS

    unknown = sorted(set(args.tasks) - TASKS)
    if unknown:
        print(f"error: unknown task(s) {unknown}; choose from {sorted(TASKS)}", file=sys.stderr)
        return 2
    try:
        report = eval_heads(model_config_from_args(args), args.tasks, args.limit, args.tree, args.temperatures, args.max_new_tokens,
                            args.heldout, args.seed, {"gsm8k": args.gsm8k_data})
    except (ValueError, ValidationError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(format_report(report), file=sys.stderr)
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report))
    return 0


def quiet_logging() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    transformers_logging.disable_progress_bar()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m entmtp_ray", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate for one prompt or a JSONL file of prompts")
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one user message")
    src.add_argument("--prompts-file", help='JSONL with {"id", "prompt"} per line')
    add_model_args(gen)
    add_decoding_args(gen)
    gen.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    ev = sub.add_parser("eval-heads", help="per-head top-1 on held-out text and tau per task with a tree")
    add_model_args(ev)
    ev.add_argument("--tasks", nargs="+", default=["gsm8k", "humaneval", "sharegpt"])
    ev.add_argument("--gsm8k-data", default=None, help="local copy of GSM8K's train.jsonl (default: the hub, "
                    "openai/gsm8k); only its eval subset is used")
    ev.add_argument("--limit", type=int, default=20, help="eval prompts per task")
    ev.add_argument("--tree", default="hydra", help="built-in tree name or JSON file of paths")
    ev.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7],
                    help="0 = greedy acceptance, >0 = typical acceptance")
    ev.add_argument("--max-new-tokens", type=int, default=128)
    ev.add_argument("--heldout", type=int, default=50, help="held-out ShareGPT conversations for per-head "
                    "top-1 (0 = skip)")
    ev.add_argument("--seed", type=int, default=123)
    ev.add_argument("--output", default=None, help="also write the JSON report here")
    ev.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    quiet_logging()
    if args.threads:
        torch.set_num_threads(args.threads)
    return {"generate": cmd_generate, "eval-heads": cmd_eval_heads}[args.command](args)

