"""A topology bank from greedy calibration rollouts, on the hardware at hand: the stages after the rollouts,
shared by jobs/build_bank.py (rollouts on a Ray actor pool) and any caller that decoded its own. The
measuring and deciding live in calibrate/; this module runs them with an engine.

1. One teacher-forced pass per rollout ranks every true next token under the head that would draft it
   (calibrate/rollouts.py).
2. Greedy tree growth (Algorithm 1, calibrate/growth.py) to the node budget; candidates at a ladder of sizes.
3. Each candidate's step time measured here, with the process's thread count, side by side per timing prompt
   (every tree back to back, rotated); its tokens/s and accepted length are the exact greedy replay of the
   calibration rollouts with its own tree.
4. Pareto frontier over (nodes, accepted length), then the sweeps that choose entmtp-star, the ladder and the
   hysteresis pair per signal (calibrate/sweep.py).
5. Measured selection: a quarter of the rollouts (at most MAX_HELD_OUT) is held out of stages 2-4, and the
   best replayed trees, Hydra's tree, the 1-node tree and the switching pair decode those prompts here side by
   side; the star is the measured fastest and the pair stays only if it measured faster still
   (sweep.select_measured). Stages 1, 3 and 5 are saved under `work` and resume.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from entmtp_ray.assets import asset
from entmtp_ray.calibrate.bank import Bank, BankTree, Measured, Selection, current_hardware
from entmtp_ray.calibrate.growth import AcceptanceTable, accepted_lengths, grow_trees, pareto_frontier
from entmtp_ray.calibrate.rollouts import Rollout, measure_rollout
from entmtp_ray.calibrate.sweep import (MIN_SWITCH_GAIN, candidate_trees, choose_policies, replay_all,
                                        select_measured, with_star)
from entmtp_ray.config import DecodingConfig
from entmtp_ray.decode.batch import BatchDecoder, Job
from entmtp_ray.decode.acceptance import row_generator
from entmtp_ray.decode.policy import FixedTree, HysteresisPolicy, Policy, make_signal
from entmtp_ray.decode.tree import Topology, load_topology
from entmtp_ray.pipeline.engine import Engine
from entmtp_ray.pipeline.manifest import heads_identity

MAX_RANKS = (16, 8, 8, 8, 8)  # ranks kept per depth; a tree never needs more children than these
# measured selection (stage 5): 1 / HELD_OUT_SHARE of the rollouts, at most MAX_HELD_OUT (each is decoded once per
# candidate: 8 prompts x 6 candidates is about 2 minutes of an auto bank's 64 on 2 CPU cores), grows and replays
# nothing; MEASURED_TREES of the frontier, the fastest replayed, are measured beside Hydra's tree and the 1-node tree
HELD_OUT_SHARE = 4
MAX_HELD_OUT = 8
MEASURED_TREES = 3
HYDRA = "hydra"


@dataclass(frozen=True)
class CalibrationRow:
    """One calibration rollout: the prompt as the engine encodes it, and the greedy output decoded from it."""

    id: str
    prompt: object  # a user message, or a list of chat turns
    output_token_ids: list[int]


def usable(rows: list[CalibrationRow]) -> list[CalibrationRow]:
    """The rollouts a bank is built from: those with output, in id order."""
    return sorted((r for r in rows if r.output_token_ids), key=lambda r: r.id)


def split_held_out(rows: list[CalibrationRow]) -> tuple[list[CalibrationRow], list[CalibrationRow]]:
    """(fit, held out): 1 / HELD_OUT_SHARE of `rows`, at most MAX_HELD_OUT, chosen by a hash of their ids (the same
    ones on every rebuild, whatever their order), is held out; none of fewer than HELD_OUT_SHARE rows."""
    count = min(MAX_HELD_OUT, len(rows) // HELD_OUT_SHARE)
    held = {r.id for r in sorted(rows, key=lambda r: hashlib.sha256(r.id.encode()).hexdigest())[:count]}
    return [r for r in rows if r.id not in held], [r for r in rows if r.id in held]


def measurement_key(engine: Engine) -> dict:
    """What a rollout's rank table depends on besides its tokens: the model and how it runs, and the heads by
    content (new heads written over the same folder are other heads)."""
    cfg = engine.model_cfg
    return {"model": cfg.model, "dtype": str(engine.loaded.dtype), "quantize": engine.loaded.quantize,
            **({"activations": engine.loaded.activations} if engine.loaded.activations != "float" else {}),
            "chat_format": engine.loaded.chat_format, "heads": heads_identity(cfg)[1],
            "draft_vocab": engine.stack.draft_vocab_size}


def measure_tables(engine: Engine, rows: list[CalibrationRow], work: Path) -> list[Rollout]:
    """Each rollout's rank table and verifier statistics (stage 1), in `usable(rows)`'s order; cached in
    work/tables.json for the same rollouts measured by the same model and heads (`measurement_key`), else measured
    afresh."""
    cache = work / "tables.json"
    rows = usable(rows)
    key = {"ids": [r.id for r in rows], "measured_by": measurement_key(engine)}
    if cache.is_file():
        saved = json.loads(cache.read_text())
        if isinstance(saved, dict) and all(saved.get(k) == v for k, v in key.items()):
            return [Rollout(**r) for r in saved["rollouts"]]
    measured = []
    for row in rows:
        ids = engine.encode(row.prompt)
        measured.append(measure_rollout(engine.decoder, ids + list(row.output_token_ids), len(ids), MAX_RANKS))
    cache.write_text(json.dumps({**key, "rollouts": [r.__dict__ for r in measured]}))
    return measured


def step_seconds(engine: Engine, trees: dict[str, Topology], prompts: list[str], new_tokens: int,
                 work: Path) -> tuple[dict[str, float], float]:
    """Seconds per decoding step of each tree (median over prompts), and mean prefill seconds, at the engine's
    concurrency: with K > 1, a step is one batched step of K requests that all run the tree (each prompt with the
    K - 1 prompts after it), timed only while all K are in flight, since that is what a request pays per step
    in an actor that keeps K in flight.

    The trees are timed side by side: each prompt runs every tree back to back, in an order rotated
    per prompt, so a machine that slows down during the timing slows every tree alike (timed one
    tree after another, a 1-node tree once measured slower than a 5-node one). Each finished prompt
    is saved, so a stopped build resumes within the timing.
    """
    concurrency = engine.concurrency
    cache = work / ("step_seconds.json" if concurrency == 1 else f"step_seconds-k{concurrency}.json")
    saved = json.loads(cache.read_text()) if cache.is_file() else {}
    shapes = {name: [list(p) for p in tree.paths] for name, tree in trees.items()}
    if saved.get("trees", shapes) != shapes:  # other trees under the same names (other rollouts): time afresh
        saved = {}
    prefill = saved.get("prefill", [])
    if set(trees) <= set(saved.get("steps", {})):  # a finished timing
        return {name: saved["steps"][name] for name in trees}, sum(prefill) / len(prefill)
    cfg = DecodingConfig(policy="fixed", tree="ar", max_new_tokens=new_tokens)
    encoded = [engine.encode(prompt) for prompt in prompts]
    # one decoder per tree, all over the largest one's static cache and graph pool (they run one at a time)
    largest = max(trees, key=lambda name: trees[name].num_nodes)
    sizing = cfg.model_copy(update={"max_input_tokens": max(len(ids) for ids in encoded)})
    first = engine.stack.decoder(FixedTree(largest, trees[largest]), sizing)
    decoders = {name: first if name == largest else first.for_policy(FixedTree(name, topology))
                for name, topology in trees.items()}
    for decoder in decoders.values():
        decoder.generate(encoded[0], cfg.model_copy(update={"max_new_tokens": 8}))  # warm-up
    names = list(trees)
    rounds: list[dict[str, float]] = saved.get("rounds", [])  # per prompt: tree -> seconds per step
    for k, ids in enumerate(encoded):
        if k == len(rounds):
            rounds.append({})
        for name in names[k % len(names):] + names[: k % len(names)]:
            if name in rounds[k]:
                continue
            if concurrency == 1:
                result = decoders[name].generate(ids, cfg, row_generator(0, str(k), engine.loaded.device))
                rounds[k][name] = result.decode_s / max(1, len(result.steps))
                prefill.append(result.prefill_s)
            else:
                group = [encoded[(k + j) % len(encoded)] for j in range(concurrency)]
                rounds[k][name], seconds = _batched_step_seconds(decoders[name], concurrency, group, cfg,
                                                                 engine.loaded.device)
                prefill.append(seconds)
        cache.write_text(json.dumps({"trees": shapes, "rounds": rounds, "prefill": prefill}))
    steps = {}
    for name in names:
        steps[name] = statistics.median_high(r[name] for r in rounds[: len(prompts)])
        print(f"  {name}: {1000 * steps[name]:.1f} ms/step", file=sys.stderr)
    cache.write_text(json.dumps({"trees": shapes, "rounds": rounds, "prefill": prefill, "steps": steps}))
    return steps, sum(prefill) / len(prefill)


TIMED_BATCH_STEPS = 12  # batched steps timed per prompt group: each costs K requests' tree, so fewer than at K=1


def _batched_step_seconds(decoder, concurrency: int, group: list[list[int]], cfg: DecodingConfig,
                          device) -> tuple[float, float]:
    """(median seconds of a batched step while all `concurrency` lanes are in flight, mean prefill seconds) of
    `group`'s prompts decoded together, over at most TIMED_BATCH_STEPS steps; the run ends sooner when the first
    request finishes (a step of fewer rows is cheaper, and is not what a busy actor pays). A request that finishes
    in its prefill leaves its lane empty: then the partial steps are what there is."""
    batch = BatchDecoder(decoder, concurrency)
    prefills, times = [], []
    for j, ids in enumerate(group):
        start = time.perf_counter()
        batch.admit(Job(j, ids, cfg, row_generator(0, str(j), device)))
        prefills.append(time.perf_counter() - start)
    while batch.running and len(times) < TIMED_BATCH_STEPS:
        start = time.perf_counter()
        done = batch.step()
        times.append(time.perf_counter() - start)
        if done or batch.running < concurrency:
            break
    return statistics.median(times), sum(prefills) / len(prefills)


def decode_side_by_side(engine: Engine, policies: dict[str, Policy], rows: list[CalibrationRow],
                        work: Path) -> dict[str, dict[str, float]]:
    """Each policy's greedy decoding of `rows`' prompts, each to its rollout's length (greedy output is the same
    under every policy, so each decodes the rollout again): tokens/s (median over the prompts) and tau (accepted
    tokens over steps, pooled). Side by side as step_seconds times: each prompt runs every policy back to back, in
    an order rotated per prompt. Each finished prompt is saved in work/measured.json and a stopped run resumes."""
    cache = work / "measured.json"
    shapes = {name: [[list(p) for p in t.paths] for t in policy.trees()] for name, policy in policies.items()}
    ids = [r.id for r in rows]
    saved = json.loads(cache.read_text()) if cache.is_file() else {}
    rounds: list[dict] = saved.get("rounds", []) if saved.get("key") == {"policies": shapes, "ids": ids} else []
    names = list(policies)
    if len(rounds) < len(rows) or any(set(r) != set(names) for r in rounds):
        largest = max(names, key=lambda n: max(t.num_nodes for t in policies[n].trees()))
        encoded = [engine.encode(r.prompt) for r in rows]
        sizing = DecodingConfig(policy="fixed", tree="ar", max_new_tokens=max(len(r.output_token_ids) for r in rows),
                                max_input_tokens=max(len(e) for e in encoded))
        first = engine.stack.decoder(policies[largest], sizing)
        decoders = {name: first if name == largest else first.for_policy(policy) for name, policy in policies.items()}
        for decoder in decoders.values():
            decoder.generate(encoded[0], sizing.model_copy(update={"max_new_tokens": 8}))  # warm-up
        for k, (row, prompt) in enumerate(zip(rows, encoded)):
            if k == len(rounds):
                rounds.append({})
            cfg = sizing.model_copy(update={"max_new_tokens": len(row.output_token_ids)})
            for name in names[k % len(names):] + names[: k % len(names)]:
                if name not in rounds[k]:
                    result = decoders[name].generate(prompt, cfg, row_generator(0, row.id, engine.loaded.device))
                    rounds[k][name] = {"tokens": result.num_output_tokens, "seconds": result.total_s,
                                       "steps": len(result.steps), "accepted": sum(result.step_accepted_lengths())}
            cache.write_text(json.dumps({"key": {"policies": shapes, "ids": ids}, "rounds": rounds}))
    return {name: {"tokens_per_s": statistics.median(r[name]["tokens"] / r[name]["seconds"] for r in rounds),
                   "tau": sum(r[name]["accepted"] for r in rounds) / max(1, sum(r[name]["steps"] for r in rounds))}
            for name in names}


def project_relative(path: str) -> str:
    """Shipped heads as the package's assets name them (banks ship; absolute paths do not travel)."""
    try:
        return str(Path(path).resolve().relative_to(asset().resolve()))
    except ValueError:
        return str(path)


@dataclass
class Built:
    bank: Bank
    stats: dict[str, dict]  # tree name -> tau, tokens_per_s, tau_grown (every candidate)
    frontier: list[str]
    figures: dict  # the sweep's


def build_bank(engine: Engine, rows: list[CalibrationRow], timing_prompts: list, work: Path, *, name: str, budget: int,
               max_new_tokens: int, calibration: dict) -> Built:
    """The bank named `name` from calibration rollouts `rows`, timing the candidate trees on `timing_prompts`
    with `engine` (its model, heads and dtype; this process's threads), and choosing its star and pair by decoding
    the held-out share of `rows` (stage 5). `calibration` goes into the bank as it is, with the prompt and
    position counts added."""
    work.mkdir(parents=True, exist_ok=True)
    rows = usable(rows)
    by_id = dict(zip((r.id for r in rows), measure_tables(engine, rows, work)))
    if not by_id:
        raise ValueError("no calibration rollout produced any token; a bank needs at least one")
    fit_rows, held_rows = split_held_out(rows)
    measured, held = [by_id[r.id] for r in fit_rows], [by_id[r.id] for r in held_rows]
    depth = engine.decoder.drafter.max_depth
    table = AcceptanceTable((row for r in measured for row in r.rows), max_depth=depth)
    grown = grow_trees(table, budget, max_depth=depth)
    trees = candidate_trees(grown, budget, name)
    hydra = _hydra_tree(depth) if held else None
    timed = {**trees, HYDRA: hydra} if hydra is not None else trees
    seconds, prefill = step_seconds(engine, timed, timing_prompts, min(64, max_new_tokens), work)

    stats = {}
    lengths = [accepted_lengths(r.rows, trees.values()) for r in measured]  # every tree's replay, for the sweep
    for tree_name, tree in trees.items():
        r = replay_all(measured, FixedTree(tree_name, tree), seconds, prefill * len(measured), lengths)
        stats[tree_name] = {"tau": r.tau, "tokens_per_s": r.tokens_per_s,
                            "tau_grown": table.accepted_length(tree.paths)}
    names = list(trees)
    frontier = [names[i] for i in pareto_frontier([(trees[n].num_nodes, stats[n]["tau"]) for n in names])]
    policy, figures = choose_policies(measured, trees, seconds, prefill * len(measured), frontier, lengths=lengths)
    kept = [BankTree.of(trees[n], **stats[n]) for n in frontier]
    if held:
        policy, selection, extra = select_on_held_out(engine, policy, figures, timed, frontier, held, held_rows,
                                                      seconds, prefill, work)
        for tree in extra:  # Hydra's tree, when it won: its replay on the same rollouts, as the frontier's
            r = replay_all(measured, FixedTree(tree.name, tree), seconds, prefill * len(measured))
            kept.append(BankTree.of(tree, tau=r.tau, tokens_per_s=r.tokens_per_s))
    else:
        selection = Selection(by="replay", reason=f"{len(rows)} rollouts, fewer than {HELD_OUT_SHARE}: none held out, "
                              "the star and the pair chosen by the replay alone")
    figures["selection"] = selection.model_dump()
    bank = Bank(
        model=Path(engine.model_cfg.model).name, heads=project_relative(engine.heads_label), task=name,
        hardware=current_hardware(engine.loaded.device, engine.loaded.dtype, engine.concurrency,
                                  engine.loaded.quantize, engine.loaded.activations),
        calibration={**calibration, "prompts": len(measured), "held_out": len(held), "max_new_tokens": max_new_tokens,
                     "positions": table.rows},
        created=datetime.date.today().isoformat(),
        trees=sorted(kept, key=lambda t: t.nodes),
        policy=policy, selection=selection)
    (work / "sweep.json").write_text(json.dumps(figures, indent=1))
    return Built(bank, stats, frontier, figures)


def _hydra_tree(depth: int) -> Topology | None:
    """Hydra's tree, a candidate the bank must beat; None where it is deeper than the heads. Its replay reads
    tables that keep MAX_RANKS ranks, 8 below depth 1, where it has ranks 8 and 9: its replayed figures count those
    rare acceptances as misses; the measured ones, which choose, are exact."""
    try:
        return load_topology(HYDRA, max_depth=depth)
    except ValueError:
        return None


def select_on_held_out(engine: Engine, policy, figures: dict, trees: dict[str, Topology], frontier: list[str],
                       held: list, held_rows: list[CalibrationRow], seconds: dict[str, float], prefill: float,
                       work: Path):
    """Stage 5: decode the held-out prompts with the MEASURED_TREES fastest replayed frontier trees, Hydra's tree,
    the 1-node tree and the sweep's switching pair, and choose by what they measured (sweep.select_measured).
    Returns the policy settings, the Selection record and the trees the bank must add (Hydra's, when it won)."""
    replayed = figures["fixed_tokens_per_s"]
    names = sorted(frontier, key=lambda n: -replayed[n])[:MEASURED_TREES]
    smallest = min(frontier, key=lambda n: trees[n].num_nodes)  # the 1-node tree: plain decoding
    names += [n for n in (smallest, HYDRA) if n in trees and n not in names]
    candidates: dict[str, Policy] = {n: FixedTree(n, trees[n]) for n in names}
    switching = policy.signals[policy.signal]
    if switching.conservative != switching.aggressive:
        candidates["entmtp-tau"] = HysteresisPolicy(
            "entmtp-tau", trees[switching.conservative], trees[switching.aggressive], switching.tau_on,
            switching.tau_off, make_signal(policy.signal, policy.beta, switching.initial))
    decoded = decode_side_by_side(engine, candidates, held_rows, work)
    records = []
    for n, candidate in candidates.items():
        r = replay_all(held, candidate, seconds, prefill * len(held))
        records.append(Measured(name=n, nodes=trees[n].num_nodes if n in trees else None,
                                replayed_tokens_per_s=r.tokens_per_s, replayed_tau=r.tau,
                                measured_tokens_per_s=decoded[n]["tokens_per_s"], measured_tau=decoded[n]["tau"]))
    fixed = {n: decoded[n]["tokens_per_s"] for n in names}
    star, keep_pair = select_measured(fixed, {n: trees[n].num_nodes for n in names},
                                      decoded["entmtp-tau"]["tokens_per_s"] if "entmtp-tau" in decoded else None)
    rates = ", ".join(f"{n} {decoded[n]['tokens_per_s']:.1f}" for n in sorted(decoded, key=lambda n: -decoded[n][
        "tokens_per_s"]))
    if "entmtp-tau" not in decoded:
        pair = "no switching pair: none replayed enough faster than the replay's star"
    elif keep_pair:
        pair = "the switching pair kept: it measured faster than the star"
    else:
        pair = f"the switching pair dropped: it measured under {round(100 * (1 + MIN_SWITCH_GAIN))}% of the star's"
    reason = (f"star {star}: the fastest measured on {len(held)} held-out prompts (tokens/s {rates}; the replay's "
              f"star was {policy.star}); {pair}")
    selection = Selection(by="measured", held_out=len(held), candidates=records, reason=reason)
    extra = [trees[star]] if star not in frontier else []
    return with_star(policy, star, keep_pair), selection, extra
