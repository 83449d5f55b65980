"""How well each scheduling signal predicts the next step's accepted length, on held-out prompts.

    python jobs/signal_power.py --task gsm8k --dataset path/to/gsm8k/train.jsonl --prompts 24 --work runs/power-gsm8k
    python jobs/signal_power.py --task sharegpt --tree entmtp_ray/assets/banks/smollm2-135m-instruct/sharegpt.json

Greedy rollouts of the task's `eval` prompts (which no bank or head saw), each measured once (the rank table and
the verifier's statistics along it, as a bank's calibration does), then every signal replayed under one fixed
tree (calibrate/predict.py): Hydra's by default, or a bank's star (--tree BANK.json). Prints a Markdown table:
each signal's Pearson correlation with the accepted length of the step it preceded, and the mean accepted
length per fifth of its values, most confident fifth first. Rollouts are cached under --work (per model and heads).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import torch

from entmtp_ray.calibrate.bank import load_bank
from entmtp_ray.pipeline.calibration import MAX_RANKS, measurement_key
from entmtp_ray.calibrate.predict import power_table, signal_power
from entmtp_ray.calibrate.rollouts import Rollout, measure_rollout
from entmtp_ray.cli import add_config_args, config_from_args, quiet_logging
from entmtp_ray.config import DecodingConfig, ModelConfig
from entmtp_ray.decode.tree import load_topology
from entmtp_ray.pipeline.assemble import resolve
from entmtp_ray.pipeline.engine import Engine
from entmtp_ray.pipeline.tasks import TASKS, load_prompts


def rollouts(engine: Engine, prompts: list[tuple[str, str]], cache: Path) -> list[Rollout]:
    """Each prompt's greedy rollout, measured; cached in `cache` (JSON lines, one per prompt id). A prompt the
    engine refuses (over --max-input-tokens) is left out, with a line on stderr."""
    done = {}
    if cache.is_file():
        for line in cache.read_text().splitlines():
            row = json.loads(line)
            row_id = row.pop("id")
            done[row_id] = Rollout(**row)
    with cache.open("a") as out:
        for row_id, prompt in prompts:
            if row_id in done:
                continue
            try:
                ids = engine.encode(prompt)
            except ValueError as exc:
                print(f"  {row_id}: left out ({exc})", file=sys.stderr)
                continue
            result = engine.generate(row_id, prompt)
            with torch.inference_mode():
                done[row_id] = measure_rollout(engine.decoder, ids + result.output_token_ids, len(ids), MAX_RANKS)
            out.write(json.dumps({"id": row_id, **done[row_id].__dict__}) + "\n")
            out.flush()
            print(f"  {row_id}: {result.num_output_tokens} tokens", file=sys.stderr)
    return [done[row_id] for row_id, _ in prompts if row_id in done]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", required=True, choices=sorted(TASKS))
    p.add_argument("--dataset", default=None, help="local copy of the task's data (GSM8K)")
    p.add_argument("--split", default="train")
    p.add_argument("--prompts", type=int, default=24, help="held-out prompts")
    p.add_argument("--seed", type=int, default=123)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--tree", default="hydra", help="the fixed tree replayed: a tree name or file, or a bank file "
                   "(its star)")
    p.add_argument("--beta", type=float, default=0.9, help="the signals' EMA factor (the banks' default)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--work", default=None, help="folder for the cached rollouts (default: runs/power-<task>)")
    p.add_argument("--output", default=None, help="also write the figures as JSON here")
    add_config_args(p, ModelConfig)
    args = p.parse_args(argv)
    quiet_logging()
    torch.set_num_threads(args.threads)
    model_cfg = config_from_args(ModelConfig, args)
    try:
        table = load_prompts(args.task, args.dataset, split=args.split, limit=args.prompts, seed=args.seed,
                             subset="eval")
        drafting = DecodingConfig(policy="hydra", max_new_tokens=args.max_new_tokens)
        engine = Engine(model_cfg, resolve(model_cfg, drafting))
        if args.tree.endswith(".json") and "policy" in json.loads(Path(args.tree).read_text()):
            bank = load_bank(args.tree, engine.decoder.drafter.max_depth)
            tree = bank.topology(bank.policy.star)
        else:
            tree = load_topology(args.tree, max_depth=engine.decoder.drafter.max_depth)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    work = Path(args.work or f"runs/power-{args.task}")
    work.mkdir(parents=True, exist_ok=True)
    prompts = list(zip(table.column("id").to_pylist(), table.column("prompt").to_pylist()))
    # measurements of other heads (or model, dtype) are never mixed in: the file is named by what they depend on
    measured_by = hashlib.sha256(json.dumps(measurement_key(engine), sort_keys=True).encode()).hexdigest()[:12]
    measured = rollouts(engine, prompts, work / f"rollouts-{args.max_new_tokens}-{measured_by}.jsonl")
    power = signal_power(measured, tree, args.beta)
    print(f"task {args.task}, {len(measured)} eval prompts, tree {tree.name} ({tree.num_nodes} nodes), "
          f"beta {args.beta}\n\n{power_table(power)}")
    if args.output:
        Path(args.output).write_text(json.dumps({"task": args.task, "tree": tree.name, "beta": args.beta,
                                                 "prompts": len(measured), "signals": power}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
