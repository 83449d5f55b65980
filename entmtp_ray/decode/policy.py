"""Tree-choosing policies behind one method, and the scheduling signals they read. No model or
tensor maths here, and no bank: calibrate.bank.build_policy builds every policy by name, the EntMTP ones from a
bank.

A policy names every tree it may use up front (so their buffers are built once, at load),
picks one tree per step with `choose()`, and sees each finished step through `observe()`.
Trees are Topology values throughout (decode/tree.py); a step names its tree by `Topology.name`.
"""

from __future__ import annotations

import bisect
from typing import Protocol

from entmtp_ray.config import DecodingConfig
from entmtp_ray.decode.tree import Topology, load_topology


class StepView(Protocol):
    """What a policy may read of a finished step (decoding.StepTrace satisfies it)."""

    tree: str  # the Topology.name of the step's tree
    accepted_length: int
    entropy: list[float]
    top1_prob: list[float]
    path: tuple[int, ...]  # the rank path of the deepest node verification accepted (() for the root alone)


class Policy(Protocol):
    name: str
    # the statistic observe() reads ("entropy" or "top1", which the decoder computes, or "accepted"), None when
    # it reads none; the decoder computes only that one, so a policy with nothing to switch costs what a fixed
    # tree does
    signal_stat: str | None

    def trees(self) -> list[Topology]: ...

    def reset(self) -> None: ...

    def choose(self) -> Topology: ...

    def observe(self, step: StepView) -> None: ...


class FixedTree:
    """The same tree every step (AR, Hydra's and Medusa's defaults, any tree file)."""

    signal_stat = None

    def __init__(self, name: str, tree: Topology):
        self.name = name
        self.tree = tree

    def trees(self) -> list[Topology]:
        return [self.tree]

    def reset(self) -> None:
        pass

    def choose(self) -> Topology:
        return self.tree

    def observe(self, step: StepView) -> None:
        pass


# ---- scheduling signals (oriented as uncertainty: lower = more confident) -----------------------

VERIFIER_STATS = ("entropy", "top1")  # the signals' statistics the decoder computes from the verifier's logits


class Signal:
    """A running estimate updated after every step: s <- beta*s + (1-beta)*x for each observation x."""

    # the StepView field its observations come from: "entropy" or "top1" (VERIFIER_STATS, which the decoder
    # computes for it), or "accepted" (the step's accepted length, which costs nothing)
    stat = "entropy"

    def __init__(self, beta: float, initial: float):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"signal beta must be in [0, 1), got {beta}")
        self.beta, self.initial = beta, initial
        self.value = initial

    def reset(self) -> None:
        self.value = self.initial

    def observations(self, step: StepView) -> list[float]:
        raise NotImplementedError

    def update(self, step: StepView) -> float:
        for x in self.observations(step):
            self.value = self.beta * self.value + (1.0 - self.beta) * x
        return self.value


class EntropySignal(Signal):
    """The paper's: the verifier's next-token entropy (nats) at each accepted token."""

    def observations(self, step: StepView) -> list[float]:
        return list(step.entropy)


class Top1Signal(Signal):
    """1 - the verifier's top-1 probability at each accepted token."""

    stat = "top1"

    def observations(self, step: StepView) -> list[float]:
        return [1.0 - p for p in step.top1_prob]


class PathSignal(Signal):
    """1 - the step's path value, EAGLE-2 style: the product of top-1 probabilities along the
    accepted path (one observation per step)."""

    stat = "top1"

    def observations(self, step: StepView) -> list[float]:
        value = 1.0
        for p in step.top1_prob:
            value *= p
        return [1.0 - value]


class AcceptedSignal(Signal):
    """The accepted lengths themselves, negated (lower = more confident, as every signal): one observation per
    step, -accepted_length. What drafting achieved lately predicts the next step (docs/design.md §2), and it
    needs no verifier statistic."""

    stat = "accepted"

    def observations(self, step: StepView) -> list[float]:
        return [-float(step.accepted_length)]


SIGNALS = {"entropy": EntropySignal, "top1": Top1Signal, "path": PathSignal, "accepted": AcceptedSignal}


def make_signal(name: str, beta: float = 0.9, initial: float = 0.0) -> Signal:
    if name not in SIGNALS:
        raise ValueError(f"unknown signal '{name}'; choose one of {sorted(SIGNALS)}")
    return SIGNALS[name](beta, initial)


class LadderPolicy:
    """K trees for K intervals of the signal: trees[i] while thresholds[i-1] <= s < thresholds[i]
    (trees ordered from the most confident interval to the least). A ladder of one tree reads no signal."""

    def __init__(self, name: str, trees: list[Topology], thresholds: list[float], signal: Signal):
        if len(trees) != len(thresholds) + 1 or list(thresholds) != sorted(thresholds):
            raise ValueError("a ladder needs K trees and K-1 ascending thresholds")
        self.name, self._trees, self.thresholds, self.signal = name, list(trees), list(thresholds), signal
        self.signal_stat = signal.stat if len(set(trees)) > 1 else None
        self.current = self._pick()

    def _pick(self) -> Topology:
        return self._trees[bisect.bisect_right(self.thresholds, self.signal.value)]

    def trees(self) -> list[Topology]:
        return list(dict.fromkeys(self._trees))

    def reset(self) -> None:
        self.signal.reset()
        self.current = self._pick()

    def choose(self) -> Topology:
        return self.current

    def observe(self, step: StepView) -> None:
        if self.signal_stat is not None:
            self.signal.update(step)
            self.current = self._pick()


class HysteresisPolicy:
    """Two trees with hysteresis: go aggressive once s <= tau_on, back to conservative once
    s >= tau_off (tau_on < tau_off), so a signal wandering between them never flips the tree.
    When the two trees are the same (a bank whose sweep found no pair faster), it reads no signal."""

    def __init__(self, name: str, conservative: Topology, aggressive: Topology, tau_on: float, tau_off: float,
                 signal: Signal, start_aggressive: bool = False):
        if not tau_on < tau_off:
            raise ValueError(f"hysteresis needs tau_on < tau_off, got {tau_on} and {tau_off}")
        self.name, self.conservative, self.aggressive = name, conservative, aggressive
        self.tau_on, self.tau_off, self.signal, self.start_aggressive = tau_on, tau_off, signal, start_aggressive
        self.is_aggressive = start_aggressive
        self.signal_stat = signal.stat if conservative != aggressive else None

    def trees(self) -> list[Topology]:
        return list(dict.fromkeys([self.conservative, self.aggressive]))

    def reset(self) -> None:
        self.signal.reset()
        self.is_aggressive = self.start_aggressive

    def choose(self) -> Topology:
        return self.aggressive if self.is_aggressive else self.conservative

    def observe(self, step: StepView) -> None:
        if self.signal_stat is None:
            return
        s = self.signal.update(step)
        if self.is_aggressive and s >= self.tau_off:
            self.is_aggressive = False
        elif not self.is_aggressive and s <= self.tau_on:
            self.is_aggressive = True


# smaller trees an adaptive policy may fall back to inside each tree it runs, besides the one-node tree: the largest
# of its known trees inside it with at most half its nodes (each is one more tree to build buffers for, or to
# capture a CUDA graph of)
FALLBACKS = 3


def fallbacks(tree: Topology, known: list[Topology]) -> list[Topology]:
    """The trees of `known` an adaptive policy running `tree` may fall back to: the one-node tree and up to FALLBACKS
    of the largest inside `tree` with at most half its nodes."""
    inside = [t for t in known if t.path_set <= tree.path_set and 2 * t.num_nodes <= tree.num_nodes]
    return ([t for t in inside if t.num_nodes == 1]
            + sorted((t for t in inside if t.num_nodes > 1), key=lambda t: -t.num_nodes)[:FALLBACKS])


class Adaptive:
    """A policy's tree, or a smaller one inside it where this request's own acceptance says the smaller emits
    faster: the tree choice a job adapts to its content with (docs/design.md §2, "Adapting to the content").

    Each tree the inner policy may run has candidates: the given trees whose every path it holds (the one-node
    tree among them). A step under tree R tells, for every candidate S inside R, how many tokens S would have
    accepted: the root and the longest prefix of the accepted rank path that S holds. That is exact for greedy and
    typical acceptance, which accept a node by its own token and its ancestors', and a node's draft is its rank
    path's in every tree; under exact acceptance it is an estimate. Each tree's accepted length is a running mean
    (factor `beta`) over the request's steps that ran a tree holding it, from `tau` (the bank's replayed one).
    choose() runs the inner policy's tree T unless a candidate S inside it would emit more than `margin` more
    tokens a second at those means and `costs` (seconds a step); then S, and T again every `probe` steps, so that
    T's own mean keeps up with the content.

    `homes`: every tree the policy may settle on (the bank's): settle() weighs them at step costs measured where the
    decoder runs (decode/costs.py) before its first request, and where one (of near-equals, the fewest nodes)
    emits more than `margin` faster at the bank's accepted lengths than each of the inner policy's trees, the policy
    runs that one as its star (its switching, chosen at the bank's costs, dropped), with its own fallbacks. The
    costs then stay as they are, so within a job the choice is a function of the request's tokens alone."""

    def __init__(self, inner: Policy, candidates: list[Topology], costs: dict[str, float], tau: dict[str, float],
                 beta: float = 0.9, margin: float = 0.05, probe: int = 16, homes: list[Topology] = ()):
        if not 0.0 <= beta < 1.0 or margin < 0 or probe < 1:
            raise ValueError(f"adaptive policy: beta in [0, 1), margin >= 0, probe >= 1 (got {beta}, {margin}, "
                             f"{probe})")
        self.inner, self.name, self.signal_stat = inner, inner.name, inner.signal_stat
        self.costs, self.prior = dict(costs), dict(tau)
        self.beta, self.margin, self.probe = beta, margin, probe
        self.homes = [t for t in dict.fromkeys(homes) if t.name in tau]
        self._place(candidates)
        self.reset()

    def _place(self, candidates: list[Topology]) -> None:
        known = [t for t in dict.fromkeys([*self.inner.trees(), *candidates])
                 if t.name in self.costs and t.name in self.prior]
        # every tree a step may run -> the known trees inside it, fewest nodes first (itself among them when known;
        # none for a tree without a cost: it runs as the inner policy picks it)
        self.inside = {t.name: sorted((s for s in known if s.path_set <= t.path_set), key=lambda s: s.num_nodes)
                       if t in known else [] for t in dict.fromkeys([*self.inner.trees(), *known])}

    def trees(self) -> list[Topology]:
        return list(dict.fromkeys([*self.inner.trees(), *(s for t in self.inner.trees() for s in self.inside[t.name])]))

    @property
    def signal(self) -> Signal | None:
        """The inner policy's signal (what a step's trace records), if it has one."""
        return getattr(self.inner, "signal", None)

    def reset(self) -> None:
        self.inner.reset()
        self.tau = dict(self.prior)
        self.held = 0  # steps the inner policy's tree has been passed over since it last ran

    def rate(self, tree: Topology) -> float:
        """Tokens a second this request would get from `tree` at its accepted length so far."""
        return self.tau[tree.name] / self.costs[tree.name]

    def settle(self, costs: dict[str, float]) -> Topology | None:
        """Take `costs` (seconds a step, by tree name) for the trees they name, and run as the star the smallest of
        the homes within `margin` of the fastest at the bank's accepted lengths (measured costs vary by a few percent
        between runs: of near-equals, the fewest nodes), where it is more than `margin` faster than each of the inner
        policy's trees; that star (None where the inner policy stays)."""
        self.costs.update(costs)
        priced = [t for t in self.homes if t.name in self.costs]
        own = [t for t in self.inner.trees() if t.name in self.costs and t.name in self.prior]
        self.tau = dict(self.prior)
        if not priced or not own:
            return None
        fastest = max(map(self.rate, priced))
        star = min((t for t in priced if self.rate(t) >= (1 - self.margin) * fastest),
                   key=lambda t: (t.num_nodes, t.name))
        if star in own or self.rate(star) <= (1 + self.margin) * max(map(self.rate, own)):
            self._place([t for tree in self.inner.trees() for t in fallbacks(tree, priced)])
            return None
        self.inner, self.signal_stat = FixedTree(self.name, star), None
        self._place(fallbacks(star, priced))
        self.reset()
        return star

    def choose(self) -> Topology:
        want = self.inner.choose()
        inside = self.inside[want.name]
        if len(inside) < 2:  # a tree without a cost, or with nothing known inside it
            return want
        best = max(inside, key=self.rate)  # the first of equals: the fewest nodes
        if best == want or self.rate(best) <= self.rate(want) * (1.0 + self.margin) or self.held + 1 >= self.probe:
            self.held = 0
            return want
        self.held += 1
        return best

    def observe(self, step: StepView) -> None:
        self.inner.observe(step)
        for tree in self.inside.get(step.tree, ()):
            depth = 0  # of the accepted path, how deep `tree` holds it
            while depth < len(step.path) and step.path[:depth + 1] in tree.path_set:
                depth += 1
            self.tau[tree.name] = self.beta * self.tau[tree.name] + (1.0 - self.beta) * (depth + 1)


def _fixed(cfg: DecodingConfig) -> FixedTree:
    if not cfg.tree:
        raise ValueError("--policy fixed needs --tree NAME_OR_JSON_FILE")
    return FixedTree("fixed", load_topology(cfg.tree))


# the policies built without a bank, by name (calibrate.bank.build_policy builds these and the EntMTP ones)
POLICIES = {
    "ar": lambda cfg: FixedTree("ar", load_topology("ar")),
    "hydra": lambda cfg: FixedTree("hydra", load_topology("hydra")),
    "medusa": lambda cfg: FixedTree("medusa", load_topology("medusa")),
    "fixed": _fixed,
}
