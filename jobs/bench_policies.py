"""Every decoding policy and the baselines side by side on a task's held-out prompts, one process, no Ray.

    python jobs/bench_policies.py --task gsm8k --prompts 8 --temperatures 0 0.7 --out runs/bench-gsm8k.json

Systems: our policies (`ar`, `hydra`, `medusa`, `entmtp-*`), transformers `generate` on the same
weights (`hf-generate`), and, when `llama-cpp-python` is installed (`pip install llama-cpp-python`,
a ~15-minute compile), llama.cpp on the embedded model's own GGUF with the same thread count
(`llama-cpp`; that file is Q4_1-quantised, so its tokens differ and are not compared).
For each prompt the systems run back to back in a rotating order (the machine's noise falls on all
of them alike), after one untimed warm-up each. Prompts come from the task's `eval` subset, which
neither the heads nor the bank saw. Reported per (temperature, policy): output tokens/s with the
prefill inside the timed region (pooled, and the median per-prompt ratio to AR), mean accepted
length tau, mean nodes per step, tree switches per 100 tokens, and the scheduler's share of a step
(the policy's choose/observe plus the verifier statistics its signal reads). At T=0 every policy's
tokens are compared with AR's (llama.cpp's excepted); a difference fails the run unless, at its first
token, the two candidates' logits are a float tie (2 units in the last place in bf16, where a tree's
multi-row attention rounds differently from a one-token step's), which is reported.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from entmtp_ray.banks import current_hardware, load_bank, resolve_bank_path, warn_if_other_hardware  # noqa: E402
from entmtp_ray.cli import add_model_args, model_config_from_args, quiet_logging  # noqa: E402
from entmtp_ray.config import DecodingConfig  # noqa: E402
from entmtp_ray.decoding import HydraDrafter, SpecDecoder, row_generator  # noqa: E402
from entmtp_ray.evaluation import default_dataset  # noqa: E402
from entmtp_ray.loading import (  # noqa: E402
    EMBEDDED_MODEL,
    available_depth,
    draft_vocab_for,
    embedded_source,
    load_model,
    load_model_heads,
)
from entmtp_ray.policy import make_policy  # noqa: E402
from entmtp_ray.tasks import TASKS, load_prompts  # noqa: E402

POLICIES = ("ar", "hydra", "medusa", "entmtp-star", "entmtp-ladder", "entmtp-tau")
BASELINES = ("hf-generate", "llama-cpp")


class HFGenerate:
    """transformers `generate` on the loaded weights: greedy, or plain sampling at the temperature."""

    def __init__(self, loaded):
        self.loaded = loaded

    def run(self, ids: list[int], cfg: DecodingConfig, seed: int) -> dict:
        torch.manual_seed(seed)
        sampling = {"do_sample": True, "temperature": cfg.temperature, "top_k": 0, "top_p": 1.0} \
            if cfg.temperature > 0 else {"do_sample": False}
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.loaded.model.generate(torch.tensor([ids]), max_new_tokens=cfg.max_new_tokens,
                                             eos_token_id=sorted(self.loaded.eos_token_ids), **sampling)
        seconds = time.perf_counter() - start
        return _one_token_steps(out[0, len(ids):].tolist(), seconds)


class LlamaCpp:
    """llama.cpp (llama-cpp-python) on the embedded model's GGUF, as its own decoder and sampler."""

    def __init__(self, threads: int, eos: frozenset[int], seed: int):
        from llama_cpp import Llama

        self.llm = Llama(model_path=str(embedded_source()), n_threads=threads, n_threads_batch=threads,
                         n_ctx=4096, seed=seed, verbose=False)
        self.eos = eos

    def run(self, ids: list[int], cfg: DecodingConfig, seed: int) -> dict:
        self.llm.set_seed(seed)
        out = []
        start = time.perf_counter()
        for token in self.llm.generate(ids, temp=cfg.temperature, top_k=0, top_p=1.0, min_p=0.0,
                                       repeat_penalty=1.0, reset=True):
            out.append(token)
            if token in self.eos or len(out) >= cfg.max_new_tokens:
                break
        return _one_token_steps(out, time.perf_counter() - start)


def first_difference_is_tie(loaded, ids: list[int], got: list[int], want: list[int]) -> bool:
    """Whether the first token where `got` leaves `want` is a float tie: the model's two logits for
    them, after the shared prefix, within 2 units in the last place of its dtype (1e-4 in fp32)."""
    i = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if i is None:
        return False  # one output is a prefix of the other: a stopping difference, no tie
    with torch.inference_mode():
        logits = loaded.model(torch.tensor([ids + want[:i]])).logits[0, -1].float()  # [V]
    top = float(logits.max())
    tolerance = max(1e-4, 2 * torch.finfo(loaded.dtype).eps * abs(top))
    return abs(float(logits[got[i]] - logits[want[i]])) <= tolerance and float(logits[want[i]]) >= top - tolerance


def weight_read_seconds(loaded, repeats: int = 7) -> tuple[int, float]:
    """Bytes of the model's weights (tied ones once) and the median seconds to read them all once at
    this thread count: the memory floor of one AR step, which must stream every weight."""
    params = list(loaded.model.parameters())
    times = []
    with torch.inference_mode():
        for _ in range(repeats):
            start = time.perf_counter()
            for param in params:
                param.sum()
            times.append(time.perf_counter() - start)
    return sum(p.numel() * p.element_size() for p in params), statistics.median(times)


def _one_token_steps(tokens: list[int], seconds: float) -> dict:
    """A baseline's run in the record shape of ours: every token after the first is one step."""
    steps = max(0, len(tokens) - 1)
    return {"output": tokens, "tokens": len(tokens), "seconds": seconds, "decode_s": seconds, "schedule_s": 0.0,
            "steps": steps, "nodes": steps, "switches": 0, "usage": {}}


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
        "tree_usage": dict(sum((Counter(r["usage"]) for r in runs), Counter())),
    }


def table(report: dict) -> str:
    lines = [f"weights {report['weight_bytes'] / 1e6:.0f} MB, read once in {report['floor_ms']:.1f} ms "
             f"({report['read_gb_per_s']:.1f} GB/s)" + (f"; AR step {report['ar_step_ms']:.1f} ms = "
                                                        f"{report['ar_step_over_floor']:.2f}x that floor"
                                                        if "ar_step_ms" in report else "")]
    for temperature, rows in report["results"].items():
        lines += [f"\n{report['task']}, T={temperature} ({rows['ar']['prompts']} prompts, "
                  f"{report['max_new_tokens']} new tokens)",
                  "| system | nodes/step | tau | tokens/s | x AR | x AR (median prompt) | switches/100 tok | scheduler |",
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
    p.add_argument("--systems", nargs="+", default=None, choices=POLICIES + BASELINES,
                   help="default: all (llama-cpp only when llama-cpp-python is installed)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (match the bank's)")
    p.add_argument("--out", default=None, help="write the JSON report here")
    add_model_args(p)
    args = p.parse_args(argv)
    quiet_logging()
    torch.set_num_threads(args.threads)
    if args.systems is None:
        args.systems = list(POLICIES) + ["hf-generate"]
        if importlib.util.find_spec("llama_cpp") is not None and args.model == EMBEDDED_MODEL:
            args.systems.append("llama-cpp")
    if "ar" not in args.systems:
        args.systems.insert(0, "ar")
    if "llama-cpp" in args.systems and args.model != EMBEDDED_MODEL:
        p.error("--systems llama-cpp runs the embedded model's GGUF only; drop it for --model " + args.model)

    model_cfg = model_config_from_args(args)
    bank_path = resolve_bank_path(model_cfg.model, args.task, args.bank)
    bank = load_bank(bank_path, available_depth(model_cfg.model, model_cfg.heads), Path(model_cfg.model).name)
    loaded = load_model(model_cfg.model, model_cfg.dtype, model_cfg.device, model_cfg.chat_format)
    warn_if_other_hardware(bank, current_hardware(loaded.device, loaded.dtype), bank_path)
    vocab = draft_vocab_for(model_cfg.model, model_cfg.heads, model_cfg.draft_vocab)
    drafter = HydraDrafter(load_model_heads(loaded, model_cfg.heads), loaded.model, vocab)
    policies = [name for name in args.systems if name in POLICIES]
    decoders = {name: SpecDecoder(loaded, drafter, make_policy(DecodingConfig(policy=name, task=args.task), bank))
                for name in policies}
    baselines = {}
    if "hf-generate" in args.systems:
        baselines["hf-generate"] = HFGenerate(loaded)
    if "llama-cpp" in args.systems:
        baselines["llama-cpp"] = LlamaCpp(args.threads, loaded.eos_token_ids, args.seed)

    def run(name: str, row_id: str, ids: list[int], cfg: DecodingConfig) -> dict:
        generator = row_generator(cfg.seed, row_id, loaded.device)
        if name in baselines:
            return baselines[name].run(ids, cfg, int(generator.initial_seed() % 2**31))
        result = decoders[name].generate(ids, cfg, generator)
        return {"output": result.output_token_ids, "tokens": result.num_output_tokens, "seconds": result.total_s,
                "decode_s": result.decode_s, "schedule_s": result.schedule_s, "steps": len(result.steps),
                "nodes": sum(s.nodes for s in result.steps), "switches": result.tree_switches(),
                "usage": result.tree_usage()}

    dataset = args.dataset or default_dataset(args.task)
    prompts = load_prompts(args.task, dataset, split=args.split, limit=args.prompts, seed=args.seed, subset="eval")
    limit = DecodingConfig().max_input_tokens
    encoded = [(row["id"], loaded.encode_prompt(row["prompt"])) for row in prompts.to_pylist()]
    skipped = [row_id for row_id, ids in encoded if len(ids) > limit]
    encoded = [(row_id, ids) for row_id, ids in encoded if len(ids) <= limit]

    report = {"task": args.task, "bank": str(bank_path), "max_new_tokens": args.max_new_tokens,
              "threads": args.threads, "draft_vocab": len(vocab) if vocab else 0, "hardware": current_hardware(loaded.device, loaded.dtype).model_dump(),
              "skipped_over_input_limit": skipped, "mismatches": [], "ties": [],
              "results": {}}
    weight_bytes, floor_s = weight_read_seconds(loaded)
    report.update(weight_bytes=weight_bytes, floor_ms=1e3 * floor_s, read_gb_per_s=weight_bytes / floor_s / 1e9)
    for temperature in args.temperatures:
        cfg = DecodingConfig(max_new_tokens=args.max_new_tokens, temperature=temperature, seed=args.seed,
                             acceptance="typical" if temperature > 0 else "greedy")
        warm = cfg.model_copy(update={"max_new_tokens": 16})
        for name in args.systems:
            run(name, "warmup", encoded[0][1], warm)
        runs: dict[str, list[dict]] = {name: [] for name in args.systems}
        for k, (row_id, ids) in enumerate(encoded):
            order = args.systems[k % len(args.systems):] + args.systems[: k % len(args.systems)]
            outputs = {}
            for name in order:
                record = run(name, row_id, ids, cfg)
                outputs[name] = record.pop("output")
                runs[name].append({"id": row_id, **record})
            if temperature == 0:
                for n, out in outputs.items():
                    if out == outputs["ar"] or n == "llama-cpp":
                        continue
                    tie = first_difference_is_tie(loaded, ids, out, outputs["ar"])
                    report["ties" if tie else "mismatches"].append({"id": row_id, "system": n})
            print(f"T={temperature} prompt {k + 1}/{len(encoded)} done", file=sys.stderr)
        ar_rate = {r["id"]: r["tokens"] / r["seconds"] for r in runs["ar"]}
        if temperature == 0:
            ar_step = sum(r["decode_s"] for r in runs["ar"]) / sum(r["steps"] for r in runs["ar"])
            report["ar_step_ms"] = 1e3 * ar_step
            report["ar_step_over_floor"] = ar_step / floor_s
        report["results"][str(temperature)] = {name: summarize(runs[name], ar_rate) for name in args.systems}
    print(table(report))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    if report["ties"]:
        print(f"greedy outputs that leave AR's at a float tie: {report['ties']}", file=sys.stderr)
    if report["mismatches"]:
        print(f"greedy output differs from AR: {report['mismatches']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
