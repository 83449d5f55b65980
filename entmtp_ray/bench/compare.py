"""The side-by-side benchmark: our policies and the stack's baselines on the same prompts, one process.

Every system decodes every prompt at each temperature, back to back in a rotating order (the
machine's noise falls on all alike), after one untimed warm-up each. Rows are written in the
output schema (records.py) with `policy` naming the system, plus two lossless checks computed
outside the timed region: `output_nll`, the mean negative log-likelihood of the row's output under
the base model (T=1), and at T=0 `matches_ar`: equal | tie (the first differing token is a float
tie, see acceptance.greedy_up_to_tie) | differs | not compared (llama.cpp's own Q4 numerics; under --quantize,
transformers' baselines, which run the unquantized weights).
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass

import pyarrow as pa
import torch

from entmtp_ray.calibrate.bank import build_policy
from entmtp_ray.config import DecodingConfig
from entmtp_ray.decode.acceptance import greedy_up_to_tie, row_generator
from entmtp_ray.decode.results import GenerationResult, StepTrace
from entmtp_ray.model.kernels import linear, prepare
from entmtp_ray.model.kv_cache import KVCache
from entmtp_ray.model.llama import forward_hidden
from entmtp_ray.model.loading import LoadedModel, embedded_source, synchronize
from entmtp_ray.pipeline.assemble import BANK_POLICIES, Stack
from entmtp_ray.pipeline.records import OUTPUT_SCHEMA, RowContext, error_row, result_row

POLICIES = ("ar", "hydra", "medusa", "entmtp-star", "entmtp-ladder", "entmtp-tau")
BASELINES = ("hf-generate", "hf-prompt-lookup", "llama-cpp")
SYSTEMS = POLICIES + BASELINES
PROMPT_LOOKUP_TOKENS = 10  # transformers' documented setting for prompt_lookup_num_tokens
BENCH_SCHEMA = OUTPUT_SCHEMA.append(pa.field("output_nll", pa.float64())).append(pa.field("matches_ar", pa.string()))


def _baseline_result(loaded: LoadedModel, ids: list[int], tokens: list[int], seconds: float,
                     one_token_steps: bool) -> GenerationResult:
    """A baseline's run as a GenerationResult: the whole call is decode time (no prefill split);
    steps are known only for one-token decoders."""
    finish = "stop" if tokens and tokens[-1] in loaded.eos_token_ids else "length"
    steps = [StepTrace("ar", 1, 1, [], [])] * max(0, len(tokens) - 1) if one_token_steps else []
    return GenerationResult(list(ids), tokens, loaded.decode(tokens), finish, prefill_s=0.0, decode_s=seconds,
                            schedule_s=0.0, steps=steps)


class HFGenerate:
    """transformers `generate` on the loaded weights: greedy, or plain sampling at the temperature;
    with `prompt_lookup` > 0, its prompt-lookup decoding (n-gram drafts copied from the context)."""

    def __init__(self, loaded: LoadedModel, prompt_lookup: int = 0):
        self.loaded, self.prompt_lookup = loaded, prompt_lookup

    def run(self, ids: list[int], cfg: DecodingConfig, seed: int) -> GenerationResult:
        torch.manual_seed(seed)
        kwargs = {"do_sample": True, "temperature": cfg.temperature, "top_k": 0, "top_p": 1.0} \
            if cfg.temperature > 0 else {"do_sample": False}
        if self.prompt_lookup:
            kwargs["prompt_lookup_num_tokens"] = self.prompt_lookup
        inputs = torch.tensor([ids], device=self.loaded.device)
        synchronize(self.loaded.device)
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.loaded.model.generate(inputs, max_new_tokens=cfg.max_new_tokens,
                                             eos_token_id=sorted(self.loaded.eos_token_ids), **kwargs)
        synchronize(self.loaded.device)
        seconds = time.perf_counter() - start
        return _baseline_result(self.loaded, ids, out[0, len(ids):].tolist(), seconds, not self.prompt_lookup)


class LlamaCpp:
    """llama.cpp (llama-cpp-python) on the embedded model's GGUF, as its own decoder and sampler."""

    def __init__(self, loaded: LoadedModel, threads: int, seed: int):
        from llama_cpp import Llama

        self.loaded = loaded
        self.llm = Llama(model_path=str(embedded_source()), n_threads=threads, n_threads_batch=threads,
                         n_ctx=4096, seed=seed, verbose=False)

    def run(self, ids: list[int], cfg: DecodingConfig, seed: int) -> GenerationResult:
        self.llm.set_seed(seed)
        # forget the last prompt: llama-cpp-python's generate reuses the KV cache of a common prefix, which after the
        # warm-up (the first prompt, 16 tokens) skipped the first timed row's whole prefill, that our decoders pay
        self.llm.reset()
        out = []
        start = time.perf_counter()
        for token in self.llm.generate(ids, temp=cfg.temperature, top_k=0, top_p=1.0, min_p=0.0,
                                       repeat_penalty=1.0, reset=True):
            out.append(token)
            if token in self.loaded.eos_token_ids or len(out) >= cfg.max_new_tokens:
                break
        return _baseline_result(self.loaded, ids, out, time.perf_counter() - start, True)


@torch.inference_mode()
def continuation_logits(loaded: LoadedModel, ids: list[int], output: list[int]) -> torch.Tensor:
    """The base model's logits before each token of `output` after `ids`: [len(output), V], one causal forward:
    transformers' own, or for quantized weights (--quantize) ours through the same quantized products."""
    if loaded.quantize == "none":
        inputs = torch.tensor([ids + output], device=loaded.device)
        return loaded.model(inputs).logits[0, len(ids) - 1: len(ids) + len(output) - 1]
    cfg, model = loaded.model.config, loaded.model
    tokens = torch.tensor(ids + output, device=loaded.device)
    cache = KVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads,
                    len(tokens), loaded.dtype, loaded.device)
    hidden = forward_hidden(model, cache, tokens, torch.arange(len(tokens), device=loaded.device))
    return linear(hidden[len(ids) - 1: len(tokens) - 1], model.lm_head)


def same_model(system: str, loaded: LoadedModel) -> bool:
    """Whether `system` decodes the model our systems decode, so that greedy output must equal AR's: llama.cpp
    runs its own Q4 numerics, and transformers' baselines the unquantized weights when ours are --quantize'd."""
    return system != "llama-cpp" and (loaded.quantize == "none" or not system.startswith("hf-"))


def output_nll(logits: torch.Tensor, output: list[int]) -> float | None:
    """Mean negative log-likelihood (nats, T=1) of `output` from its continuation_logits."""
    if not output:
        return None
    return float(torch.nn.functional.cross_entropy(logits.float(), torch.tensor(output, device=logits.device)))


def compare_greedy(got: list[int], want: list[int], want_logits: torch.Tensor, dtype: torch.dtype) -> str:
    """equal, tie (at the first token where `got` leaves `want`, both are the model's argmax up to a
    float tie; `want_logits` are want's continuation_logits), or differs (one a strict prefix of the other too)."""
    if got == want:
        return "equal"
    i = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if i is None:
        return "differs"
    both = greedy_up_to_tie(want_logits[i].expand(2, -1), torch.tensor([got[i], want[i]], device=want_logits.device),
                            dtype)
    return "tie" if bool(both.all()) else "differs"


# below this many bytes the weights are read as one buffer copied from them; above, every tensor in place, each read
# long enough that a call's own overhead is nothing beside it (and a copy would double a 7B model's memory)
_ONE_BUFFER_BYTES = 1 << 30


def weight_read_seconds(loaded: LoadedModel, repeats: int = 7) -> tuple[int, float]:
    """Bytes of the weights a one-token step reads and the median seconds to stream them all once at this thread
    count: the memory floor of one AR step, which must read every one. The products' own copies where they hold
    one (exact GGUF blocks or quantized weights: what the step reads), else the parameter; the embedding (one row a
    token) is left out, but for the lm_head's copy when tied. Bytes are read as fp32 words (int8 sums run a far
    slower kernel than the read they stand for); a small model's as one buffer: summed tensor by tensor, the 300
    calls' own overhead doubled the time on a 2-core EPYC (7.7 against 3.3 ms for 112 MB)."""
    plan = prepare(loaded.model)
    tensors = {}
    for p in [q for layer in plan.layers for q in (layer.qkv, layer.o, layer.gate_up, layer.down)] + [plan.lm_head]:
        held = p.native or p.quantized
        for t in (held.data, held.scales) if held is not None else (p.weight,):  # packed: the same bytes
            tensors[t.data_ptr()] = t
    for norm in [n for layer in plan.layers for n in (layer.input_norm, layer.post_attention_norm)] + [plan.norm]:
        tensors[norm.weight.data_ptr()] = norm.weight
    params = [t for t in tensors.values() if t.numel()]
    total = sum(p.numel() * p.element_size() for p in params)
    with torch.inference_mode():
        if total <= _ONE_BUFFER_BYTES:
            buffer = torch.zeros(-(-total // 4) * 4, dtype=torch.uint8, device=loaded.device)
            offset = 0
            for p in params:
                size = p.numel() * p.element_size()
                buffer[offset:offset + size].copy_(p.detach().reshape(-1).view(torch.uint8))
                offset += size
            reads = [buffer.view(torch.float32)]
        else:
            reads = [t.reshape(-1).view(torch.uint8).view(torch.float32) if t.element_size() != 4 and
                     t.numel() * t.element_size() % 4 == 0 and t.is_contiguous() else t for t in params]
        times = []
        for _ in range(repeats + 1):  # the first pages a copy in
            synchronize(loaded.device)
            start = time.perf_counter()
            for read in reads:
                read.sum()
            synchronize(loaded.device)
            times.append(time.perf_counter() - start)
    return total, statistics.median(times[1:])


@dataclass
class Prompt:
    id: str
    text: str
    ids: list[int] | None  # None: the prompt cannot run (error says why)
    error: str | None = None


class Bench:
    """The systems, built once, and the interleaved run over prompts and temperatures."""

    def __init__(self, stack: Stack, systems: list[str], task: str | None, bank, model_label: str,
                 bank_label: str | None, threads: int, seed: int, other_banks: dict | None = None,
                 unadapted: bool = False):
        """`other_banks`: name -> (bank, label), each run as one more system `entmtp-tau@name` beside the rest;
        `unadapted`: each entmtp policy also without adapting to the content (--no-adapt), as `NAME@unadapted`."""
        loaded = stack.loaded
        self.labels = {"model": model_label, "heads": stack.heads_label, "bank": bank_label}
        self.decoders = {name: stack.decoder(build_policy(DecodingConfig(policy=name, task=task), bank))
                         for name in systems if name in POLICIES}
        self.bank_labels = {name: bank_label for name in systems if name in BANK_POLICIES}
        for name in [s for s in systems if s in BANK_POLICIES] if unadapted else []:
            plain = f"{name}@unadapted"
            as_given = DecodingConfig(policy=name, task=task, adapt=False)
            self.decoders[plain] = stack.decoder(build_policy(as_given, bank))
            self.bank_labels[plain] = bank_label
            systems = [*systems, plain]
        for other, (other_bank, label) in (other_banks or {}).items():
            name = f"entmtp-tau@{other}"
            self.decoders[name] = stack.decoder(build_policy(DecodingConfig(policy="entmtp-tau", task=task),
                                                             other_bank))
            self.bank_labels[name] = label
            systems = [*systems, name]
        self.loaded, self.systems, self.task = loaded, systems, task
        self.baselines = {}
        if "hf-generate" in systems:
            self.baselines["hf-generate"] = HFGenerate(loaded)
        if "hf-prompt-lookup" in systems:
            self.baselines["hf-prompt-lookup"] = HFGenerate(loaded, PROMPT_LOOKUP_TOKENS)
        if "llama-cpp" in systems:
            self.baselines["llama-cpp"] = LlamaCpp(loaded, threads, seed)
        self.max_depth = stack.max_depth

    def run_one(self, name: str, row_id: str, ids: list[int], cfg: DecodingConfig) -> GenerationResult:
        generator = row_generator(cfg.seed, row_id, self.loaded.device)
        if name in self.baselines:
            return self.baselines[name].run(ids, cfg, int(generator.initial_seed() % 2**31))
        return self.decoders[name].generate(ids, cfg, generator)

    def _context(self, name: str, prompt: Prompt, cfg: DecodingConfig) -> RowContext:
        drafts = name in self.decoders and name != "ar"
        return RowContext(id=prompt.id, prompt=prompt.text, decoding=cfg.model_copy(update={"policy": name}),
                          model=self.labels["model"], heads=self.labels["heads"] if drafts else None,
                          bank=self.bank_labels.get(name),
                          max_depth=self.max_depth if drafts else 0, started_at=time.time())

    def variants(self, temperature: float, acceptances: list[str]) -> list[tuple[str, str]]:
        """(system, acceptance) pairs run at `temperature`: at T=0 greedy only; at T>0 every system under
        the first acceptance rule and the drafting policies under each further one (AR and the baselines
        sample plainly, whatever the rule)."""
        if temperature == 0:
            return [(name, "greedy") for name in self.systems]
        out = [(name, acceptances[0]) for name in self.systems]
        return out + [(name, rule) for rule in acceptances[1:] for name in self.systems
                      if name in POLICIES and name != "ar"]

    def run(self, prompts: list[Prompt], temperatures: list[float], max_new_tokens: int, seed: int,
            acceptances: tuple[str, ...] = ("typical",), log=sys.stderr) -> list[dict]:
        rows = []
        runnable = [p for p in prompts if p.ids is not None]
        for temperature in temperatures:
            variants = self.variants(temperature, list(acceptances))
            configs = {rule: DecodingConfig(task=self.task, max_new_tokens=max_new_tokens, temperature=temperature,
                                            seed=seed, acceptance=rule) for _, rule in variants}
            for prompt in prompts:
                if prompt.ids is None:
                    rows += [{**error_row(self._context(name, prompt, configs[rule]), prompt.error),
                              "output_nll": None, "matches_ar": None} for name, rule in variants]
            if runnable:
                for name, rule in variants:
                    # a few steps of each: first-call costs (allocations, kernels, the bank's trees) out of the rows
                    warm = configs[rule].model_copy(update={"max_new_tokens": min(16, max_new_tokens)})
                    self.run_one(name, "warmup", runnable[0].ids, warm)
            for k, prompt in enumerate(runnable):
                order = variants[k % len(variants):] + variants[: k % len(variants)]
                results = {}
                for name, rule in order:
                    context = self._context(name, prompt, configs[rule])
                    try:
                        results[name, rule] = (context, self.run_one(name, prompt.id, prompt.ids, configs[rule]))
                    except (ValueError, RuntimeError) as exc:  # this row of this system only
                        results[name, rule] = (context, f"{type(exc).__name__}: {exc}")
                rows += self._rows(prompt, [(v, *results[v]) for v in variants], temperature)
                print(f"T={temperature} prompt {k + 1}/{len(runnable)} done", file=log, flush=True)
        return rows

    def _rows(self, prompt: Prompt, results: list[tuple], temperature: float) -> list[dict]:
        """Output rows of one prompt, with the lossless checks (outside every timed region)."""
        rows = []
        ar = next((result for (name, _), _, result in results if name == "ar"), None)
        want = ar.output_token_ids if isinstance(ar, GenerationResult) else None
        want_logits = continuation_logits(self.loaded, prompt.ids, want) if want else None  # AR's NLL and the checks
        for (name, _), context, result in results:
            if not isinstance(result, GenerationResult):
                rows.append({**error_row(context, result), "output_nll": None, "matches_ar": None})
                continue
            row = result_row(context, result)
            if name in self.baselines:
                row.update(prefill_s=None, decode_s=None, schedule_s=None, step_signals=None)
                if not result.steps:  # prompt lookup: transformers does not report its steps
                    row.update(steps=None, verified_nodes=None, mean_accepted_length=None, accepted_per_position=None,
                               step_accepted_lengths=None, tree_usage=None)
            out = result.output_token_ids
            logits = want_logits if out == want else continuation_logits(self.loaded, prompt.ids, out) if out else None
            row["output_nll"] = output_nll(logits, out)
            row["matches_ar"] = None
            if temperature == 0 and want is not None and name != "ar":
                row["matches_ar"] = ("not compared" if not same_model(name, self.loaded) else
                                     compare_greedy(out, want, want_logits, self.loaded.dtype))
            rows.append(row)
        return rows


def bench_table(rows: list[dict]) -> pa.Table:
    return pa.Table.from_pylist(rows, schema=BENCH_SCHEMA)
