"""Build a topology bank for one (model, heads, task) on the hardware at hand.

    python jobs/build_bank.py --task gsm8k --dataset path/to/gsm8k/train.jsonl \\
        --out banks/smollm2-135m-instruct/gsm8k.json --work runs/bank-gsm8k
    python jobs/build_bank.py --task gsm8k humaneval sharegpt --name general \\
        --out banks/smollm2-135m-instruct/general.json --work runs/bank-general

Several tasks make one bank over a mix of their prompts (--prompts split evenly): the general bank a job
without --task reads.

1. Self-rollouts of the task's calibration prompts (its `tune` subset, --prompts sampled with
   --seed) on a Ray actor pool, through the same actor code as jobs/generate.py; greedy output
   does not depend on the tree, so they decode with whichever policy is fastest here
   (--rollout-policy).
2. One teacher-forced pass per rollout ranks every true next token under the head that would draft
   it (calibration.measure_rollout).
3. Greedy tree growth (Algorithm 1) to --budget nodes; candidates at a ladder of sizes.
4. Each candidate's step time measured here, with the actor's thread count, side by side per
   timing prompt (every tree back to back, rotated); its tokens/s and accepted length are the
   exact greedy replay of the calibration rollouts with its own tree.
5. Pareto frontier over (nodes, accepted length), then the sweeps that choose entmtp-star, the
   ladder and the hysteresis pair per signal. Every stage is saved under --work and resumes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path


import pyarrow as pa
import pyarrow.dataset as pads
import torch

from entmtp_ray.assets import asset
from entmtp_ray.calibrate.bank import Bank, BankTree, current_hardware, save_bank
from entmtp_ray.calibrate.growth import AcceptanceTable, accepted_lengths, grow_trees, pareto_frontier
from entmtp_ray.calibrate.rollouts import Rollout, measure_rollout
from entmtp_ray.calibrate.sweep import candidate_trees, choose_policies, replay_all
from entmtp_ray.cli import add_config_args, config_from_args, quiet_logging
from entmtp_ray.config import DecodingConfig, JobConfig, ModelConfig, PoolConfig, ProcessorConfig
from entmtp_ray.decode.loop import row_generator
from entmtp_ray.decode.policy import FixedTree
from entmtp_ray.decode.tree import Topology
from entmtp_ray.pipeline.engine import Engine
from entmtp_ray.pipeline.tasks import INTERNAL_COLUMNS, TASKS, load_prompts

MAX_RANKS = (16, 8, 8, 8, 8)  # ranks kept per depth; a tree never needs more children than these


def rollouts(args, model_cfg: ModelConfig, table, work: Path) -> Path:
    from entmtp_ray.pipeline.dataplane import run_job
    from entmtp_ray.pipeline.outputs import check_output
    from entmtp_ray.pipeline.sources import Location
    from entmtp_ray.pipeline.processor import build_processor

    out = work / "rollouts"
    check_output(Location.of(str(out)), resume=True)
    job = JobConfig(output=str(out), resume=True, address=args.address)
    pool = PoolConfig(min_actors=1, max_actors=args.max_actors, cpus_per_actor=args.threads)
    decoding = DecodingConfig(policy=args.rollout_policy, max_new_tokens=args.max_new_tokens)
    processor = build_processor(ProcessorConfig(model=model_cfg, decoding=decoding, pool=pool))
    summary = run_job(table, job, processor)
    print(f"rollouts: {json.dumps(summary)}", file=sys.stderr)
    return out


def measure_tables(engine: Engine, rollout_dir: Path, work: Path) -> list[Rollout]:
    cache = work / "tables.json"
    if cache.is_file():
        return [Rollout(**r) for r in json.loads(cache.read_text())]
    rows = pads.dataset(rollout_dir, format="parquet").to_table(
        columns=["id", "prompt", "output_token_ids", "error"]).to_pylist()
    measured = []
    for row in sorted(rows, key=lambda r: r["id"]):
        if row["error"] or not row["output_token_ids"]:
            continue
        ids = engine.encode(row["prompt"])
        measured.append(measure_rollout(engine.decoder, ids + row["output_token_ids"], len(ids), MAX_RANKS))
    cache.write_text(json.dumps([r.__dict__ for r in measured]))
    return measured


def step_seconds(engine: Engine, trees: dict[str, Topology], prompts: list[str], new_tokens: int,
                 work: Path) -> tuple[dict[str, float], float]:
    """Seconds per decoding step of each tree (median over prompts), and mean prefill seconds.

    The trees are timed side by side: each prompt runs every tree back to back, in an order rotated
    per prompt, so a machine that slows down during the timing slows every tree alike (timed one
    tree after another, a 1-node tree once measured slower than a 5-node one). Each finished prompt
    is saved, so a stopped build resumes within the timing.
    """
    cache = work / "step_seconds.json"
    saved = json.loads(cache.read_text()) if cache.is_file() else {}
    prefill = saved.get("prefill", [])
    if set(trees) <= set(saved.get("steps", {})):  # a finished timing
        return {name: saved["steps"][name] for name in trees}, sum(prefill) / len(prefill)
    cfg = DecodingConfig(policy="fixed", tree="ar", max_new_tokens=new_tokens)
    decoders = {}
    for name, topology in trees.items():
        decoders[name] = engine.stack.decoder(FixedTree(name, topology))
        decoders[name].generate(engine.encode(prompts[0]), cfg.model_copy(update={"max_new_tokens": 8}))  # warm-up
    names = list(trees)
    rounds: list[dict[str, float]] = saved.get("rounds", [])  # per prompt: tree -> seconds per step
    for k, prompt in enumerate(prompts):
        if k == len(rounds):
            rounds.append({})
        ids = engine.encode(prompt)
        for name in names[k % len(names):] + names[: k % len(names)]:
            if name not in rounds[k]:
                result = decoders[name].generate(ids, cfg, row_generator(0, str(k), engine.loaded.device))
                rounds[k][name] = result.decode_s / max(1, len(result.steps))
                prefill.append(result.prefill_s)
        cache.write_text(json.dumps({"rounds": rounds, "prefill": prefill}))
    steps = {}
    for name in names:
        steps[name] = statistics.median_high(r[name] for r in rounds[: len(prompts)])
        print(f"  {name}: {1000 * steps[name]:.1f} ms/step", file=sys.stderr)
    cache.write_text(json.dumps({"rounds": rounds, "prefill": prefill, "steps": steps}))
    return steps, sum(prefill) / len(prefill)


def project_relative(path: str) -> str:
    """Shipped heads as the package's assets name them (banks ship; absolute paths do not travel)."""
    try:
        return str(Path(path).resolve().relative_to(asset().resolve()))
    except ValueError:
        return str(path)


def calibration_source(tasks: list[str], dataset: str | None) -> str:
    """What the bank was calibrated on, without a path of the machine that built it (banks ship). `dataset` is
    GSM8K's copy when GSM8K is among several tasks."""
    def one(task: str) -> str:
        if dataset is None or (len(tasks) > 1 and task != "gsm8k"):
            return task
        return f"{task}: {Path(dataset).name} (a local copy)" if Path(dataset).exists() else f"{task}: {dataset}"
    return " + ".join(one(t) for t in tasks)


def calibration_prompts(tasks: list[str], dataset: str | None, split: str, prompts: int, seed: int) -> pa.Table:
    """The `tune` prompts to calibrate on: one task's, or an even mix of several tasks' (ids prefixed with
    their task, so they stay unique; only the prompt columns, as the tasks' own columns differ)."""
    if len(tasks) == 1:
        return load_prompts(tasks[0], dataset, split=split, limit=prompts, seed=seed, subset="tune")
    parts = []
    for k, task in enumerate(tasks):
        share = prompts // len(tasks) + (k < prompts % len(tasks))
        table = load_prompts(task, dataset if task == "gsm8k" else None, split=split, limit=share, seed=seed,
                             subset="tune").select(list(INTERNAL_COLUMNS))
        ids = [f"{task}:{i}" for i in table.column("id").to_pylist()]
        parts.append(table.set_column(0, "id", pa.array(ids, pa.string())))
    return pa.concat_tables(parts)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", required=True, nargs="+", choices=sorted(TASKS),
                   help="the task whose prompts calibrate the bank; several: a mix of their prompts (with --name)")
    p.add_argument("--name", default=None, help="the bank's name, as its tree names and `task` field carry it "
                   "(default: the task); the shipped mix of all three tasks is `general`")
    p.add_argument("--dataset", default=None, help="local copy of the task's data (GSM8K)")
    p.add_argument("--split", default="train")
    p.add_argument("--prompts", type=int, default=100, help="calibration prompts (tune subset)")
    p.add_argument("--seed", type=int, default=123)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--budget", type=int, default=64, help="node budget of the grown trees")
    p.add_argument("--timing-prompts", type=int, default=3, help="prompts each tree's step time is measured on")
    p.add_argument("--out", required=True, help="bank JSON to write")
    p.add_argument("--work", required=True, help="directory for the resumable intermediate results")
    p.add_argument("--threads", type=int, default=1, help="torch threads per actor (as jobs/generate.py "
                   "--cpus-per-actor); the bank's step times are measured with the same")
    p.add_argument("--max-actors", type=int, default=1)
    p.add_argument("--address", default=None)
    p.add_argument("--rollout-policy", default="ar", choices=["ar", "hydra", "medusa"],
                   help="decodes the calibration rollouts; greedy output is the same under every policy, so "
                   "pick the fastest here (ar on a CPU, where a 64-node tree step costs more than it saves; "
                   "hydra on a GPU)")
    p.add_argument("--rollouts-only", action="store_true", help="stop after the rollouts (e.g. to run every "
                   "task's rollouts on the cluster first, then time the trees on a quiet machine)")
    add_config_args(p, ModelConfig)
    args = p.parse_args(argv)
    quiet_logging()
    started = time.time()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    model_cfg = config_from_args(ModelConfig, args)
    if len(args.task) > 1 and not args.name:
        p.error("several --task values make a mixed bank: name it with --name (e.g. general)")
    bank_name = args.name or args.task[0]
    table = calibration_prompts(args.task, args.dataset, args.split, args.prompts, args.seed)
    rollout_dir = rollouts(args, model_cfg, table, work)
    if args.rollouts_only:
        return 0

    torch.set_num_threads(args.threads)
    engine = Engine(model_cfg, DecodingConfig(policy="hydra", max_new_tokens=args.max_new_tokens))
    measured = measure_tables(engine, rollout_dir, work)
    depth = engine.decoder.drafter.max_depth
    table_ = AcceptanceTable((row for r in measured for row in r.rows), max_depth=depth)
    grown = grow_trees(table_, args.budget, max_depth=depth)
    trees = candidate_trees(grown, args.budget, bank_name)
    prompts = table.column("prompt").to_pylist()[: args.timing_prompts]
    seconds, prefill = step_seconds(engine, trees, prompts, min(64, args.max_new_tokens), work)

    stats = {}
    lengths = [accepted_lengths(r.rows, trees.values()) for r in measured]  # every tree's replay, for the sweep
    for name, tree in trees.items():
        r = replay_all(measured, FixedTree(name, tree), seconds, prefill * len(measured), lengths)
        stats[name] = {"tau": r.tau, "tokens_per_s": r.tokens_per_s, "tau_grown": table_.accepted_length(tree.paths)}
    names = list(trees)
    frontier = [names[i] for i in pareto_frontier([(trees[n].num_nodes, stats[n]["tau"]) for n in names])]
    policy, figures = choose_policies(measured, trees, seconds, prefill * len(measured), frontier, lengths=lengths)
    bank = Bank(
        model=Path(args.model).name, heads=project_relative(engine.heads_label), task=bank_name,
        hardware=current_hardware(engine.loaded.device, engine.loaded.dtype),
        calibration={"source": calibration_source(args.task, args.dataset), "subset": "tune", "prompts": len(measured),
                     "seed": args.seed, "max_new_tokens": args.max_new_tokens, "positions": table_.rows},
        created=datetime.date.today().isoformat(),
        trees=[BankTree.of(trees[n], **stats[n]) for n in frontier],
        policy=policy)
    save_bank(bank, args.out)
    (work / "sweep.json").write_text(json.dumps(figures, indent=1))
    print(json.dumps({"bank": args.out, "frontier": {n: stats[n] for n in frontier},
                      "star": policy.star, "signal": policy.signal, "seconds": time.time() - started}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
