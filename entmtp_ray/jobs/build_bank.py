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
2. The bank from them on this machine (pipeline/calibration.py): rank tables, tree growth to --budget nodes,
   every candidate tree timed here with --threads, the Pareto frontier and the policy sweeps. Every
   stage is saved under --work and resumes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as pads
import torch

from entmtp_ray.assets import shipped_heads
from entmtp_ray.calibrate.bank import save_bank, selection_report
from entmtp_ray.pipeline.calibration import CalibrationRow, build_bank
from entmtp_ray.cli import add_config_args, config_from_args, quiet_logging
from entmtp_ray.config import DecodingConfig, JobConfig, ModelConfig, PoolConfig, ProcessorConfig
from entmtp_ray.model.heads import SEEN_PROMPTS_FILE
from entmtp_ray.pipeline.assemble import resolve
from entmtp_ray.pipeline.engine import Engine
from entmtp_ray.pipeline.tasks import INTERNAL_COLUMNS, TASKS, load_prompts


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


def calibration_source(tasks: list[str], dataset: str | None) -> str:
    """What the bank was calibrated on, without a path of the machine that built it (banks ship). `dataset` is
    GSM8K's copy when GSM8K is among several tasks."""
    def one(task: str) -> str:
        if dataset is None or (len(tasks) > 1 and task != "gsm8k"):
            return task
        return f"{task}: {Path(dataset).name} (a local copy)" if Path(dataset).exists() else f"{task}: {dataset}"
    return " + ".join(one(t) for t in tasks)


def seen_prompts(model_cfg: ModelConfig, path: str | None) -> tuple[dict[str, set[str]], str]:
    """The prompt ids a bank for these heads leaves out of its calibration, so its replayed and measured acceptance
    is what prompts the heads never saw get: `path` ('none': none), else the heads' own SEEN_PROMPTS_FILE (the
    shipped heads', or a local heads folder's). Returns them by task, and what they are for the bank's record."""
    if path == "none":
        return {}, ""
    if path is None:
        heads = shipped_heads(model_cfg.model) if model_cfg.heads is None else Path(model_cfg.heads)
        if not (heads / SEEN_PROMPTS_FILE).is_file():
            return {}, ""
        path = str(heads / SEEN_PROMPTS_FILE)
    try:
        listed = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"--seen {path}: not a readable JSON file of {{task: [prompt ids]}} ({exc}); fix it, or pass "
                         "--seen none to calibrate on any tune prompt") from None
    seen = {task: set(map(str, ids)) for task, ids in listed.items() if task in TASKS}
    return seen, f"the heads' training prompts ({sum(map(len, seen.values()))} ids of {Path(path).name})"


def calibration_prompts(tasks: list[str], dataset: str | None, split: str, prompts: int, seed: int,
                        seen: dict[str, set[str]] | None = None) -> pa.Table:
    """The `tune` prompts to calibrate on, less the `seen` ids of each task: one task's, or an even mix of several
    tasks' (ids prefixed with their task, so they stay unique; only the prompt columns, as the tasks' own columns
    differ)."""
    seen = seen or {}
    if len(tasks) == 1:
        return load_prompts(tasks[0], dataset, split=split, limit=prompts, seed=seed, subset="tune",
                            exclude=seen.get(tasks[0]))
    parts = []
    for k, task in enumerate(tasks):
        share = prompts // len(tasks) + (k < prompts % len(tasks))
        table = load_prompts(task, dataset if task == "gsm8k" else None, split=split, limit=share, seed=seed,
                             subset="tune", exclude=seen.get(task)).select(list(INTERNAL_COLUMNS))
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
    p.add_argument("--seen", default=None, help="a JSON file of {task: [prompt ids]} the heads were trained on, left "
                   f"out of the calibration prompts (default: the heads' own {SEEN_PROMPTS_FILE}, as the shipped heads "
                   "have; 'none': calibrate on any tune prompt)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--budget", type=int, default=64, help="node budget of the grown trees")
    p.add_argument("--timing-prompts", type=int, default=3, help="prompts each tree's step time is measured on")
    p.add_argument("--out", required=True, help="bank JSON to write")
    p.add_argument("--work", required=True, help="directory for the resumable intermediate results")
    p.add_argument("--threads", type=int, default=1, help="torch threads per actor (as jobs/generate.py "
                   "--cpus-per-actor); the bank's step times are measured with the same")
    p.add_argument("--concurrent-requests", type=int, default=1, help="requests in flight per actor the bank is "
                   "for (jobs/generate.py --concurrent-requests): the trees are timed in batches of that many")
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
    seen, left_out = seen_prompts(model_cfg, args.seen)
    table = calibration_prompts(args.task, args.dataset, args.split, args.prompts, args.seed, seen)
    if not len(table):
        p.error(f"no tune prompt of {' '.join(args.task)} is left once {left_out} are left out: pass --seen none")
    if len(table) < args.prompts:
        print(f"calibrating on {len(table)} prompts, not --prompts {args.prompts}: the tune subset has no more once "
              f"{left_out or 'nothing'} is left out", file=sys.stderr)
    rollout_dir = rollouts(args, model_cfg, table, work)
    if args.rollouts_only:
        return 0

    torch.set_num_threads(args.threads)
    if args.concurrent_requests < 1:
        p.error("--concurrent-requests must be >= 1")
    drafting = DecodingConfig(policy="hydra", max_new_tokens=args.max_new_tokens)
    engine = Engine(model_cfg, resolve(model_cfg, drafting), concurrency=args.concurrent_requests)
    written = pads.dataset(rollout_dir, format="parquet").to_table(
        columns=["id", "prompt", "output_token_ids", "error"]).to_pylist()
    rows = [CalibrationRow(r["id"], r["prompt"], r["output_token_ids"]) for r in written if not r["error"]]
    built = build_bank(engine, rows, table.column("prompt").to_pylist()[: args.timing_prompts], work, name=bank_name,
                       budget=args.budget, max_new_tokens=args.max_new_tokens,
                       calibration={"source": calibration_source(args.task, args.dataset), "subset": "tune",
                                    "seed": args.seed, **({"left_out": left_out} if left_out else {})})
    save_bank(built.bank, args.out)
    policy = built.bank.policy
    print(selection_report(built.bank), file=sys.stderr)
    print(json.dumps({"bank": args.out, "frontier": {n: built.stats[n] for n in built.frontier},
                      "star": policy.star, "signal": policy.signal, "seconds": time.time() - started}))
    return 0

if __name__ == "__main__":
    sys.exit(main())
