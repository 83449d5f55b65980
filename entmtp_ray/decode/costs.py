"""Step costs measured where a decoder runs: what an adaptive policy (policy.Adaptive) weighs its trees' accepted
lengths against, in place of the costs its bank was timed with on another machine (docs/design.md §2)."""

from __future__ import annotations

import statistics
import time
from collections import defaultdict

from entmtp_ray.config import DecodingConfig
from entmtp_ray.decode.loop import SpecDecoder
from entmtp_ray.decode.policy import Adaptive, FixedTree
from entmtp_ray.decode.static import positions_needed
from entmtp_ray.decode.tree import Topology
from entmtp_ray.model.loading import synchronize

PROMPT_TOKENS = 64  # a step's cost depends on the context's length, not its content: an ordinary prompt's length


def step_seconds(decoder: SpecDecoder, trees: list[Topology], steps: int = 12, rounds: int = 3) -> dict[str, float]:
    """Seconds per decoding step of each tree through `decoder` (its model, drafter and verifier, as a job's steps
    run them: a one-node tree without the heads, as an adaptive policy's fallback runs it), after a prompt of
    PROMPT_TOKENS fixed token ids: `steps` steps a round, whatever they accept, the trees in turn with the order
    rotated per round so that a machine slowing down slows every tree alike, the median of `rounds` rounds after a
    warm-up. A tree whose steps do not fit the model's context after the prompt is left out."""
    loaded = decoder.loaded
    context = decoder.cache.capacity if decoder.static else loaded.max_positions
    prompt = [(7 * i + 3) % loaded.model.config.vocab_size for i in range(min(PROMPT_TOKENS, context // 4))]
    fits = {t.name: t for t in trees if positions_needed(len(prompt), steps * t.num_nodes, t.num_nodes) <= context}
    twins = {name: decoder.for_policy(FixedTree(name, tree)) for name, tree in fits.items()}
    names, times = list(twins), defaultdict(list)
    for r in range(rounds + 1):
        for name in names[r % len(names):] + names[: r % len(names)]:
            twin = twins[name]
            request = twin.prefill(prompt, DecodingConfig(policy="fixed", max_new_tokens=steps * fits[name].num_nodes))
            synchronize(loaded.device)
            start = time.perf_counter()
            for _ in range(steps):
                twin.step(request)
            synchronize(loaded.device)
            if r:
                times[name].append((time.perf_counter() - start) / steps)
    return {name: statistics.median(seconds) for name, seconds in times.items()}


def measure_costs(decoder: SpecDecoder, measured: dict[Topology, float] | None = None) -> str | None:
    """Where the decoder's policy adapts to content: its trees' step costs measured here (`step_seconds`) put in
    place of its bank's, and a line saying so; None for any other policy. `measured`: costs already measured on this
    model (by tree), which are reused and to which the new ones are added, so that a process times each tree once."""
    policy = decoder.policy
    if not isinstance(policy, Adaptive):
        return None
    measured = {} if measured is None else measured
    trees = [t for t in policy.trees() if t.name in policy.costs]
    missing = [t for t in trees if t not in measured]
    if missing:
        fresh = step_seconds(decoder, missing)
        measured.update((t, fresh[t.name]) for t in missing if t.name in fresh)
    costs = {t.name: measured[t] for t in trees if t in measured}
    policy.costs.update(costs)
    return "step costs measured here: " + ", ".join(f"{name} {1e3 * s:.1f} ms" for name, s in sorted(
        costs.items(), key=lambda item: item[1]))
