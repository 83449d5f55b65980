"""A shipped bank re-timed on this machine: every tree's step cost measured anew, its tokens/s and the star chosen again
from the bank's own accepted lengths (what the heads accept under each tree, which no change of the step moves).

For a bank whose step costs a change of the step made stale (issue 51: the native step on GGUF blocks made a
one-token step cheaper and each tree row dearer on the AVX2 EPYC the cpu-fp32 banks were timed on), without the
rollouts behind it: each tree's tau stays the bank's (the replay of its calibration rollouts), its tokens/s becomes
tau / the step measured here (`pipeline.calibration.step_seconds`: every tree back to back per prompt, rotated,
median over prompts), and the star is the smallest tree within `MEASURED_TOLERANCE` of the fastest, as measured
selection picks it (`sweep.select_measured`). A switching pair, which a replay of the rollouts chose, is dropped
(entmtp-tau runs the star) unless it already ran the star; the bank's `selection` says so. Rebuilding the bank
(jobs/build_bank.py) is the full way.

    .venv/bin/python tools/retime_bank.py --bank entmtp_ray/assets/banks/smollm2-135m-instruct/cpu-fp32/gsm8k.json \\
        --threads 2 --out entmtp_ray/assets/banks/smollm2-135m-instruct/cpu-fp32/gsm8k.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import tempfile
from pathlib import Path

import torch

from entmtp_ray.calibrate.bank import Selection, current_hardware, load_bank, save_bank
from entmtp_ray.calibrate.sweep import select_measured, with_star
from entmtp_ray.config import DecodingConfig, ModelConfig
from entmtp_ray.pipeline.calibration import step_seconds
from entmtp_ray.pipeline.assemble import resolve
from entmtp_ray.pipeline.engine import Engine


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bank", required=True)
    parser.add_argument("--out", required=True, help="the re-timed bank (may be --bank itself)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", default=None, help="the bank's model (default: the embedded one)")
    parser.add_argument("--heads", default=None, help="its heads (default: the shipped ones)")
    parser.add_argument("--dtype", default="fp32", choices=["auto", "fp32", "bf16", "fp16"])
    parser.add_argument("--activations", default="auto", choices=["auto", "float", "int8"],
                        help="the CPU products' inputs (the job's --activations; auto follows --dtype as a job's does)")
    parser.add_argument("--prompts-file", default="examples/bench_prompts.jsonl",
                        help="prompts the steps are timed on (their length, not their content, sets a step's cost)")
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=48)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    bank = load_bank(args.bank)
    with open(args.prompts_file) as f:
        prompts = [json.loads(line)["prompt"] for line in f if line.strip()][: args.prompts]
    model = ModelConfig(dtype=args.dtype, activations=args.activations,
                        **{k: v for k, v in (("model", args.model), ("heads", args.heads)) if v})
    engine = Engine(model, resolve(model, DecodingConfig(policy="hydra", max_new_tokens=args.new_tokens)))
    trees = {t.name: bank.topology(t.name) for t in bank.trees}
    with tempfile.TemporaryDirectory() as work:
        seconds, _ = step_seconds(engine, trees, prompts, args.new_tokens, Path(work))
    old = {t.name: t.tokens_per_s for t in bank.trees}
    retimed = [t.model_copy(update={"tokens_per_s": t.tau / seconds[t.name]}) for t in bank.trees]
    fixed = {t.name: t.tokens_per_s for t in retimed}
    star, _ = select_measured(fixed, {t.name: t.nodes for t in retimed}, None)
    pair_ran_star = all(p.conservative == p.aggressive == bank.policy.star for p in bank.policy.signals.values())
    policy = with_star(bank.policy, star, keep_pair=False)
    figures = ", ".join(f"{n} {1000 * seconds[n]:.1f} ms {fixed[n]:.1f} tok/s" for n in sorted(
        fixed, key=lambda n: -fixed[n])[:5])
    reason = (f"re-timed {datetime.date.today().isoformat()} on {current_hardware('cpu', engine.loaded.dtype).machine} "
              f"(tools/retime_bank.py, {args.threads} threads): each tree's tau from the bank's calibration replay over "
              f"its step measured here; star {star}, the smallest within tolerance of the fastest ({figures}); "
              + ("entmtp-tau runs the star as before" if pair_ran_star else
                 f"the switching pair dropped (replayed on the old costs); was star {bank.policy.star}"))
    selection = Selection(by="replay", held_out=0, candidates=[], reason=reason)
    hardware = current_hardware(engine.loaded.device, engine.loaded.dtype, 1, engine.loaded.quantize,
                                engine.loaded.activations)
    hardware = hardware.model_copy(update={"threads": args.threads})
    out = bank.model_copy(update={"trees": retimed, "policy": policy, "selection": selection, "hardware": hardware})
    save_bank(out, args.out)
    for t in retimed:
        print(f"{t.name:<16} {t.nodes:>3} nodes  tau {t.tau:.2f}  {1000 * seconds[t.name]:7.1f} ms/step  "
              f"{t.tokens_per_s:6.1f} tok/s (was {old[t.name]:.1f})")
    print(reason)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
