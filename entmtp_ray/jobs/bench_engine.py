"""Engine micro-benchmark on one machine (no Ray): same-code AR vs transformers `generate`, the
per-step cost outside the base model's forward, and the cost of verifying n tree nodes.

    python jobs/bench_engine.py --prompts-file examples/bench_prompts.jsonl --repeats 3
    python jobs/bench_engine.py --dtype bf16 --threads 2 --trees ar gsm8k-n5 hydra --bank banks/smollm2-135m-instruct/gsm8k.json

Everything is measured side by side in one process, interleaved per prompt, medians over
repeats. The last stdout line is a JSON summary.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from collections import defaultdict

import torch

from entmtp_ray.decode import loop as decoding
from entmtp_ray.calibrate.bank import load_bank
from entmtp_ray.config import DecodingConfig
from entmtp_ray.decode.loop import HydraDrafter, SpecDecoder
from entmtp_ray.model.kv_cache import KVCache
from entmtp_ray.model.llama import forward_hidden, linear
from entmtp_ray.model.loading import draft_vocab_for, load_model, load_model_heads
from entmtp_ray.decode.policy import FixedTree
from entmtp_ray.decode.tree import build_buffers, load_topology, make_topology


class Timers:
    """Wraps functions the decode loop calls and records each call's wall time."""

    def __init__(self):
        self.calls = defaultdict(list)

    def timed(self, fn, label):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            self.calls[label].append(time.perf_counter() - start)
            return out

        return timed

    def wrapped(self, obj, label):
        """`obj` (e.g. a Projection) with its calls timed and its attributes intact."""
        return _TimedObject(obj, self.timed(obj, label))

    def wrap(self, owner, name, label):
        original = getattr(owner, name)
        setattr(owner, name, self.timed(original, label))
        return original


class _TimedObject:
    def __init__(self, inner, timed_call):
        self._inner, self._call = inner, timed_call

    def __call__(self, *args, **kwargs):
        return self._call(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def hf_generate_tps(loaded, ids, max_new):
    start = time.perf_counter()
    out = loaded.model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=max_new)
    return (out.shape[1] - len(ids)) / (time.perf_counter() - start)


def ar_vs_generate(loaded, prompts, max_new, repeats):
    cfg = DecodingConfig(policy="ar", max_new_tokens=max_new)
    decoder = SpecDecoder(loaded, None, FixedTree("ar", "ar"))
    ours, hf = [], []
    for _ in range(repeats):
        for ids in prompts:
            ours.append(decoder.generate(ids, cfg).tokens_per_s)
            hf.append(hf_generate_tps(loaded, ids, max_new))
    return statistics.median(ours), statistics.median(hf)


def step_breakdown(loaded, heads, draft_vocab, prompts, max_new, name, tree):
    """Mean ms per step: base forward, lm_head, drafting, the heads' prefix layer (advance), and
    everything else. `tree`: a tree name or a Topology."""
    timers = Timers()
    prepare = decoding.prepare
    originals = [timers.wrap(decoding, "forward_hidden", "base_forward"),
                 prepare,
                 timers.wrap(HydraDrafter, "draft", "draft"),
                 timers.wrap(HydraDrafter, "advance", "advance")]
    # the decoder calls the lm_head through its plan: time the plan's
    def timed_prepare(model):
        plan = prepare(model)
        return dataclasses.replace(plan, lm_head=timers.wrapped(plan.lm_head, "lm_head"))

    decoding.prepare = timed_prepare
    try:
        drafter = HydraDrafter(heads, loaded.model, draft_vocab) if name != "ar" else None
        decoder = SpecDecoder(loaded, drafter, FixedTree(name, tree))
        decoder.generate(prompts[0], DecodingConfig(policy="ar", max_new_tokens=8))  # warm-up
        cfg = DecodingConfig(policy="ar", max_new_tokens=max_new)
        steps, decode_s, parts = 0, 0.0, defaultdict(float)
        for ids in prompts:
            timers.calls.clear()
            result = decoder.generate(ids, cfg)
            steps += len(result.steps)
            decode_s += result.decode_s
            for label, calls in timers.calls.items():
                # the prefill makes the first base forward, lm_head and advance call; they are no step
                parts[label] += sum(calls[1:] if label in ("base_forward", "lm_head", "advance") else calls)
    finally:
        decoding.forward_hidden, decoding.prepare, HydraDrafter.draft, HydraDrafter.advance = originals
    per_step = {k: 1e3 * v / steps for k, v in parts.items()}
    per_step["step_total"] = 1e3 * decode_s / steps
    per_step["outside_base_forward"] = per_step["step_total"] - per_step.get("base_forward", 0.0)
    return per_step


def verify_cost(loaded, prompt_ids, trees, repeats=10):
    """Median ms of one verification (forward + scored lm_head) at a fixed committed length."""
    model = loaded.model
    cfg = model.config
    cache = KVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads,
                    len(prompt_ids) + 128, loaded.dtype, loaded.device)
    costs = {}
    with torch.inference_mode():
        ids = torch.tensor(prompt_ids)
        forward_hidden(model, cache, ids, torch.arange(len(ids)))
        cache.keep(torch.arange(len(ids)))
        for label, topology in trees.items():
            buffers = build_buffers(topology)
            tokens = torch.randint(0, cfg.vocab_size, (buffers.num_nodes,))
            positions = cache.length + buffers.depth_of
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                hidden = forward_hidden(model, cache, tokens, positions, buffers.tree_mask)
                rows = buffers.scored_nodes if buffers.num_nodes > 1 else torch.tensor([0])
                linear(hidden[rows], model.lm_head)
                times.append(time.perf_counter() - start)
            costs[label] = 1e3 * statistics.median(times)
    return costs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts-file", default="examples/bench_prompts.jsonl")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    parser.add_argument("--heads", default=None, help="heads directory (default: the shipped ones; "
                        "'untrained' = random heads)")
    parser.add_argument("--trees", nargs="+", default=["ar", "hydra"],
                        help="trees whose step is broken down: built-in names, or names in --bank")
    parser.add_argument("--bank", default=None, help="a topology bank whose tree names --trees may use")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    bank = load_bank(args.bank) if args.bank else None
    names = {t.name for t in bank.trees} if bank else set()
    for name in args.trees:  # an unknown tree fails here, before minutes of measuring
        if name not in names:
            try:
                load_topology(name)
            except (ValueError, OSError) as exc:
                parser.error(f"--trees {name}: {exc}" + ("" if bank else "; bank trees need --bank FILE"))
    loaded = load_model("smollm2-135m-instruct", dtype=args.dtype, device="cpu")
    heads = load_model_heads(loaded, args.heads)
    draft_vocab = draft_vocab_for("smollm2-135m-instruct", args.heads, None)
    with open(args.prompts_file) as f:
        prompts = [loaded.encode_prompt(json.loads(line)["prompt"]) for line in f if line.strip()]
    decoder = SpecDecoder(loaded, None, FixedTree("ar", "ar"))
    decoder.generate(prompts[0], DecodingConfig(policy="ar", max_new_tokens=16))  # warm-up
    hf_generate_tps(loaded, prompts[0], 16)

    ours, hf = ar_vs_generate(loaded, prompts, args.max_new_tokens, args.repeats)
    print(f"AR tokens/s median: ours {ours:.1f}, transformers generate {hf:.1f}, ratio {ours / hf:.2f}x")
    breakdown = {name: step_breakdown(loaded, heads, draft_vocab, prompts[:3], args.max_new_tokens, name,
                                      bank.topology(name) if name in names else name)
                 for name in args.trees}
    for tree, parts in breakdown.items():
        print(f"per-step ms ({tree}): " + ", ".join(f"{k} {v:.2f}" for k, v in parts.items()))
    hydra = load_topology("hydra")
    trees = {1: load_topology("ar"), 4: load_topology("chain3"),
             16: make_topology(hydra.paths[:15], "hydra16"), 64: hydra}
    costs = verify_cost(loaded, prompts[0], trees)
    relative = {n: costs[n] / costs[1] for n in costs}
    for n in costs:
        print(f"verify n={n}: {costs[n]:.1f} ms ({relative[n]:.2f}x n=1)")
    print(json.dumps({"ar_tokens_per_s": ours, "hf_generate_tokens_per_s": hf, "ar_over_hf": ours / hf,
                      "per_step_ms": breakdown, "verify_ms": costs, "verify_relative": relative,
                      "dtype": args.dtype, "threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()
