"""Every decoding policy side by side on a task's held-out prompts, one process, no Ray.

    python jobs/bench_policies.py --task gsm8k --prompts 8 --temperatures 0 0.7 --out runs/bench-gsm8k.json

For each prompt the policies run back to back in a rotating order (the machine's noise falls on all
of them alike), after one untimed warm-up each. Prompts come from the task's `eval` subset, which
neither the heads nor the bank saw. Reported per (temperature, policy): output tokens/s with the
prefill inside the timed region (pooled, and the median per-prompt ratio to AR), mean accepted
length tau, mean nodes per step, tree switches per 100 tokens, and the scheduler's share of a step
(the policy's choose/observe plus the verifier statistics its signal reads). At T=0 every policy's
tokens are compared with AR's; a difference is reported and fails the run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from entmtp_ray.banks import current_hardware, load_bank, resolve_bank_path, warn_if_other_hardware  # noqa: E402
from entmtp_ray.cli import add_model_args, model_config_from_args, quiet_logging  # noqa: E402
from entmtp_ray.config import DecodingConfig  # noqa: E402
from entmtp_ray.decoding import HydraDrafter, SpecDecoder, row_generator  # noqa: E402
from entmtp_ray.evaluation import default_dataset  # noqa: E402
from entmtp_ray.loading import available_depth, load_model, load_model_heads  # noqa: E402
from entmtp_ray.policy import make_policy  # noqa: E402
from entmtp_ray.tasks import TASKS, load_prompts  # noqa: E402

POLICIES = ("ar", "hydra", "medusa", "entmtp-star", "entmtp-ladder", "entmtp-tau")


def summarize(runs: list[dict], ar_rate: dict[str, float]) -> dict:
    """Pooled figures of one (temperature, policy) over its prompts."""
    tokens = sum(r["tokens"] for r in runs)
    seconds = sum(r["seconds"] for r in runs)
    steps = sum(r["steps"] for r in runs)
    return {
        "prompts": len(runs),
        "tokens_per_s": tokens / seconds,
        "speedup_median": statistics.median(r["tokens"] / r["seconds"] / ar_rate[r["id"]] for r in runs),
        "tau": sum(r["tokens"] - 1 for r in runs) / steps if steps else None,  # the prefill's token is no step
        "nodes_per_step": sum(r["nodes"] for r in runs) / steps if steps else None,
        "switches_per_100_tokens": 100 * sum(r["switches"] for r in runs) / tokens,
        "schedule_share": sum(r["schedule_s"] for r in runs) / sum(r["decode_s"] for r in runs),
        "schedule_us_per_step": 1e6 * sum(r["schedule_s"] for r in runs) / steps if steps else None,
        "tree_usage": _merge([r["usage"] for r in runs]),
    }


def _merge(usages: list[dict]) -> dict:
    out: dict[str, int] = {}
    for usage in usages:
        for name, n in usage.items():
            out[name] = out.get(name, 0) + n
    return out


def table(report: dict) -> str:
    lines = []
    for temperature, rows in report["results"].items():
        lines += [f"\n{report['task']}, T={temperature} ({rows['ar']['prompts']} prompts, "
                  f"{report['max_new_tokens']} new tokens)",
                  "| policy | nodes/step | tau | tokens/s | x AR | x AR (median prompt) | switches/100 tok | scheduler |",
                  "|---|---|---|---|---|---|---|---|"]
        ar = rows["ar"]["tokens_per_s"]
        for name, r in rows.items():
            lines.append(f"| {name} | {r['nodes_per_step']:.1f} | {r['tau']:.3f} | {r['tokens_per_s']:.2f} | "
                         f"{r['tokens_per_s'] / ar:.3f} | {r['speedup_median']:.3f} | "
                         f"{r['switches_per_100_tokens']:.1f} | {100 * r['schedule_share']:.2f}% "
                         f"({r['schedule_us_per_step']:.0f} us) |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", required=True, choices=sorted(TASKS))
    p.add_argument("--dataset", default=None, help="local copy of the task's data (default: ../shared/data for GSM8K)")
    p.add_argument("--split", default="train", help="GSM8K split whose eval subset is used (banks tune on train)")
    p.add_argument("--bank", default=None, help="bank file (default: banks/<model>/<task>.json)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--seed", type=int, default=123)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    p.add_argument("--threads", type=int, default=1, help="torch threads (match the bank's)")
    p.add_argument("--out", default=None, help="write the JSON report here")
    add_model_args(p)
    args = p.parse_args(argv)
    quiet_logging()
    torch.set_num_threads(args.threads)
    if "ar" not in args.policies:
        args.policies.insert(0, "ar")

    model_cfg = model_config_from_args(args)
    bank_path = resolve_bank_path(model_cfg.model, args.task, args.bank)
    bank = load_bank(bank_path, available_depth(model_cfg.model, model_cfg.heads), Path(model_cfg.model).name)
    loaded = load_model(model_cfg.model, model_cfg.dtype, model_cfg.device, model_cfg.chat_format)
    warn_if_other_hardware(bank, current_hardware(loaded.device, loaded.dtype), bank_path)
    drafter = HydraDrafter(load_model_heads(loaded, model_cfg.heads), loaded.model)
    decoders = {name: SpecDecoder(loaded, drafter, make_policy(DecodingConfig(policy=name, task=args.task), bank))
                for name in args.policies}

    dataset = args.dataset or default_dataset(args.task)
    prompts = load_prompts(args.task, dataset, split=args.split, limit=args.prompts, seed=args.seed, subset="eval")
    limit = DecodingConfig().max_input_tokens
    encoded = [(row["id"], loaded.encode_prompt(row["prompt"])) for row in prompts.to_pylist()]
    skipped = [row_id for row_id, ids in encoded if len(ids) > limit]
    encoded = [(row_id, ids) for row_id, ids in encoded if len(ids) <= limit]

    report = {"task": args.task, "bank": str(bank_path), "max_new_tokens": args.max_new_tokens,
              "threads": args.threads, "hardware": current_hardware(loaded.device, loaded.dtype).model_dump(),
              "skipped_over_input_limit": skipped, "mismatches": [], "results": {}}
    for temperature in args.temperatures:
        cfg = DecodingConfig(max_new_tokens=args.max_new_tokens, temperature=temperature, seed=args.seed,
                             acceptance="typical" if temperature > 0 else "greedy")
        warm = cfg.model_copy(update={"max_new_tokens": 16})
        for decoder in decoders.values():
            decoder.generate(encoded[0][1], warm, row_generator(0, "warmup", loaded.device))
        runs: dict[str, list[dict]] = {name: [] for name in args.policies}
        for k, (row_id, ids) in enumerate(encoded):
            order = args.policies[k % len(args.policies):] + args.policies[: k % len(args.policies)]
            outputs = {}
            for name in order:
                result = decoders[name].generate(ids, cfg, row_generator(cfg.seed, row_id, loaded.device))
                outputs[name] = result.output_token_ids
                runs[name].append({"id": row_id, "tokens": result.num_output_tokens, "seconds": result.total_s,
                                   "decode_s": result.decode_s, "schedule_s": result.schedule_s,
                                   "steps": len(result.steps), "nodes": sum(s.nodes for s in result.steps),
                                   "switches": result.tree_switches(), "usage": result.tree_usage()})
            if temperature == 0:
                report["mismatches"] += [{"id": row_id, "policy": n} for n, out in outputs.items()
                                         if out != outputs["ar"]]
            print(f"T={temperature} prompt {k + 1}/{len(encoded)} done", file=sys.stderr)
        ar_rate = {r["id"]: r["tokens"] / r["seconds"] for r in runs["ar"]}
        report["results"][str(temperature)] = {name: summarize(runs[name], ar_rate) for name in args.policies}
    print(table(report))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    if report["mismatches"]:
        print(f"greedy output differs from AR: {report['mismatches']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
