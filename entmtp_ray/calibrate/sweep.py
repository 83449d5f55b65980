"""The bank's candidate trees and the policy sweep: deterministic arithmetic over measured rollouts,
rank tables and step times (the measuring lives in pipeline/calibration.py). Each policy is
replayed over every calibration rollout without the model (calibrate/growth.py's replay); the highest
replayed tokens/s wins. See docs/design.md §6.
"""

from __future__ import annotations

from itertools import combinations

from entmtp_ray.calibrate.bank import PolicyParams, SignalParams
from entmtp_ray.calibrate.growth import Replay, ReplayStep, accepted_lengths, replay
from entmtp_ray.decode.policy import SIGNALS, VERIFIER_STATS, FixedTree, HysteresisPolicy, LadderPolicy, make_signal
from entmtp_ray.decode.tree import Topology, TreePath, make_topology

CANDIDATE_SIZES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 28, 32, 40, 48, 56, 64)
# a switching pair is kept only when its replay beats the star by this much: the replay counts no scheduling
# time (reading the signal took up to 1.1% of decode time in the benchmarks) and few rollouts make it noisy;
# a pair 0.04% faster in the replay of an auto bank ran 4% slower than its star (docs/measurements.md)
MIN_SWITCH_GAIN = 0.02
# the star is the smallest frontier tree whose replay is within this of the fastest: the step times are medians
# over 3 timing prompts and vary by a few percent between runs, and a smaller tree's step grows less with the
# context (ShareGPT's frontier from 4 to 16 nodes spans 2% of replayed tokens/s)
STAR_TOLERANCE = 0.01
# the star chosen by measurement is the smallest measured tree within this of the fastest measured: a tree that
# does not decode clearly faster than a smaller one (the 1-node tree included) costs more as the context grows
MEASURED_TOLERANCE = 0.01
QUANTILES = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


def candidate_trees(grown: list[tuple[TreePath, ...]], budget: int, task: str) -> dict[str, Topology]:
    """The root-only tree and the grown trees at CANDIDATE_SIZES up to `budget`, named <task>-n<nodes>."""
    out = {f"{task}-n1": make_topology([], f"{task}-n1")}
    for paths in grown:
        nodes = len(paths) + 1
        if nodes in CANDIDATE_SIZES and nodes <= budget:
            out[f"{task}-n{nodes}"] = make_topology(paths, f"{task}-n{nodes}")
    return out


def replay_all(rollouts, policy, step_seconds: dict[str, float], prefill_seconds: float = 0.0,
               lengths: list[dict[str, list[int]]] | None = None) -> Replay:
    """A policy replayed over every calibration rollout, pooled (see growth.replay); `lengths`,
    one growth.accepted_lengths per rollout, makes repeated replays several times faster."""
    total = Replay()
    for k, r in enumerate(rollouts):
        replay(r.rows, r.entropy, r.top1, policy, step_seconds, into=total,
               lengths=lengths[k] if lengths is not None else None)
    total.seconds += prefill_seconds
    return total


def signal_quantiles(rollouts, name: str, beta: float, lengths: list[dict[str, list[int]]] | None = None,
                     trees: list[str] = ()) -> list[float]:
    """Quantiles of the EMA signal as a fixed policy would see it over the calibration rollouts: a verifier
    signal after every rollout token; the `accepted` signal after every step of each of `trees` (`lengths`:
    growth.accepted_lengths per rollout), pooled, since what it observes depends on the tree (a one-node tree
    always accepts 1) and a switching policy reads it under its small and its large tree."""
    signal, values = make_signal(name, beta, 0.0), []
    for k, r in enumerate(rollouts):
        if signal.stat not in VERIFIER_STATS:
            for tree in trees:
                signal.reset()
                i, end = 0, len(r.rows)
                while i + 1 < end:
                    a = lengths[k][tree][i]
                    values.append(signal.update(ReplayStep(tree, min(a, end - 1 - i), [], [])))
                    i += a
            continue
        signal.reset()
        for i in range(len(r.rows)):
            values.append(signal.update(ReplayStep("", 1, [r.entropy[i]], [r.top1[i]])))
    values.sort()
    return [values[int(q * (len(values) - 1))] for q in QUANTILES]


def choose_policies(rollouts, trees: dict[str, Topology], step_seconds: dict[str, float], prefill_seconds: float,
                    frontier: list[str], beta: float = 0.9, top: int = 6,
                    lengths: list[dict[str, list[int]]] | None = None) -> tuple[PolicyParams, dict]:
    """Sweep the star tree, the ladder and the hysteresis pair per signal on the calibration
    rollouts; the highest replayed tokens/s wins each. Returns the settings and the sweep's figures.
    `lengths`: growth.accepted_lengths per rollout when the caller already has them."""
    if lengths is None:
        lengths = [accepted_lengths(r.rows, trees.values()) for r in rollouts]

    def rate(policy) -> float:
        return replay_all(rollouts, policy, step_seconds, prefill_seconds, lengths).tokens_per_s

    fixed = {name: rate(FixedTree(name, trees[name])) for name in frontier}
    fastest = max(fixed.values())
    star = min((n for n in frontier if fixed[n] >= (1 - STAR_TOLERANCE) * fastest), key=lambda n: trees[n].num_nodes)
    best_trees = sorted(frontier, key=lambda n: -fixed[n])[:top]
    by_size = sorted(best_trees, key=lambda n: -trees[n].num_nodes)  # most aggressive first
    drafting = [n for n in by_size if trees[n].num_nodes > 1] or by_size  # a one-node tree's steps all accept 1
    figures = {"fixed_tokens_per_s": fixed, "signals": {}}
    signals = {}
    for name in SIGNALS:
        qs = signal_quantiles(rollouts, name, beta, lengths, drafting)
        initial = qs[len(qs) // 2]
        # hysteresis: (conservative, aggressive) with the aggressive tree at least as large; the
        # pair (star, star) is the static tree, so the sweep never does worse than entmtp-star
        best_tau = (fixed[star], (star, star, qs[0], qs[-1]))
        for small, big in [(a, b) for a in by_size for b in by_size if trees[b].num_nodes > trees[a].num_nodes]:
            for on, off in combinations(qs, 2):
                if on >= off:
                    continue
                r = rate(HysteresisPolicy("t", trees[small], trees[big], on, off, make_signal(name, beta, initial)))
                if r > best_tau[0]:
                    best_tau = (r, (small, big, on, off))
        # ladder: three trees, most confident (largest) first, two thresholds
        best_ladder = (fixed[star], ([star], []))
        for triple in combinations(by_size, 3):
            for low, high in combinations(qs, 2):
                if low >= high:
                    continue
                r = rate(LadderPolicy("l", [trees[n] for n in triple], [low, high], make_signal(name, beta, initial)))
                if r > best_ladder[0]:
                    best_ladder = (r, (list(triple), [low, high]))
        small, big, on, off = best_tau[1]
        gain = best_tau[0] / fixed[star] - 1.0
        if gain < MIN_SWITCH_GAIN:  # not worth reading a signal: entmtp-tau runs the star
            small = big = star
        signals[name] = SignalParams(initial=initial, ladder_trees=best_ladder[1][0],
                                     ladder_thresholds=best_ladder[1][1], conservative=small, aggressive=big,
                                     tau_on=on, tau_off=off, gain=gain)
        figures["signals"][name] = {"quantiles": qs, "tau_tokens_per_s": best_tau[0],
                                    "ladder_tokens_per_s": best_ladder[0], "gain": gain}
    # the signal whose switching gains most; where none gains MIN_SWITCH_GAIN, every pair is the star twice and
    # entmtp-tau reads no signal
    default = max(signals, key=lambda n: figures["signals"][n]["tau_tokens_per_s"])
    return PolicyParams(star=star, signal=default, beta=beta, signals=signals), figures


def select_measured(fixed: dict[str, float], nodes: dict[str, int], switching: float | None) -> tuple[str, bool]:
    """(star, keep the switching pair) from measured tokens/s: `fixed`, each fixed tree's (the bank's best replayed
    trees, Hydra's tree, the 1-node tree); `switching`, the pair's, or None when the sweep kept none. The star is the
    smallest tree within MEASURED_TOLERANCE of the fastest, so no tree measured faster than it by more than that (not
    Hydra's, not plain decoding); the pair is kept only when it measured MIN_SWITCH_GAIN faster than the star."""
    fastest = max(fixed.values())
    star = min((n for n in fixed if fixed[n] >= (1 - MEASURED_TOLERANCE) * fastest), key=lambda n: (nodes[n], n))
    return star, switching is not None and switching >= (1 + MIN_SWITCH_GAIN) * fixed[star]


def with_star(policy: PolicyParams, star: str, keep_pair: bool) -> PolicyParams:
    """`policy` with `star` as its star; without the pair, every signal's entmtp-tau runs the star too (and reads no
    signal), as a pair the sweep found not worth switching for does."""
    signals = policy.signals if keep_pair else {
        name: p.model_copy(update={"conservative": star, "aggressive": star}) for name, p in policy.signals.items()}
    return policy.model_copy(update={"star": star, "signals": signals})
