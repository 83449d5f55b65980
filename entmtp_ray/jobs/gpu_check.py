"""The GPU path in one command, on a machine with a GPU and no internet, in under 10 minutes.

    python jobs/gpu_check.py --output runs/gpu-check [--gsm8k PATH] [--sharegpt PATH]

Stages, each in its own process with its own time limit (a stage that fails or times out is reported, the
others still run); the last stdout line is one JSON summary, also written to OUTPUT/summary.json:

1. decode: the embedded model on CUDA fp16 with its shipped heads, on held-out humaneval prompts: ar, hydra
   and entmtp-tau greedy, each through the dynamic forward, the static one and the captured CUDA graphs.
   Every output against AR's (a difference passes only as a float tie at its first token), tokens/s per
   mode, and the host-device synchronisations per step that torch.cuda.set_sync_debug_mode reports.
2. bench: jobs/bench.py's side-by-side table (tokens/s, tau, x AR) for ar, hydra and entmtp-tau at T=0 on
   each task with prompts here (humaneval ships with the package; --gsm8k/--sharegpt name local copies).
   bench exits 1 when a greedy output differs from AR's beyond a float tie.
3. bank: jobs/build_bank.py on a small humaneval calibration, timed on this GPU.
4. ray: jobs/generate.py with 2 actors at --gpus-per-actor 0.5 (both on one GPU) on local Ray, with --bank auto:
   a bank calibrated on 4 of the 12 prompts on the GPU (those 4 rows are the calibration's), the other 8 rows
   decoded by the two actors with it.
5. quantized: jobs/bench.py on humaneval in bf16 with --quantize int8 and --quantize int4 (the CUDA weight-only
   kernels, through the static forward and CUDA graphs): tokens/s beside the same run's AR, greedy outputs
   checked against the quantized model's AR.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout: jobs/ beside entmtp_ray/
STAGES = ("decode", "bench", "bank", "ray", "quantized")
POLICIES = ("ar", "hydra", "entmtp-tau")
MODES = {"dynamic": dict(static=False, graphs=False), "static": dict(static=True, graphs=False),
         "graphs": dict(static=True, graphs=True)}


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output", required=True, help="directory for every stage's files and summary.json")
    p.add_argument("--stages", nargs="+", default=list(STAGES), choices=STAGES)
    p.add_argument("--prompts", type=int, default=4, help="held-out prompts per task")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--gsm8k", default=None, help="a local copy of GSM8K (the machine has no hub access)")
    p.add_argument("--sharegpt", default=None, help="a local copy of ShareGPT")
    p.add_argument("--device", default="cuda", help="cuda; cpu runs the same stages without CUDA graphs or sync "
                   "counts (the test suite's smoke run of this script)")
    p.add_argument("--stage", default=None, help=argparse.SUPPRESS)  # run one in-process stage (the child)
    return p.parse_args(argv)


def decode_stage(args) -> dict:
    """Stage 1, in this process (the parent runs it as a child)."""
    import torch

    from entmtp_ray.bench.compare import compare_greedy, continuation_logits
    from entmtp_ray.config import DecodingConfig, ModelConfig
    from entmtp_ray.decode.loop import SpecDecoder
    from entmtp_ray.pipeline.assemble import load_stack, plan
    from entmtp_ray.pipeline.engine import encode_checked
    from entmtp_ray.pipeline.tasks import load_prompts

    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        raise RuntimeError("no CUDA device visible to torch")
    stack = load_stack(ModelConfig(device=args.device, dtype="fp16" if cuda else "fp32"), with_heads=True)
    loaded = stack.loaded
    modes = {mode: options for mode, options in MODES.items() if cuda or not options["graphs"]}
    table = load_prompts("humaneval", None, limit=args.prompts, seed=1, subset="eval")
    prompts = [encode_checked(loaded, p, 2048) for p in table.column("prompt").to_pylist()]
    out: dict = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
                 "cuda": torch.version.cuda,
                 "prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "policies": {}}
    reference: list[list[int]] = []
    for name in POLICIES:
        cfg = DecodingConfig(policy=name, task="humaneval", max_new_tokens=args.max_new_tokens)
        policy = plan(ModelConfig(), cfg).policy
        row: dict = {}
        for mode, options in modes.items():
            started = time.perf_counter()
            decoder = SpecDecoder(loaded, stack.drafter if name != "ar" else None, policy, **options)
            build_s = time.perf_counter() - started
            decoder.generate(prompts[0][:32], cfg)  # warm-up (lazy CUDA inits)
            results, syncs = [], []
            for ids in prompts:
                request = decoder.prefill(ids, cfg)
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    if cuda:
                        torch.cuda.set_sync_debug_mode("warn")  # a warning per synchronising call
                    steps = 0
                    while request.finish is None:
                        decoder.step(request)
                        steps += 1
                    if cuda:
                        torch.cuda.set_sync_debug_mode("default")
                syncs.append(sum("synchroniz" in str(w.message) for w in caught) / max(1, steps) if cuda else None)
                results.append(decoder.generate(ids, cfg))  # timed run
            tokens = [r.output_token_ids for r in results]
            if name == "ar" and mode == "dynamic":
                reference = tokens
            checks = [compare_greedy(got, want, continuation_logits(loaded, ids, want), loaded.dtype)
                      for got, want, ids in zip(tokens, reference, prompts)]
            row[mode] = {
                "tokens_per_s": statistics.median(r.tokens_per_s for r in results),
                "tau": statistics.mean(r.mean_accepted_length for r in results),
                "graphs_captured": len(decoder.verifier.graphs) if decoder.verifier is not None else 0,
                "syncs_per_step": max(syncs) if cuda else None, "greedy_vs_ar": sorted(set(checks)),
                "build_s": round(build_s, 2),
            }
        base = row["dynamic"]["tokens_per_s"]
        for mode in modes:
            row[mode]["x_dynamic"] = round(row[mode]["tokens_per_s"] / base, 3) if base else None
        out["policies"][name] = row
    fastest = list(modes)[-1]
    ar = out["policies"]["ar"][fastest]["tokens_per_s"]
    for name in POLICIES:
        out["policies"][name][fastest]["x_ar"] = round(out["policies"][name][fastest]["tokens_per_s"] / ar, 3)
    out["ok"] = all(set(r["greedy_vs_ar"]) <= {"equal", "tie"} for p in out["policies"].values() for r in p.values())
    return out


def _run(command: list[str], log: Path, timeout: float) -> tuple[int | None, float, str]:
    """(exit status or None on timeout, seconds, last stdout line) of a child whose output goes to `log`."""
    started = time.perf_counter()
    with log.open("w") as handle:
        try:
            status = subprocess.run(command, cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT,
                                    timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            status = None
    lines = [line for line in log.read_text().splitlines() if line.strip()]
    return status, round(time.perf_counter() - started, 1), lines[-1] if lines else ""


def _json_or(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


def main(argv=None) -> int:
    args = parse(argv)
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    if args.stage == "decode":
        print(json.dumps(decode_stage(args)), flush=True)
        return 0
    py = sys.executable
    summary: dict = {"stages": {}}
    tasks = {"humaneval": None, "gsm8k": args.gsm8k, "sharegpt": args.sharegpt}
    common = ["--device", args.device, "--dtype", "fp16" if args.device.startswith("cuda") else "fp32"]
    for stage in args.stages:
        if stage == "decode":
            command = [py, "-m", "entmtp_ray.jobs.gpu_check", "--stage", "decode", "--output", str(out),
                       "--device", args.device,
                       "--prompts", str(args.prompts), "--max-new-tokens", str(args.max_new_tokens)]
            status, seconds, last = _run(command, out / "decode.log", 180)
            summary["stages"]["decode"] = {"status": status, "seconds": seconds, "result": _json_or(last)}
        elif stage == "bench":
            for task, dataset in tasks.items():
                if task != "humaneval" and dataset is None:
                    summary["stages"][f"bench-{task}"] = {"skipped": f"no local copy (pass --{task} PATH)"}
                    continue
                target = out / f"bench-{task}"
                command = [py, "jobs/bench.py", "--task", task, "--limit", str(args.prompts), "--max-new-tokens",
                           str(args.max_new_tokens), "--temperatures", "0", "--systems", *POLICIES,
                           "--output", str(target), *common] + (["--dataset", dataset] if dataset else [])
                status, seconds, _ = _run(command, out / f"bench-{task}.log", 120)
                report = target / "report.json"
                summary["stages"][f"bench-{task}"] = {
                    "status": status, "seconds": seconds,
                    "table": json.loads(report.read_text()).get("rows") if report.is_file() else None}
        elif stage == "bank":
            command = [py, "jobs/build_bank.py", "--task", "humaneval", "--prompts", "8", "--max-new-tokens", "64",
                       "--budget", "32", "--timing-prompts", "2", "--out", str(out / "bank.json"),
                       "--work", str(out / "bank-work"), *common]
            status, seconds, _ = _run(command, out / "bank.log", 150)
            summary["stages"]["bank"] = {"status": status, "seconds": seconds,
                                         "bank_written": (out / "bank.json").is_file()}
        elif stage == "ray":
            command = [py, "jobs/generate.py", "--task", "humaneval", "--limit", "12", "--max-new-tokens", "64",
                       "--min-actors", "2", "--max-actors", "2", "--gpus-per-actor", "0.5", "--bank", "auto",
                       "--calibration-prompts", "4", "--calibration-budget", "32", "--bank-cache",
                       str(out / "bank-cache"), "--output", str(out / "ray-job"), *common]
            status, seconds, last = _run(command, out / "ray.log", 210)
            summary["stages"]["ray"] = {"status": status, "seconds": seconds, "summary": _json_or(last),
                                        "actors": _actors(out / "ray-job")}
        elif stage == "quantized":
            for scheme in ("int8", "int4"):
                target = out / f"quantized-{scheme}"
                command = [py, "jobs/bench.py", "--task", "humaneval", "--limit", str(args.prompts),
                           "--max-new-tokens", str(args.max_new_tokens), "--temperatures", "0", "--systems",
                           *POLICIES, "--quantize", scheme, "--output", str(target), "--device", args.device,
                           "--dtype", "bf16"]
                status, seconds, _ = _run(command, out / f"quantized-{scheme}.log", 120)
                report = target / "report.json"
                summary["stages"][f"quantized-{scheme}"] = {
                    "status": status, "seconds": seconds,
                    "table": json.loads(report.read_text()).get("rows") if report.is_file() else None}
    summary["ok"] = all(s.get("status") == 0 or "skipped" in s for s in summary["stages"].values())
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary), flush=True)
    return 0 if summary["ok"] else 1


def _actors(directory: Path) -> int | None:
    """How many distinct actors wrote the job's rows."""
    try:
        import pyarrow.dataset as pads

        return len(set(pads.dataset(directory, format="parquet").to_table(columns=["actor_id"])
                       .column("actor_id").to_pylist()))
    except Exception:  # noqa: BLE001 - a missing or partial output is reported as None
        return None


if __name__ == "__main__":
    sys.exit(main())
