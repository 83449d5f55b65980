"""Engine micro-benchmark on one machine (no Ray): same-code AR vs transformers `generate`, the
per-step cost of each phase of the decode loop, and the cost of verifying n tree nodes.

    python tools/bench_engine.py --prompts-file examples/bench_prompts.jsonl --repeats 3
    python tools/bench_engine.py --dtype bf16 --threads 2 --trees ar gsm8k-n5 hydra --bank banks/smollm2-135m-instruct/gsm8k.json
    python tools/bench_engine.py --dtype bf16 --threads 2 --quantize none int8 int4 --trees ar gsm8k-n3 gsm8k-n5 \
        --bank entmtp_ray/assets/banks/smollm2-135m-instruct/gsm8k.json   # verify cost per tree under each scheme
    python tools/bench_engine.py --threads 2 --tree-costs --llama-cpp   # verify ms by tree size, ours beside llama.cpp's

Everything is measured side by side in one process, interleaved per prompt, medians over
repeats. The last stdout line is a JSON summary.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections import defaultdict

import torch

from entmtp_ray.calibrate.bank import build_policy, load_bank
from entmtp_ray.config import DecodingConfig, ModelConfig
from entmtp_ray.decode.loop import SpecDecoder, profiled
from entmtp_ray.decode.results import PHASES
from entmtp_ray.decode.policy import FixedTree
from entmtp_ray.decode.tree import Topology, build_buffers, load_topology, make_topology
from entmtp_ray.decode.verify import Tree
from entmtp_ray.bench.compare import weight_read_seconds
from entmtp_ray.model.attention import sdpa_only, uses_fixed_order
from entmtp_ray.model.kernels import quantize_model
from entmtp_ray.model.loading import embedded_source, synchronize
from entmtp_ray.model.quant import SCHEMES
from entmtp_ray.pipeline.assemble import load_stack


def hf_generate_tps(loaded, ids, max_new):
    inputs = torch.tensor([ids], device=loaded.device)
    synchronize(loaded.device)
    start = time.perf_counter()
    out = loaded.model.generate(inputs, do_sample=False, max_new_tokens=max_new)
    synchronize(loaded.device)
    return (out.shape[1] - len(ids)) / (time.perf_counter() - start)


def ar_vs_generate(loaded, prompts, max_new, repeats):
    cfg = DecodingConfig(policy="ar", max_new_tokens=max_new)
    decoder = SpecDecoder(loaded, None, FixedTree("ar", load_topology("ar")))
    ours, hf = [], []
    for _ in range(repeats):
        for ids in prompts:
            ours.append(decoder.generate(ids, cfg).tokens_per_s)
            hf.append(hf_generate_tps(loaded, ids, max_new))
    return statistics.median(ours), statistics.median(hf)


def step_breakdown(loaded, drafter, prompts, max_new, tree: Topology) -> dict[str, float]:
    """Mean ms per step of each phase of the decode loop (PHASES: choose, draft, verify, accept, commit,
    observe), from the decoder's own profile, plus the whole step as generate timed it."""
    decoder = SpecDecoder(loaded, drafter if tree.depth > 0 else None, FixedTree(tree.name, tree))
    decoder.generate(prompts[0], DecodingConfig(policy="ar", max_new_tokens=8))  # warm-up
    cfg = DecodingConfig(policy="ar", max_new_tokens=max_new)
    profiler = profiled(decoder)
    steps, decode_s, parts = 0, 0.0, defaultdict(float)
    for ids in prompts:
        result = profiler.generate(ids, cfg)
        steps += len(result.steps)
        decode_s += result.decode_s
        for step in result.steps:
            for phase, seconds in step.seconds.items():
                parts[phase] += seconds
    per_step = {phase: 1e3 * parts[phase] / steps for phase in PHASES}
    per_step["step_total"] = 1e3 * decode_s / steps
    return per_step


def verify_cost(loaded, prompt_ids, trees: dict[str, Topology], repeats: int = 10) -> dict[str, float]:
    """Median ms of one verification of each tree (the forward and the scored nodes' logits) through a decoder's
    verifier, as a step runs it (`seam_costs`), after `prompt_ids`."""
    return seam_costs(SpecDecoder(loaded, None, FixedTree("ar", load_topology("ar"))), prompt_ids, trees, repeats)


TREE_SIZES = (1, 2, 4, 8, 16, 64)


def sized_trees(sizes=TREE_SIZES) -> dict[int, Topology]:
    """A tree of each size: the one-node tree, and the first n - 1 paths of Hydra's 64-node tree (prefix closed)."""
    hydra = load_topology("hydra")
    return {n: load_topology("ar") if n == 1 else make_topology(hydra.paths[:n - 1], f"hydra{n}") for n in sizes}


def seam_costs(decoder: SpecDecoder, prompt_ids: list[int], trees: dict, repeats: int) -> dict:
    """Median ms of one verify of each tree (by its key in `trees`) through the decoder's verifier (the forward
    and the scored nodes' logits, as a step runs it), the prompt committed; nothing is kept, so every repeat sees
    the same prefix."""
    loaded = decoder.loaded
    room = max(t.num_nodes for t in trees.values())  # the largest tree's rows
    with torch.inference_mode():
        request = decoder.prefill(prompt_ids, DecodingConfig(policy="ar", max_new_tokens=room))
        costs = {}
        for key, topology in trees.items():
            buffers = build_buffers(topology, loaded.device, decoder.leaf_logits_for(topology))
            tokens = torch.randint(0, loaded.model.config.vocab_size, (buffers.num_nodes,), device=loaded.device)
            tree = Tree(decoder.cache, buffers, tokens, request.plan)
            decoder.verifier([tree])  # lazy inits
            times = []
            for _ in range(repeats):
                synchronize(loaded.device)
                start = time.perf_counter()
                decoder.verifier([tree])
                synchronize(loaded.device)
                times.append(time.perf_counter() - start)
            costs[key] = 1e3 * statistics.median(times)
    return costs


class LlamaCppRows:
    """llama.cpp's decode of n new tokens after a committed prompt, logits on for every row (as a tree verify
    needs them), through llama-cpp-python's own batch and context objects (pinned 0.3.36: `_batch`, `_ctx`). The n
    tokens run as one causal sequence: a tree's mask changes which keys each row sees, not the products' rows."""

    def __init__(self, threads: int, prompt_ids: list[int]):
        from llama_cpp import Llama

        self.llm = Llama(model_path=str(embedded_source()), n_threads=threads, n_threads_batch=threads, n_ctx=2048,
                         n_batch=512, logits_all=True, verbose=False)
        self.llm.eval(prompt_ids)
        self.committed = self.llm.n_tokens

    def cost(self, n: int, repeats: int) -> float:
        llm, times = self.llm, []
        tokens = torch.randint(0, llm.n_vocab(), (n,)).tolist()
        for _ in range(repeats + 1):  # the first: lazy inits
            llm._batch.set_batch(batch=tokens, n_past=self.committed, logits_all=True)
            start = time.perf_counter()
            llm._ctx.decode(llm._batch)
            times.append(time.perf_counter() - start)
            llm._ctx.kv_cache_seq_rm(-1, self.committed, -1)
        return 1e3 * statistics.median(times[1:])


def tree_costs(stack, prompt_ids: list[int], with_llama_cpp: bool, repeats: int) -> int:
    """Print (and end with a JSON line of) verify ms by tree size through our verifier, and llama.cpp's decode of
    as many rows beside it: rounds of both in turn, medians over the rounds; with the weight-read floor."""
    loaded, trees = stack.loaded, sized_trees()
    decoder = SpecDecoder(loaded, None, FixedTree("ar", load_topology("ar")))
    peer = LlamaCppRows(torch.get_num_threads(), prompt_ids) if with_llama_cpp else None
    rounds = defaultdict(list)
    for _ in range(repeats):
        for n, ms in seam_costs(decoder, prompt_ids, trees, 5).items():
            rounds["ours", n].append(ms)
        if peer is not None:
            for n in trees:
                rounds["llama.cpp", n].append(peer.cost(n, 5))
    systems = ["ours"] + (["llama.cpp"] if peer is not None else [])
    costs = {system: {n: statistics.median(rounds[system, n]) for n in trees} for system in systems}
    weight_bytes, floor_s = weight_read_seconds(loaded)
    print(f"weights {weight_bytes / 1e6:.0f} MB read once in {1e3 * floor_s:.2f} ms "
          f"({weight_bytes / floor_s / 1e9:.1f} GB/s): one-token verify {costs['ours'][1] / (1e3 * floor_s):.2f}x it")
    print("| system | n=1 ms | " + " | ".join(f"n={n}" for n in list(trees)[1:]) + " |")
    print("|---|---:|" + "---:|" * (len(trees) - 1))
    for system in systems:
        one = costs[system][1]
        print(f"| {system} | {one:.2f} | " + " | ".join(f"{costs[system][n] / one:.2f}x" for n in list(trees)[1:])
              + " |")
    print(json.dumps({"verify_ms": costs, "weight_bytes": weight_bytes, "weight_read_ms": 1e3 * floor_s,
                      "dtype": str(loaded.dtype).removeprefix("torch."), "activations": loaded.activations,
                      "threads": torch.get_num_threads(),
                      "repeats": repeats}))
    return 0


def attention_costs(stack, prompts: list[list[int]], repeats: int, policy=None, max_new_tokens: int = 128) -> int:
    """Print (and end with a JSON line of) verify ms by tree size with SDPA and with the fixed-order attention
    (model/attention.py), after each prompt: rounds of both in turn, medians over the rounds; with `policy` (a
    bank's entmtp-tau), also its decode speed with each (policy_speeds)."""
    loaded = stack.loaded
    with torch.inference_mode():  # as a verify runs
        serves = uses_fixed_order(torch.zeros(1, dtype=loaded.dtype, device=loaded.device))
    if not serves:
        print(f"error: the fixed-order attention does not serve {loaded.dtype} on {loaded.device.type} here (it "
              "needs CPU, fp32/bf16/fp16 and a built kernel: `python -m entmtp_ray.model.native` builds it or says "
              "why not; unset ENTMTP_FIXED_ORDER_ATTENTION=0)", file=sys.stderr)
        return 2
    trees = sized_trees((1, 4, 8, 16, 64))
    decoder = SpecDecoder(loaded, None, FixedTree("ar", load_topology("ar")))
    costs = {}
    print("| prefix | attention | " + " | ".join(f"n={n} ms" for n in trees) + " |")
    print("|---:|---|" + "---:|" * len(trees))
    for ids in prompts:
        rounds = defaultdict(list)
        for _ in range(repeats):
            with sdpa_only():
                rounds["sdpa"].append(seam_costs(decoder, ids, trees, 5))
            rounds["fixed-order"].append(seam_costs(decoder, ids, trees, 5))
        costs[len(ids)] = {name: {n: statistics.median(r[n] for r in rs) for n in trees} for name, rs in rounds.items()}
        for name, by_size in costs[len(ids)].items():
            print(f"| {len(ids)} | {name} | " + " | ".join(f"{ms:.2f}" for ms in by_size.values()) + " |")
    summary = {"verify_ms": costs, "dtype": str(loaded.dtype).removeprefix("torch."), "activations": loaded.activations,
               "threads": torch.get_num_threads(), "repeats": repeats}
    if policy is not None:
        summary["policy"] = policy_speeds(stack, policy, prompts, max_new_tokens, repeats)
    print(json.dumps(summary))
    return 0


def policy_speeds(stack, policy, prompts: list[list[int]], max_new_tokens: int, repeats: int) -> dict:
    """Greedy decodes of every prompt by `policy` and by AR with SDPA and with the fixed-order attention, in turn
    (`repeats` rounds): each attention's median tokens/s of the policy, and how many of its outputs equal AR's
    with the same attention (the fixed-order one: every one)."""
    decoders = {"policy": stack.decoder(policy), "ar": stack.decoder(FixedTree("ar", load_topology("ar")))}
    cfg = DecodingConfig(policy="ar", max_new_tokens=max_new_tokens)
    speeds, outputs = defaultdict(list), defaultdict(dict)
    for _ in range(repeats):
        for i, ids in enumerate(prompts):
            for name in ("sdpa", "fixed-order"):
                with sdpa_only() if name == "sdpa" else contextlib.nullcontext():
                    for kind, decoder in decoders.items():
                        result = decoder.generate(ids, cfg)
                        outputs[name, kind][i] = result.output_token_ids
                        if kind == "policy":
                            speeds[name].append(result.tokens_per_s)
    report = {name: {"tokens_per_s": statistics.median(speeds[name]),
                     "equal_to_ar": sum(outputs[name, "policy"][i] == outputs[name, "ar"][i]
                                        for i in range(len(prompts))), "prompts": len(prompts)}
              for name in ("sdpa", "fixed-order")}
    ratio = report["fixed-order"]["tokens_per_s"] / report["sdpa"]["tokens_per_s"]
    print(f"{policy.name} tokens/s, medians of {repeats} x {len(prompts)} decodes of {max_new_tokens} tokens: SDPA "
          f"{report['sdpa']['tokens_per_s']:.2f}, fixed-order {report['fixed-order']['tokens_per_s']:.2f} "
          f"({ratio:.3f}x); greedy output equal to AR's with the same attention: SDPA "
          f"{report['sdpa']['equal_to_ar']}/{len(prompts)}, fixed-order {report['fixed-order']['equal_to_ar']}/"
          f"{len(prompts)}")
    return {**report, "fixed_over_sdpa": ratio, "name": policy.name}


def scheme_costs(loaded, prompt_ids, trees: dict[str, Topology], schemes: list[str], repeats: int) -> int:
    """Print (and end with a JSON line of) each tree's verify ms under each scheme: rounds of every scheme in
    turn, so that the machine's drift falls on all alike; medians over the rounds."""
    rounds = defaultdict(list)
    for _ in range(repeats):
        for scheme in schemes:
            quantize_model(loaded.model, scheme)
            verify_cost(loaded, prompt_ids, {"ar": load_topology("ar")}, 3)  # warm the new weights
            for name, cost in verify_cost(loaded, prompt_ids, trees).items():
                rounds[scheme, name].append(cost)
    costs = {scheme: {name: statistics.median(rounds[scheme, name]) for name in trees} for scheme in schemes}
    print("| tree | nodes | " + " | ".join(f"{s} ms" for s in schemes) + " | " +
          " | ".join(f"{s} / {schemes[0]}" for s in schemes[1:]) + " |")
    print("|---|---:|" + "---:|" * (2 * len(schemes) - 1))
    for name, tree in trees.items():
        row = [f"{costs[s][name]:.2f}" for s in schemes] + [f"{costs[s][name] / costs[schemes[0]][name]:.2f}"
                                                            for s in schemes[1:]]
        print(f"| {name} | {tree.num_nodes} | " + " | ".join(row) + " |")
    print(json.dumps({"verify_ms": costs, "dtype": str(loaded.dtype).removeprefix("torch."),
                      "threads": torch.get_num_threads(), "repeats": repeats}))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts-file", default="examples/bench_prompts.jsonl")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="fp32", choices=["auto", "fp32", "bf16", "fp16"])
    parser.add_argument("--activations", default="auto", choices=["auto", "float", "int8"],
                        help="the CPU products' inputs over 4-bit/Q8_0 weights (the job's --activations)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    parser.add_argument("--device", default="auto", help="cpu | cuda[:N] | auto (inputs go to the model's device, and "
                        "every clock is read after the device has finished)")
    parser.add_argument("--heads", default=None, help="heads directory (default: the shipped ones; "
                        "'untrained' = random heads)")
    parser.add_argument("--trees", nargs="+", default=["ar", "hydra"],
                        help="trees whose step is broken down: built-in names, or names in --bank")
    parser.add_argument("--bank", default=None, help="a topology bank whose tree names --trees may use")
    parser.add_argument("--quantize", nargs="+", default=None, choices=list(SCHEMES),
                        help="instead of the rest: the verify cost of each --trees tree under each weight scheme, "
                        "the schemes interleaved over --repeats rounds (medians)")
    parser.add_argument("--tree-costs", action="store_true",
                        help="instead of the rest: verify ms by tree size (1-64 nodes) through the decoder's verifier, "
                        "with the weight-read floor, over --repeats interleaved rounds")
    parser.add_argument("--attention-costs", action="store_true",
                        help="instead of the rest: verify ms by tree size (1-64 nodes) with SDPA and with the "
                        "fixed-order attention (bf16/fp16 on CPU), after every --prompts-file prompt, over --repeats "
                        "interleaved rounds; with --bank, also its entmtp-tau's greedy decodes with each (tokens/s, "
                        "output equal to AR's)")
    parser.add_argument("--llama-cpp", action="store_true",
                        help="with --tree-costs: llama.cpp's decode of as many rows on the embedded GGUF beside ours "
                        "(needs llama-cpp-python: pip install -e .[llamacpp])")
    args = parser.parse_args(argv)
    if args.llama_cpp and not args.tree_costs:
        parser.error("--llama-cpp goes with --tree-costs")
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
    stack = load_stack(ModelConfig(heads=args.heads, dtype=args.dtype, device=args.device,
                                   activations=args.activations), with_heads=True)
    loaded = stack.loaded
    with open(args.prompts_file) as f:
        prompts = [loaded.encode_prompt(json.loads(line)["prompt"]) for line in f if line.strip()]
    if args.tree_costs:
        return tree_costs(stack, prompts[0], args.llama_cpp, args.repeats)
    if args.attention_costs:
        policy = build_policy(DecodingConfig(policy="entmtp-tau"), bank) if bank else None
        return attention_costs(stack, prompts, args.repeats, policy, args.max_new_tokens)
    if args.quantize:
        trees = {name: bank.topology(name) if name in names else load_topology(name) for name in args.trees}
        return scheme_costs(loaded, prompts[0], trees, args.quantize, args.repeats)
    decoder = SpecDecoder(loaded, None, FixedTree("ar", load_topology("ar")))
    decoder.generate(prompts[0], DecodingConfig(policy="ar", max_new_tokens=16))  # warm-up
    hf_generate_tps(loaded, prompts[0], 16)

    ours, hf = ar_vs_generate(loaded, prompts, args.max_new_tokens, args.repeats)
    print(f"AR tokens/s median: ours {ours:.1f}, transformers generate {hf:.1f}, ratio {ours / hf:.2f}x")
    breakdown = {name: step_breakdown(loaded, stack.drafter, prompts[:3], args.max_new_tokens,
                                      bank.topology(name) if name in names else load_topology(name))
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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
