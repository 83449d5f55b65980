"""Step costs measured where a decoder runs, kept per machine: what an adaptive policy (policy.Adaptive) weighs its
trees' accepted lengths against, in place of the costs its bank was timed with on another machine, and settles its
star by (docs/design.md §2, "Step costs measured where the job runs").

A CostTable is one JSON file per machine and setting (its `key`: the CPU model and vector extensions or the GPU and
its backend, the threads, the model, heads, dtype, weights and activations, the torch and package versions) under
`costs_dir()`, holding seconds a step by tree shape: each tree is timed once on a machine, by the first job or bench
that needs it, and every later one reads it. A tree that could not win at the costs the table knew is recorded as
left out (no seconds), so that a later run knows the table has weighed it."""

from __future__ import annotations

import datetime
import functools
import hashlib
import json
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from filelock import FileLock

from entmtp_ray.config import DecodingConfig
from entmtp_ray.decode.loop import SpecDecoder
from entmtp_ray.decode.policy import Adaptive, FixedTree, Policy
from entmtp_ray.decode.static import positions_needed
from entmtp_ray.decode.tree import Topology
from entmtp_ray.model.loading import cache_dir, synchronize

PROMPT_TOKENS = 64  # a step's cost depends on the context's length, not its content: an ordinary prompt's length
TABLE_VERSION = 1
# a tree whose first, rough timing puts it this far below the fastest tree's tokens a second (at the bank's accepted
# lengths) is not timed again: only the trees that may be chosen need the precise figure
CONTENDER = 0.8


def costs_dir() -> Path:
    """Where cost tables are kept: $ENTMTP_COSTS, else the cache's `costs` folder."""
    return Path(os.environ.get("ENTMTP_COSTS") or cache_dir() / "costs")


def shape_key(tree: Topology) -> str:
    """A tree's shape, whatever a bank names it: two banks' trees of the same paths cost the same step."""
    return hashlib.sha1(json.dumps(sorted(map(list, tree.paths))).encode()).hexdigest()[:16]


@dataclass
class CostTable:
    """Seconds a step by tree shape, measured on the machine and setting `key` names, in `path` (None: kept in
    memory only). `measured_now`: the shapes this process timed."""

    key: dict
    path: Path | None
    entries: dict[str, dict] = field(default_factory=dict)
    measured_now: set[str] = field(default_factory=set)

    @classmethod
    def open(cls, key: dict, folder: Path | None = None) -> CostTable:
        """The table for `key` under `folder` (default costs_dir()), with what earlier runs measured; empty when
        there is none, or it cannot be read (it is measured again and written anew)."""
        digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
        name = "".join(c if c.isalnum() or c in "._-" else "_" for c in str(key.get("model", "model")))
        path = (folder or costs_dir()) / f"{name}-{digest}.json"
        table = cls(key, path)
        table.entries = table._read()
        return table

    def _read(self) -> dict[str, dict]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        if data.get("version") != TABLE_VERSION or data.get("key") != self.key:
            return {}
        return data.get("trees", {})

    def seconds(self, tree: Topology) -> float | None:
        """Seconds a step of `tree` here; None when it was never timed (not yet, or left out)."""
        entry = self.entries.get(shape_key(tree))
        return entry["seconds"] if entry else None

    def covers(self, trees: list[Topology]) -> bool:
        """Whether every tree of `trees` has been weighed here: timed, or left out as one that could not win."""
        return all(shape_key(t) in self.entries for t in trees)

    def add(self, measured: dict[Topology, tuple[float, int]], left_out: list[Topology] = ()) -> None:
        """Record each tree's (seconds a step, steps timed), and the trees left out untimed, and write the table,
        merged with what another process on the machine wrote meanwhile."""
        now = datetime.datetime.now().isoformat(timespec="seconds")
        fresh = {shape_key(t): {"name": t.name, "nodes": t.num_nodes, "seconds": s, "steps": n, "measured": now}
                 for t, (s, n) in measured.items()}
        fresh.update({shape_key(t): {"name": t.name, "nodes": t.num_nodes, "seconds": None, "left_out": now}
                      for t in left_out if shape_key(t) not in fresh})
        self.entries.update(fresh)
        self.measured_now.update(k for k, entry in fresh.items() if entry["seconds"] is not None)
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with FileLock(str(self.path) + ".lock"):
                entries = {**self._read(), **fresh}
                scratch = self.path.with_suffix(f".{os.getpid()}.tmp")
                scratch.write_text(json.dumps({"version": TABLE_VERSION, "key": self.key, "trees": entries}, indent=1))
                os.replace(scratch, self.path)
            self.entries = {**entries, **self.entries}
        except OSError:  # a read-only cache: the costs still serve this process
            self.path = None

    def describe(self, trees: list[Topology], spent: float) -> str:
        """Where the costs of `trees` came from: measured now (in `spent` seconds), or cached from when; and the
        file."""
        keys = {shape_key(t) for t in trees if self.seconds(t) is not None}
        now = keys & self.measured_now
        cached = sorted(self.entries[k]["measured"] for k in keys - now)

        def count(n: int) -> str:
            return f"{n} tree{'s' if n != 1 else ''}"

        parts = ([f"measured now ({count(len(now))}, {spent:.1f} s)"] if now else []) + (
            [f"cached from {cached[0][:16].replace('T', ' ')}" + (f" ({count(len(cached))})" if now else "")]
            if cached else [])
        return " and ".join(parts) + (f" in {self.path}" if self.path is not None else " (kept in memory only)")


def step_seconds(decoder: SpecDecoder, trees: list[Topology], steps: int = 12, rounds: int = 3) -> dict[str, float]:
    """Seconds per decoding step of each tree through `decoder` (its model, drafter and verifier, as a job's steps
    run them: a one-node tree without the heads, as an adaptive policy's fallback runs it): each round, each tree in
    turn (rotated per round, so that a machine slowing down slows every tree alike) reads a prompt of PROMPT_TOKENS
    fixed token ids, takes one step untimed (first calls' costs) and `steps` timed, whatever they accept; the median
    of the `rounds` rounds. (The trees' decoders share the model's caches, so each round reads the prompt again.) A
    tree whose steps do not fit the model's context after the prompt is left out."""
    loaded = decoder.loaded
    context = decoder.cache.capacity if decoder.static else loaded.max_positions
    prompt = [(7 * i + 3) % loaded.model.config.vocab_size for i in range(min(PROMPT_TOKENS, context // 4))]
    new = {t.name: (steps + 1) * (t.depth + 1) for t in trees}  # a step emits at most depth + 1 tokens
    fits = {t.name: t for t in trees if positions_needed(len(prompt), new[t.name], t.num_nodes) <= context}
    twins = {name: decoder.for_policy(FixedTree(name, tree)) for name, tree in fits.items()}
    names, times = list(twins), defaultdict(list)
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            twin = twins[name]
            request = twin.prefill(prompt, DecodingConfig(policy="fixed", max_new_tokens=new[name]))
            twin.step(request)
            synchronize(loaded.device)
            start = time.perf_counter()
            for _ in range(steps):
                twin.step(request)
            synchronize(loaded.device)
            times[name].append((time.perf_counter() - start) / steps)
    return {name: statistics.median(seconds) for name, seconds in times.items()}


def price(timer: Callable[[], SpecDecoder], trees: list[Topology], tau: dict[str, float], table: CostTable,
          steps: int = 12, rounds: int = 3, batch: int = 4) -> dict[str, float]:
    """Seconds a step of each of `trees`, from `table` where it has them; the others that may be chosen timed
    through the decoder `timer` builds (only when one is to be timed) and added to the table. First roughly (2 steps,
    one round), `batch` trees at a time from the fewest nodes up, leaving out a tree that could not come within
    CONTENDER of the fastest tokens a second (`tau[name]` tokens a step) even at the cost of the dearest smaller tree
    plus half the growth a node the known trees show beyond it (a step costs more with more nodes); then again with
    `steps` and `rounds`, those within CONTENDER of the fastest and the one-node tree every adaptive policy falls back
    to. Trees left out get no cost, and the table records them as left out."""
    decoder = functools.cache(timer)
    costs = {t.name: table.seconds(t) for t in trees if table.seconds(t) is not None}
    missing = sorted((t for t in dict.fromkeys(trees) if t.name not in costs), key=lambda t: t.num_nodes)

    def hopeless(tree: Topology) -> bool:
        below = sorted((t.num_nodes, costs[t.name]) for t in trees if t.name in costs and t.num_nodes < tree.num_nodes)
        if not below:
            return False
        # at least the dearest smaller tree's cost, and half the growth a node the known trees show beyond it
        (fewest, first), (most, dearest) = below[0], max(below, key=lambda nc: nc[1])
        growth = max(0.0, (dearest - first) / (most - fewest)) if most > fewest else 0.0
        floor = dearest + 0.5 * growth * (tree.num_nodes - most)
        fastest = max(tau.get(name, 1.0) / s for name, s in costs.items())
        return tau.get(tree.name, 1.0) / floor < CONTENDER * fastest

    rough: dict[str, float] = {}
    weighed = [t for t in missing if shape_key(t) not in table.entries]  # not yet timed, nor left out before
    while missing:
        now = [t for t in missing[:batch] if not hopeless(t)]
        missing = [t for t in missing[batch:] if not hopeless(t)]
        timed = step_seconds(decoder(), now, steps=2, rounds=1) if now else {}
        rough.update(timed)
        costs.update(timed)
    if rough:
        fastest = max(tau.get(name, 1.0) / s for name, s in costs.items())
        again = [t for t in trees if t.name in rough and
                 (tau.get(t.name, 1.0) / rough[t.name] >= CONTENDER * fastest or t.num_nodes == 1)]
        precise = step_seconds(decoder(), again, steps, rounds) if again else {}
    else:
        precise = {}
    left_out = [t for t in weighed if t.name not in rough]
    if rough or left_out:
        table.add({t: (precise[t.name], steps * rounds) if t.name in precise else (rough[t.name], 2)
                   for t in trees if t.name in rough}, left_out)
    return {t.name: table.seconds(t) for t in trees if table.seconds(t) is not None}


def _weighed_trees(policy: Adaptive) -> list[Topology]:
    """The trees an adaptive policy weighs: those it runs and those it may settle on, where its bank costs them."""
    return [t for t in dict.fromkeys([*policy.trees(), *policy.homes]) if t.name in policy.costs]


def awaiting(policy: Policy, table: CostTable) -> str | None:
    """Where `policy` adapts to content and `table` has not weighed every tree it weighs: a line saying that it runs
    at its bank's costs until they are measured here (measure_costs, later); None where the table covers them, or
    the policy does not adapt."""
    if not isinstance(policy, Adaptive):
        return None
    trees = _weighed_trees(policy)
    if table.covers(trees):
        return None
    unknown = sum(table.seconds(t) is None for t in trees)
    where = table.path if table.path is not None else "memory"
    return (f"step costs the bank's until measured here after the first row ({unknown} of {len(trees)} trees not "
            f"timed in {where}): " + ", ".join(f"{t.name} {1e3 * policy.costs[t.name]:.1f} ms"
                                      for t in sorted(policy.trees(), key=lambda t: policy.costs.get(t.name, 0.0))
                                      if t.name in policy.costs))


def measure_costs(policy: Policy, timer: Callable[[], SpecDecoder], table: CostTable | None = None) -> str | None:
    """Where `policy` adapts to content: the step costs of its trees and of every tree it may settle on (its
    bank's) put in place of its bank's, from `table` or measured into it through the decoder `timer` builds (price:
    only when a tree is to be timed), the policy settled at those costs (Adaptive.settle: it may run another star,
    whose trees the caller then builds), and a line saying where the costs came from; None for any other policy."""
    if not isinstance(policy, Adaptive):
        return None
    table = table if table is not None else CostTable({}, None)
    trees = _weighed_trees(policy)
    before = policy.inner.trees()
    started = time.perf_counter()
    costs = price(timer, trees, policy.prior, table)
    spent = time.perf_counter() - started
    star = policy.settle(costs)
    ran = sorted(policy.trees(), key=lambda t: costs.get(t.name, 0.0))
    line = (f"step costs {table.describe(trees, spent)}: "
            + ", ".join(f"{t.name} {1e3 * costs[t.name]:.1f} ms" for t in ran if t.name in costs))
    if star is not None:
        line += (f"; star {star.name} at these costs (the bank's: "
                 f"{'/'.join(dict.fromkeys(t.name for t in before))})")
    return line
