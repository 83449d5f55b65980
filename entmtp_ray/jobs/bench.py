"""Side-by-side benchmark: AR, transformers generate and prompt lookup, Hydra, Medusa and the EntMTP policies.

    python jobs/bench.py --task gsm8k --limit 8 --max-new-tokens 128 --output runs/bench-gsm8k

Takes jobs/generate.py's input flags (`--task` alone benchmarks the task's held-out `eval` prompts,
which neither the heads nor the bank saw). One process: every system decodes each prompt back to
back in a rotating order after one untimed warm-up, at T=0 (greedy) and T=0.7 (typical and exact
acceptance; AR and transformers sample plainly). Writes the per-row Parquet to OUTPUT/rows and the
report (report.md, report.json, plots) to OUTPUT. Lossless checks: at T=0 each system's tokens against
AR's (a difference passes only as a float tie at its first token), at every T the output's
negative log-likelihood under the base model. Exits 1 if a greedy output differs from AR's.
llama.cpp joins when `llama-cpp-python` is installed (`pip install -e .[llamacpp]`).

Throughput mode (`--concurrent-requests 1 2 4 8`): instead, aggregate output tokens/s of the whole prompt set at
each K (requests in flight in one process, as one actor runs them), for ar and entmtp-tau by default, beside
transformers `generate` on batches of K (`hf-generate`) and llama.cpp (K=1); `--systems ... hf-continuous` adds
transformers' continuous batching (slow on a CPU); `--bank-at K=FILE` gives the entmtp
policies a bank timed at that K (bench/throughput.py). Writes throughput.md and throughput.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import torch
from pydantic import ValidationError

from entmtp_ray.bench.compare import POLICIES, SYSTEMS, Bench, Prompt, bench_table, weight_read_seconds
from entmtp_ray.bench.report import throughput_tables, write_report
from entmtp_ray.bench.throughput import BASELINES as THROUGHPUT_BASELINES
from entmtp_ray.bench.throughput import OURS as THROUGHPUT_OURS
from entmtp_ray.bench.throughput import HFContinuous, HFStatic, LlamaCppOne, check_greedy, run_all, summarize
from entmtp_ray.bench.throughput import markdown as throughput_markdown
from entmtp_ray.calibrate.bank import (build_policy, current_hardware, load_bank, resolve_bank_path,
                                       selection_report, warn_if_other_hardware)
from entmtp_ray.cli import add_config_args, config_from_args, quiet_logging
from entmtp_ray.config import EMBEDDED_MODEL, DecodingConfig, InputConfig, ModelConfig
from entmtp_ray.model.loading import available_depth, draft_vocab_for
from entmtp_ray.pipeline.assemble import AUTO_BANK, BANK_POLICIES, actors_here, load_stack, resolve_policy
from entmtp_ray.pipeline.engine import encode_checked
from entmtp_ray.pipeline.tasks import load_prompts


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_config_args(p, InputConfig, defaults={"limit": 8})
    add_config_args(p, DecodingConfig, only=("task", "bank", "seed", "max_new_tokens", "max_input_tokens"),
                    defaults={"max_new_tokens": 128})
    p.add_argument("--subset", default=None, choices=["all", "tune", "eval"],
                   help="rows of a task (default: eval with --task, the prompts no bank or head saw; "
                        "all for a --dataset alone)")
    p.add_argument("--systems", nargs="+", default=None, choices=SYSTEMS + ("hf-continuous",),
                   help="default: all that apply (entmtp-* need a bank, llama-cpp its package and the embedded model)")
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
    p.add_argument("--acceptances", nargs="+", default=["typical", "exact"], choices=["typical", "exact"],
                   help="acceptance rules of the drafting policies at T>0 (AR and the baselines sample plainly)")
    p.add_argument("--also-bank", nargs="+", default=[], metavar="NAME=FILE",
                   help="more banks, each run as system entmtp-tau@NAME in the same interleaved run (e.g. an auto bank "
                   "beside the shipped one)")
    p.add_argument("--unadapted", action="store_true",
                   help="also run each entmtp policy without adapting to each request's content (--no-adapt), as "
                   "system NAME@unadapted in the same interleaved run")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: the bank's)")
    p.add_argument("--concurrent-requests", type=int, nargs="+", default=None, metavar="K",
                   help="throughput mode: aggregate tokens/s of all prompts at each K requests in flight")
    p.add_argument("--bank-at", nargs="+", default=[], metavar="K=FILE",
                   help="throughput mode: the bank the entmtp policies use at K (default: --bank or the task's)")
    p.add_argument("--repeats", type=int, default=1, help="throughput mode: passes over every configuration")
    p.add_argument("--output", required=True, help="directory for rows/ (Parquet) and the report")
    add_config_args(p, ModelConfig)
    return p, p.parse_args(argv)


def bench_bank(model_cfg: ModelConfig, task: str | None, bank: str | None) -> Path | None:
    """The bank the entmtp systems read, resolved as a job resolves its default policy (assemble.resolve_policy):
    --bank FILE, else the bank shipped for the model and --task, else (no task) the model's general bank. None:
    the model has no shipped bank to read. --bank auto is a job's calibration, which the bench does not run."""
    if bank == AUTO_BANK:
        raise ValueError("--bank auto is calibrated by the generation job on its own prompts, not by the bench: run "
                         "jobs/generate.py --bank auto, then bench the bank it wrote with --bank "
                         "<output>/_banks/<key>/bank.json (or compare it beside the default with "
                         "--also-bank auto=FILE)")
    here = actors_here(model_cfg)  # the bench decodes in this process
    resolved, _ = resolve_policy(model_cfg, DecodingConfig(task=task, bank=bank), here)
    if resolved.bank == AUTO_BANK:
        return None
    return resolve_bank_path(model_cfg.model, task, resolved.bank, here)


def no_bank_error(model: str) -> ValueError:
    return ValueError(f"the entmtp-* systems read a topology bank and none ships for --model {model}: pass --bank "
                      "FILE (jobs/build_bank.py builds one), or drop them from --systems")


def choose_systems(requested, model: str, bank_path: Path | None) -> list[str]:
    if requested is None:
        systems = [s for s in SYSTEMS if s not in BANK_POLICIES or bank_path is not None]
        if importlib.util.find_spec("llama_cpp") is None or model != EMBEDDED_MODEL:
            systems.remove("llama-cpp")
    else:
        systems = list(dict.fromkeys(requested))
        if "llama-cpp" in systems and model != EMBEDDED_MODEL:
            raise ValueError(f"--systems llama-cpp runs the embedded model's GGUF only; drop it for --model {model}")
        if "llama-cpp" in systems and importlib.util.find_spec("llama_cpp") is None:
            raise ValueError("--systems llama-cpp needs llama-cpp-python: pip install -e .[llamacpp]")
    if "ar" not in systems:
        systems.insert(0, "ar")  # the reference of every speedup and greedy check
    return systems


def main(argv=None) -> int:
    parser, args = parse(argv)
    quiet_logging()
    if args.concurrent_requests:
        return throughput_main(args)
    try:
        model_cfg = config_from_args(ModelConfig, args)
        wants_bank = args.systems is None or any(s in BANK_POLICIES for s in args.systems)
        bank_path = bank = None
        if wants_bank:
            bank_path = bench_bank(model_cfg, args.task, args.bank)
            if bank_path is not None:
                bank = load_bank(bank_path, available_depth(model_cfg.model, model_cfg.heads),
                                 Path(model_cfg.model).name)
            elif args.systems is not None:
                raise no_bank_error(model_cfg.model)
        if "hf-continuous" in (args.systems or []):
            raise ValueError("--systems hf-continuous runs in throughput mode only: add --concurrent-requests K ...")
        systems = choose_systems(args.systems, model_cfg.model, bank_path)
        other_banks = {}
        for spec in args.also_bank:
            name, sep, file = spec.partition("=")
            if not sep or not name or not file:
                raise ValueError(f"--also-bank {spec}: write NAME=FILE, e.g. auto=runs/job/_banks/KEY/bank.json")
            other_banks[name] = (load_bank(file, available_depth(model_cfg.model, model_cfg.heads),
                                           Path(model_cfg.model).name), file)
        drafts = any(s in POLICIES and s != "ar" for s in systems) or bool(other_banks)
        if drafts:
            draft_vocab_for(model_cfg.model, model_cfg.heads, model_cfg.draft_vocab)  # a bad --draft-vocab fails here
        subset = args.subset or ("eval" if args.task else "all")
        table = load_prompts(args.task, args.dataset, args.split, args.prompt_column, args.id_column,
                             args.messages_column, args.limit, args.seed, subset)
        DecodingConfig(max_new_tokens=args.max_new_tokens, max_input_tokens=args.max_input_tokens)
        if any(t < 0 for t in args.temperatures):
            raise ValueError(f"--temperatures must be >= 0, got {args.temperatures}")
    except (ValueError, ValidationError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    threads = args.threads or (bank.hardware.threads if bank is not None else torch.get_num_threads())
    torch.set_num_threads(threads)
    stack = load_stack(model_cfg, with_heads=drafts)
    loaded = stack.loaded
    if bank is not None:
        warn_if_other_hardware(bank, current_hardware(loaded.device, loaded.dtype, quantize=loaded.quantize,
                                                      activations=loaded.activations), bank_path)
    bench = Bench(stack, systems, args.task, bank, model_cfg.model, str(bank_path) if bank_path else None, threads,
                  args.seed, other_banks, args.unadapted)
    prompts = []
    for row in table.select(["id", "prompt", "_messages", "_input_error"]).to_pylist():
        ids, error = None, row["_input_error"]
        if not error:
            try:
                ids = encode_checked(loaded, json.loads(row["_messages"]) if row["_messages"] else row["prompt"],
                                     args.max_input_tokens)
            except ValueError as exc:  # a bad row becomes an error row of every system
                error = str(exc)
        prompts.append(Prompt(row["id"], row["prompt"], ids, error))

    weight_bytes, floor_s = weight_read_seconds(loaded)
    started = time.time()
    rows = bench.run(prompts, args.temperatures, args.max_new_tokens, args.seed, tuple(args.acceptances))
    output = Path(args.output)
    (output / "rows").mkdir(parents=True, exist_ok=True)
    pq.write_table(bench_table(rows), output / "rows" / "part-0.parquet")

    ar_greedy = [r for r in rows if r["policy"] == "ar" and r["temperature"] == 0 and r["error"] is None]
    ar_steps = sum(r["steps"] for r in ar_greedy)
    setup = {"machine": current_hardware(loaded.device, loaded.dtype, quantize=loaded.quantize).machine, "device": str(loaded.device),
             "dtype": str(loaded.dtype).removeprefix("torch."), "activations": loaded.activations, "threads": threads,
             "draft vocabulary": stack.draft_vocab_size or "full", "weights MB": round(weight_bytes / 1e6),
             "weights read once (ms)": round(1e3 * floor_s, 2),
             "read GB/s": round(weight_bytes / floor_s / 1e9, 1)}
    if ar_steps:
        ar_step = sum(r["decode_s"] for r in ar_greedy) / ar_steps
        setup["AR step (ms)"] = round(1e3 * ar_step, 2)
        setup["AR step / weight read"] = round(ar_step / floor_s, 2)
    for name, decoder in bench.decoders.items():  # where each adaptive policy's step costs came from
        if decoder.costs:
            setup[name] = decoder.costs
    report = write_report([output / "rows"], output, setup)
    print(throughput_tables(report), flush=True)
    if bank is not None:
        print(f"\nbank {bank_path}: {selection_report(bank)}", flush=True)
    differs = sorted({(r["id"], r["policy"]) for r in rows if r["matches_ar"] == "differs"})
    ties = sorted({(r["id"], r["policy"]) for r in rows if r["matches_ar"] == "tie"})
    if ties:
        print(f"greedy outputs that leave AR's at a float tie: {ties}", file=sys.stderr)
    if differs:
        print(f"error: greedy output differs from AR's (not a float tie): {differs}", file=sys.stderr)
    print(json.dumps({"output": str(output.resolve()), "report": str((output / "report.md").resolve()),
                      "systems": systems, "prompts": len(prompts), "rows": len(rows), "ties": len(ties),
                      "differs": len(differs), "seconds": round(time.time() - started, 1)}), flush=True)
    return 1 if differs else 0


def throughput_main(args) -> int:
    """--concurrent-requests: the K table (bench/throughput.py)."""
    try:
        model_cfg = config_from_args(ModelConfig, args)
        ks = list(dict.fromkeys(args.concurrent_requests))
        if min(ks) < 1 or args.repeats < 1:
            raise ValueError("--concurrent-requests and --repeats must be >= 1")
        systems = list(dict.fromkeys(args.systems or ["ar", "entmtp-tau", "hf-generate"] +
                                     (["llama-cpp"] if importlib.util.find_spec("llama_cpp") else [])))
        unknown = [s for s in systems if s not in THROUGHPUT_OURS + THROUGHPUT_BASELINES]
        if unknown:
            raise ValueError(f"throughput mode runs {', '.join(THROUGHPUT_OURS + THROUGHPUT_BASELINES)}; not {unknown}")
        if "ar" not in systems:
            systems.insert(0, "ar")  # the reference of the greedy checks and ratios
        choose_systems([s for s in systems if s in SYSTEMS], model_cfg.model, None)  # llama-cpp's checks
        depth, name = available_depth(model_cfg.model, model_cfg.heads), Path(model_cfg.model).name
        banks = {}
        if any(s.startswith("entmtp") for s in systems):
            default = bench_bank(model_cfg, args.task, args.bank)
            if default is None:
                raise no_bank_error(model_cfg.model)
            banks = {k: (load_bank(default, depth, name), str(default)) for k in ks}
            for spec in args.bank_at:
                k, sep, file = spec.partition("=")
                if not sep or not k.isdigit() or int(k) not in ks:
                    raise ValueError(f"--bank-at {spec}: write K=FILE with K one of --concurrent-requests {ks}")
                banks[int(k)] = (load_bank(file, depth, name), file)
        subset = args.subset or ("eval" if args.task else "all")
        table = load_prompts(args.task, args.dataset, args.split, args.prompt_column, args.id_column,
                             args.messages_column, args.limit, args.seed, subset)
    except (ValueError, ValidationError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    stack = load_stack(model_cfg, with_heads=bool(banks))
    loaded = stack.loaded
    prompts = []
    for row in table.select(["id", "prompt", "_messages", "_input_error"]).to_pylist():
        if row["_input_error"]:
            continue
        try:
            ids = encode_checked(loaded, json.loads(row["_messages"]) if row["_messages"] else row["prompt"],
                                 args.max_input_tokens)
        except ValueError:
            continue
        prompts.append(Prompt(row["id"], row["prompt"], ids))
    cfg = DecodingConfig(task=args.task, max_new_tokens=args.max_new_tokens, seed=args.seed)
    decoders, used = {}, {}
    for system in systems:
        for k in ks:
            if system == "ar":
                decoders[system, k] = decoders.get(("ar", ks[0])) or stack.decoder(build_policy(cfg.model_copy(
                    update={"policy": "ar"}), None))
            elif system in THROUGHPUT_OURS:
                bank, label = banks[k]
                decoders[system, k] = stack.decoder(build_policy(cfg.model_copy(update={"policy": system}), bank))
                used[f"{system} K={k}"] = str(label)
                if bank.hardware.concurrency != k:
                    print(f"note: {system} at K={k} runs bank {label}, timed at K={bank.hardware.concurrency}; "
                          f"--bank-at {k}=FILE gives it a bank timed at {k}", file=sys.stderr)
    baselines = {}
    if "hf-generate" in systems:
        baselines["hf-generate"] = HFStatic(loaded)
    if "hf-continuous" in systems:
        baselines["hf-continuous"] = HFContinuous(loaded)
    if "llama-cpp" in systems:
        baselines["llama-cpp"] = LlamaCppOne(loaded, threads, args.seed)
    started = time.time()
    outcomes = run_all(systems, decoders, baselines, prompts, ks, cfg, args.repeats)
    greedy = check_greedy(loaded, prompts, outcomes)
    lines = summarize(outcomes, greedy)
    setup = {"machine": current_hardware(loaded.device, loaded.dtype, quantize=loaded.quantize).machine, "device": str(loaded.device),
             "dtype": str(loaded.dtype).removeprefix("torch."), "activations": loaded.activations, "threads": threads,
             "prompts": len(prompts),
             "max new tokens": args.max_new_tokens, "repeats": args.repeats}
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    text = throughput_markdown(lines, setup)
    (output / "throughput.md").write_text(text)
    (output / "throughput.json").write_text(json.dumps({"setup": setup, "banks": used, "lines": lines,
                                                         "passes": [o.__dict__ for o in outcomes]}, indent=1))
    print(text, flush=True)
    differs = [f"{line['system']} K={line['k']}" for line in lines if line["greedy"] and line["greedy"]["differs"]]
    if differs:
        print(f"error: greedy outputs differ from AR's (not a float tie): {differs}", file=sys.stderr)
    print(json.dumps({"output": str(output.resolve()), "systems": systems, "k": ks, "prompts": len(prompts),
                      "differs": differs, "seconds": round(time.time() - started, 1)}), flush=True)
    return 1 if differs else 0


if __name__ == "__main__":
    sys.exit(main())
