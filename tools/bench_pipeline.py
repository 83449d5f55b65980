"""Pipeline benchmark: what the Ray data plane costs, apart from decoding.

    python tools/bench_pipeline.py --rows 10000 100000 --output runs/bench-pipeline
    python tools/bench_pipeline.py --checkout /tmp/old-checkout --rows 10000   # the same figures for another checkout

For each input size it writes a JSON-lines input of that many prompts, runs the generation job on a tiny
random Llama (built here: H=64, 2 layers, the embedded tokenizer) for 1 new token per row with `--policy
ar`, so Ray, reading and writing dominate, and reports the job's rows/s, its time from start to the first
decoded row, and the driver's peak RSS (VmHWM of the job's own process; Ray's workers are not in it). With
`--embedded-rows N` it also runs N rows on the embedded model and reports the pipeline's overhead per row:
the decode span (first row start to last row end) minus the rows' own decode time, over the rows, with one
actor (so rows do not overlap).

Each job runs in its own process, one after the other; the last stdout line is a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

# run inside the job's process: report its peak RSS on exit (after the job's own summary line)
_PEAK_WRAPPER = (
    "import atexit, runpy, sys\n"
    "def peak():\n"
    "    for line in open('/proc/self/status'):\n"
    "        if line.startswith('VmHWM:'):\n"
    "            print('DRIVER_PEAK_KB', line.split()[1], file=sys.stderr, flush=True)\n"
    "atexit.register(peak)\n"
    "sys.argv = sys.argv[1:]\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n"
)


def make_tiny_model(path: Path) -> Path:
    """A tiny random Llama directory with the embedded model's tokenizer (built once per path)."""
    if (path / "config.json").is_file():
        return path
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from entmtp_ray.model.loading import resolve_model_path

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=49152, max_position_embeddings=512, eos_token_id=2)
    LlamaForCausalLM(config).save_pretrained(path)
    AutoTokenizer.from_pretrained(resolve_model_path("smollm2-135m-instruct")).save_pretrained(path)
    return path


def write_input(path: Path, rows: int) -> Path:
    if not path.is_file():
        tmp = path.with_suffix(".tmp")
        with tmp.open("w") as f:
            for i in range(rows):
                f.write(json.dumps({"prompt": f"Write item number {i} of a list.", "n": i}) + "\n")
        tmp.replace(path)
    return path


def run_job(generate: Path, env: dict, args: list[str], log: Path) -> dict:
    """Run one job from its checkout's folder (a local Ray puts the driver's working directory first on its
    workers' path: they then import that checkout too); its summary (last stdout line) plus the driver's
    peak RSS and the wall time seen here."""
    start = time.time()
    proc = subprocess.run([sys.executable, "-c", _PEAK_WRAPPER, str(generate), *args], env=env,
                          capture_output=True, text=True, cwd=generate.parent.parent)
    wall = time.time() - start
    log.write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"job failed (exit {proc.returncode}); see {log}")
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    peaks = [int(line.split()[1]) for line in proc.stderr.splitlines() if line.startswith("DRIVER_PEAK_KB")]
    summary["driver_peak_rss_mb"] = peaks[-1] / 1024 if peaks else None
    summary["process_wall_s"] = wall
    return summary


def overhead_per_row(output: Path) -> dict:
    """Decode span minus the rows' own decode time, per row (one actor: rows run one after another)."""
    import pyarrow.compute as pc
    import pyarrow.dataset as pads

    table = pads.dataset(output, format="parquet").to_table(columns=["started_at", "total_s", "error"])
    table = table.filter(pc.is_null(table["error"]))
    ends = pc.add(table["started_at"], table["total_s"])
    span = pc.max(ends).as_py() - pc.min(table["started_at"]).as_py()
    own = pc.sum(table["total_s"]).as_py()
    return {"rows": table.num_rows, "decode_span_s": span, "decode_s": own,
            "overhead_ms_per_row": 1000 * (span - own) / max(1, table.num_rows - 1)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="*", default=[10_000, 100_000],
                        help="input sizes (none: only the --embedded-rows run)")
    parser.add_argument("--output", default="runs/bench-pipeline", help="work folder: inputs, model, outputs, logs")
    parser.add_argument("--checkout", default=None, help="run this checkout's jobs/generate.py (default: this one's)")
    parser.add_argument("--max-actors", type=int, default=2)
    parser.add_argument("--embedded-rows", type=int, default=0, help="also measure per-row overhead on the "
                        "embedded model with this many rows (0: skip)")
    parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[],
                        help="further arguments for every job (after everything else)")
    args = parser.parse_args(argv)

    work = Path(args.output).resolve()
    work.mkdir(parents=True, exist_ok=True)
    checkout = Path(args.checkout).resolve() if args.checkout else Path(__file__).resolve().parents[1]
    generate = checkout / "jobs" / "generate.py"
    if not generate.is_file():
        raise SystemExit(f"--checkout {checkout}: no jobs/generate.py there")
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    model = make_tiny_model(work / "tiny-llama")
    label = checkout.name
    results: dict = {"checkout": str(checkout), "sizes": {}}
    for rows in args.rows:
        source = write_input(work / f"input-{rows}.jsonl", rows)
        output = work / f"out-{label}-{rows}"
        subprocess.run(["rm", "-rf", str(output)], check=True)
        summary = run_job(generate, env, ["--dataset", str(source), "--model", str(model), "--policy", "ar",
                                          "--max-new-tokens", "1", "--max-actors", str(args.max_actors),
                                          "--output", str(output), *args.extra], work / f"log-{label}-{rows}.txt")
        results["sizes"][rows] = {
            "rows": summary["rows"], "duplicates": summary["duplicates"], "errors": summary["errors"],
            "driver_peak_rss_mb": summary["driver_peak_rss_mb"], "wall_s": summary["process_wall_s"],
            "rows_per_s": summary["rows"] / summary["process_wall_s"], "first_row_s": summary["first_row_s"]}
        print(json.dumps({rows: results["sizes"][rows]}), flush=True)
    if len(args.rows) >= 2:
        small, large = min(args.rows), max(args.rows)
        results["peak_rss_ratio"] = (results["sizes"][large]["driver_peak_rss_mb"]
                                     / results["sizes"][small]["driver_peak_rss_mb"])
    if args.embedded_rows:
        source = write_input(work / f"input-{args.embedded_rows}.jsonl", args.embedded_rows)
        output = work / f"out-{label}-embedded"
        subprocess.run(["rm", "-rf", str(output)], check=True)
        summary = run_job(generate, env, ["--dataset", str(source), "--policy", "ar", "--max-new-tokens", "16",
                                          "--max-actors", "1", "--output", str(output), *args.extra],
                          work / f"log-{label}-embedded.txt")
        results["embedded"] = {**overhead_per_row(output), "wall_s": summary["process_wall_s"]}
    print(json.dumps(results), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
