"""The throughput benchmark (issue 22): aggregate output tokens/s of one actor's process on the same prompts at each
--concurrent-requests K, for our policies through BatchDecoder and for the baselines' own batching.

One process, its threads, every configuration (system, K) decoding all prompts, repeated in a rotating order so
that the machine's noise falls on all alike. Aggregate tokens/s = all output tokens / the wall time of the whole
set (the figure a labeling job is paid in); per-row tokens/s = a row's tokens over its own time in flight. Greedy
outputs are checked against AR's at K=1 (equal | tie | differs, as jobs/bench.py does). Baselines:
`hf-generate`, transformers `generate` on static batches of K left-padded prompts (each batch runs until its
longest row ends); `hf-continuous`, transformers' continuous batching (`generate_batch`, at most K requests per
batch); `llama-cpp`, one sequence at a time (llama-cpp-python decodes one), so at K=1 only. Knows nothing about
Ray.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass, field

import torch

from entmtp_ray.bench.compare import Prompt, compare_greedy, continuation_logits, same_model
from entmtp_ray.config import DecodingConfig
from entmtp_ray.decode.batch import BatchDecoder, Job
from entmtp_ray.decode.acceptance import row_generator
from entmtp_ray.decode.loop import SpecDecoder
from entmtp_ray.decode.results import GenerationResult
from entmtp_ray.model.loading import LoadedModel, synchronize

OURS = ("ar", "entmtp-star", "entmtp-tau")
BASELINES = ("hf-generate", "hf-continuous", "llama-cpp")


@dataclass
class Outcome:
    """One configuration's pass over the prompts."""

    system: str
    k: int
    repeat: int
    wall_s: float
    tokens: int  # output tokens over all prompts
    outputs: dict[str, list[int]]  # prompt id -> output tokens
    row_rates: list[float] = field(default_factory=list)  # per-row tokens/s (time in flight), where known
    steps: int = 0  # draft-verify steps over all rows (ours)
    step_tokens: int = 0  # tokens those steps committed (tau = step_tokens / steps)
    nodes: int = 0  # verified tree nodes over all steps

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0


def run_ours(decoder: SpecDecoder, k: int, prompts: list[Prompt], cfg: DecodingConfig, system: str,
             repeat: int) -> Outcome:
    """All prompts through `decoder` with K in flight (K=1: one at a time, the plain decoder's own loop)."""
    device = decoder.loaded.device
    jobs = [Job(p.id, p.ids, cfg, row_generator(cfg.seed, p.id, device)) for p in prompts]
    synchronize(device)
    start = time.perf_counter()
    if k == 1:
        finished = [(job, decoder.generate(job.prompt_ids, job.cfg, job.generator)) for job in jobs]
    else:
        finished = list(BatchDecoder(decoder, k).run(jobs))
    synchronize(device)
    wall = time.perf_counter() - start
    outcome = Outcome(system, k, repeat, wall, 0, {})
    for job, result in finished:
        if not isinstance(result, GenerationResult):
            raise RuntimeError(f"{system} K={k}: prompt {job.tag} failed: {result}")
        outcome.outputs[job.tag] = result.output_token_ids
        outcome.tokens += result.num_output_tokens
        outcome.row_rates.append(result.tokens_per_s)
        outcome.steps += len(result.steps)
        outcome.step_tokens += sum(s.accepted_length for s in result.steps)
        outcome.nodes += sum(s.nodes for s in result.steps)
    return outcome


class HFStatic:
    """transformers `generate`, greedy, on batches of K prompts left-padded to the longest (its own batching)."""

    def __init__(self, loaded: LoadedModel):
        self.loaded = loaded

    def run(self, k: int, prompts: list[Prompt], cfg: DecodingConfig, repeat: int) -> Outcome:
        eos = sorted(self.loaded.eos_token_ids)
        device = self.loaded.device
        outcome = Outcome("hf-generate", k, repeat, 0.0, 0, {})
        synchronize(device)
        start = time.perf_counter()
        for first in range(0, len(prompts), k):
            group = prompts[first:first + k]
            width = max(len(p.ids) for p in group)
            ids = torch.tensor([[eos[0]] * (width - len(p.ids)) + p.ids for p in group], device=device)
            mask = torch.tensor([[0] * (width - len(p.ids)) + [1] * len(p.ids) for p in group], device=device)
            with torch.inference_mode():
                out = self.loaded.model.generate(ids, attention_mask=mask, max_new_tokens=cfg.max_new_tokens,
                                                 do_sample=False, eos_token_id=eos, pad_token_id=eos[0])
            for p, row in zip(group, out[:, width:].tolist()):
                cut = next((i + 1 for i, t in enumerate(row) if t in self.loaded.eos_token_ids), len(row))
                outcome.outputs[p.id] = row[:cut]  # after EOS a finished row is padded
                outcome.tokens += cut
        synchronize(device)
        outcome.wall_s = time.perf_counter() - start
        return outcome


class HFContinuous:
    """transformers' continuous batching (`generate_batch`) on the loaded weights, at most K requests per batch."""

    def __init__(self, loaded: LoadedModel):
        self.loaded = loaded

    def run(self, k: int, prompts: list[Prompt], cfg: DecodingConfig, repeat: int) -> Outcome:
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        generation = GenerationConfig(max_new_tokens=cfg.max_new_tokens, do_sample=False,
                                      eos_token_id=sorted(self.loaded.eos_token_ids), pad_token_id=0)
        batching = ContinuousBatchingConfig(max_requests_per_batch=k)
        synchronize(self.loaded.device)
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.loaded.model.generate_batch(inputs=[p.ids for p in prompts], generation_config=generation,
                                                   continuous_batching_config=batching, warmup=False)
        synchronize(self.loaded.device)
        wall = time.perf_counter() - start
        outcome = Outcome("hf-continuous", k, repeat, wall, 0, {})
        by_request = {f"req_{i}": p.id for i, p in enumerate(prompts)}
        for request, result in out.items():
            tokens = list(result.generated_tokens)
            outcome.outputs[by_request.get(request, request)] = tokens
            outcome.tokens += len(tokens)
        return outcome


class LlamaCppOne:
    """llama.cpp (llama-cpp-python), one prompt at a time."""

    def __init__(self, loaded: LoadedModel, threads: int, seed: int):
        from entmtp_ray.bench.compare import LlamaCpp

        self.engine = LlamaCpp(loaded, threads, seed)

    def run(self, k: int, prompts: list[Prompt], cfg: DecodingConfig, repeat: int) -> Outcome:
        start = time.perf_counter()
        results = [(p.id, self.engine.run(p.ids, cfg, cfg.seed)) for p in prompts]
        outcome = Outcome("llama-cpp", k, repeat, time.perf_counter() - start, 0, {})
        for row_id, result in results:
            outcome.outputs[row_id] = result.output_token_ids
            outcome.tokens += result.num_output_tokens
            outcome.row_rates.append(result.tokens_per_s)
        return outcome


def configurations(systems: list[str], ks: list[int]) -> list[tuple[str, int]]:
    """(system, K) pairs to run: llama-cpp at K=1 only (it decodes one sequence)."""
    return [(s, k) for s in systems for k in ks if not (s == "llama-cpp" and k != 1)]


def run_all(systems: list[str], decoders: dict[tuple[str, int], SpecDecoder], baselines: dict, prompts: list[Prompt],
            ks: list[int], cfg: DecodingConfig, repeats: int, log=sys.stderr) -> list[Outcome]:
    """Every configuration over all prompts, `repeats` times, the order rotated per repeat, after one untimed
    warm-up of each (K prompts' worth, 16 tokens). `decoders`: (system, K) -> our decoder (a bank timed at K)."""
    pairs = configurations(systems, ks)
    warm = cfg.model_copy(update={"max_new_tokens": 16})
    for system, k in pairs:
        _run(decoders, baselines, system, k, prompts[:max(2, k)], warm, -1)
    outcomes = []
    for repeat in range(repeats):
        shift = repeat % len(pairs)
        for system, k in pairs[shift:] + pairs[:shift]:
            outcome = _run(decoders, baselines, system, k, prompts, cfg, repeat)
            outcomes.append(outcome)
            print(f"repeat {repeat + 1}/{repeats} {system} K={k}: {outcome.tokens_per_s:.1f} tok/s "
                  f"({outcome.tokens} tokens in {outcome.wall_s:.1f} s)", file=log, flush=True)
    return outcomes


def _run(decoders, baselines, system, k, prompts, cfg, repeat) -> Outcome:
    if system in baselines:
        return baselines[system].run(k, prompts, cfg, repeat)
    return run_ours(decoders[system, k], k, prompts, cfg, system, repeat)


def check_greedy(loaded: LoadedModel, prompts: list[Prompt], outcomes: list[Outcome]) -> dict[tuple[str, int], dict]:
    """Per configuration: how many outputs equal AR's (K=1, same repeat) / leave it at a float tie / differ.
    Systems on another model (llama.cpp; transformers' under --quantize) are not compared (`same_model`)."""
    by_id = {p.id: p for p in prompts}
    reference = {o.repeat: o.outputs for o in outcomes if o.system == "ar" and o.k == 1}
    logits: dict[str, torch.Tensor] = {}
    counts: dict[tuple[str, int], dict] = {}
    for o in outcomes:
        if not same_model(o.system, loaded) or o.repeat not in reference:
            continue
        tally = counts.setdefault((o.system, o.k), {"equal": 0, "tie": 0, "differs": 0})
        for row_id, got in o.outputs.items():
            want = reference[o.repeat][row_id]
            if got != want and row_id not in logits:
                logits[row_id] = continuation_logits(loaded, by_id[row_id].ids, want)
            tally[compare_greedy(got, want, logits.get(row_id), loaded.dtype)] += 1
    return counts


def summarize(outcomes: list[Outcome], greedy: dict) -> list[dict]:
    """One line per (system, K): median aggregate tokens/s over repeats, its ratio to the same system's K=1 (the
    median of per-repeat ratios, so each ratio is of two passes in the same round), per-row p50/p90, tau."""
    lines = []
    for system, k in dict.fromkeys((o.system, o.k) for o in outcomes):
        mine = [o for o in outcomes if (o.system, o.k) == (system, k)]
        ones = {o.repeat: o for o in outcomes if (o.system, o.k) == (system, 1)}
        ar_ones = {o.repeat: o for o in outcomes if (o.system, o.k) == ("ar", 1)}
        rates = sorted(r for o in mine for r in o.row_rates)
        steps = sum(o.steps for o in mine)
        lines.append({
            "system": system, "k": k, "repeats": len(mine),
            "tokens_per_s": statistics.median(o.tokens_per_s for o in mine),
            "x_own_k1": statistics.median(o.tokens_per_s / ones[o.repeat].tokens_per_s for o in mine
                                          if o.repeat in ones) if ones else None,
            "x_ar_k1": statistics.median(o.tokens_per_s / ar_ones[o.repeat].tokens_per_s for o in mine
                                         if o.repeat in ar_ones) if ar_ones else None,
            "row_tokens_per_s_p50": _quantile(rates, 0.5), "row_tokens_per_s_p90": _quantile(rates, 0.9),
            "tau": sum(o.step_tokens for o in mine) / steps if steps else None,
            "nodes_per_step": sum(o.nodes for o in mine) / steps if steps else None,
            "wall_s": statistics.median(o.wall_s for o in mine), "tokens": mine[0].tokens,
            "greedy": greedy.get((system, k)),
        })
    return lines


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return values[min(len(values) - 1, int(q * len(values)))]


def markdown(lines: list[dict], setup: dict) -> str:
    head = ["system", "K", "tokens/s", "x own K=1", "x AR K=1", "row tok/s p50", "p90", "tau", "nodes/step",
            "greedy = AR (equal/tie/differs)"]
    out = ["# Throughput by concurrent requests", "", ", ".join(f"{k}: {v}" for k, v in setup.items()), "",
           "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for line in lines:
        g = line["greedy"]
        out.append("| " + " | ".join([
            line["system"], str(line["k"]), f"{line['tokens_per_s']:.1f}", _f(line["x_own_k1"]), _f(line["x_ar_k1"]),
            _f(line["row_tokens_per_s_p50"], ".1f"), _f(line["row_tokens_per_s_p90"], ".1f"), _f(line["tau"]),
            _f(line["nodes_per_step"], ".1f"), f"{g['equal']}/{g['tie']}/{g['differs']}" if g else "not compared"])
            + " |")
    return "\n".join(out) + "\n"


def _f(value, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)
