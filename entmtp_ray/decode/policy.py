"""Tree-choosing policies behind one method, looked up by name. No model or tensor maths here.

A policy names every tree it may use up front (so their buffers are built once, at load),
picks one tree per step with `choose()`, and sees each finished step through `observe()`.
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING, Protocol

from entmtp_ray.config import DecodingConfig

if TYPE_CHECKING:
    from entmtp_ray.calibrate.bank import Bank


class StepView(Protocol):
    """What a policy may read of a finished step (decoding.StepTrace satisfies it)."""

    tree: str
    accepted_length: int
    entropy: list[float]
    top1_prob: list[float]


class Policy(Protocol):
    name: str
    # the verifier statistic observe() reads ("entropy" or "top1"), None when it reads none; the
    # decoder computes only that one, so a policy with nothing to switch costs what a fixed tree does
    signal_stat: str | None

    def trees(self) -> list[str]: ...

    def reset(self) -> None: ...

    def choose(self) -> str: ...

    def observe(self, step: StepView) -> None: ...


class FixedTree:
    """The same tree every step (AR, Hydra's and Medusa's defaults, any tree file)."""

    signal_stat = None

    def __init__(self, name: str, tree: str):
        self.name = name
        self.tree = tree

    def trees(self) -> list[str]:
        return [self.tree]

    def reset(self) -> None:
        pass

    def choose(self) -> str:
        return self.tree

    def observe(self, step: StepView) -> None:
        pass


# ---- scheduling signals (oriented as uncertainty: lower = more confident) -----------------------

class Signal:
    """A running estimate updated after every step: s <- beta*s + (1-beta)*x for each observation x."""

    stat = "entropy"  # the StepView field its observations come from: "entropy" or "top1"

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


SIGNALS = {"entropy": EntropySignal, "top1": Top1Signal, "path": PathSignal}


def make_signal(name: str, beta: float = 0.9, initial: float = 0.0) -> Signal:
    if name not in SIGNALS:
        raise ValueError(f"unknown signal '{name}'; choose one of {sorted(SIGNALS)}")
    return SIGNALS[name](beta, initial)


class LadderPolicy:
    """K trees for K intervals of the signal: trees[i] while thresholds[i-1] <= s < thresholds[i]
    (trees ordered from the most confident interval to the least). A ladder of one tree reads no signal."""

    def __init__(self, name: str, trees: list[str], thresholds: list[float], signal: Signal):
        if len(trees) != len(thresholds) + 1 or list(thresholds) != sorted(thresholds):
            raise ValueError("a ladder needs K trees and K-1 ascending thresholds")
        self.name, self._trees, self.thresholds, self.signal = name, list(trees), list(thresholds), signal
        self.signal_stat = signal.stat if len(set(trees)) > 1 else None
        self.current = self._pick()

    def _pick(self) -> str:
        return self._trees[bisect.bisect_right(self.thresholds, self.signal.value)]

    def trees(self) -> list[str]:
        return list(dict.fromkeys(self._trees))

    def reset(self) -> None:
        self.signal.reset()
        self.current = self._pick()

    def choose(self) -> str:
        return self.current

    def observe(self, step: StepView) -> None:
        if self.signal_stat is not None:
            self.signal.update(step)
            self.current = self._pick()


class HysteresisPolicy:
    """Two trees with hysteresis: go aggressive once s <= tau_on, back to conservative once
    s >= tau_off (tau_on < tau_off), so a signal wandering between them never flips the tree.
    When the two trees are the same (a bank whose sweep found no pair faster), it reads no signal."""

    def __init__(self, name: str, conservative: str, aggressive: str, tau_on: float, tau_off: float,
                 signal: Signal, start_aggressive: bool = False):
        if not tau_on < tau_off:
            raise ValueError(f"hysteresis needs tau_on < tau_off, got {tau_on} and {tau_off}")
        self.name, self.conservative, self.aggressive = name, conservative, aggressive
        self.tau_on, self.tau_off, self.signal, self.start_aggressive = tau_on, tau_off, signal, start_aggressive
        self.is_aggressive = start_aggressive
        self.signal_stat = signal.stat if conservative != aggressive else None

    def trees(self) -> list[str]:
        return list(dict.fromkeys([self.conservative, self.aggressive]))

    def reset(self) -> None:
        self.signal.reset()
        self.is_aggressive = self.start_aggressive

    def choose(self) -> str:
        return self.aggressive if self.is_aggressive else self.conservative

    def observe(self, step: StepView) -> None:
        if self.signal_stat is None:
            return
        s = self.signal.update(step)
        if self.is_aggressive and s >= self.tau_off:
            self.is_aggressive = False
        elif not self.is_aggressive and s <= self.tau_on:
            self.is_aggressive = True


def _fixed(cfg: DecodingConfig) -> FixedTree:
    if not cfg.tree:
        raise ValueError("--policy fixed needs --tree NAME_OR_JSON_FILE")
    return FixedTree("fixed", cfg.tree)


def _signal(cfg: DecodingConfig, bank: Bank):
    name, params = bank.policy.for_signal(cfg.signal)
    return make_signal(name, bank.policy.beta, params.initial), params


def _star(cfg: DecodingConfig, bank: Bank) -> FixedTree:
    return FixedTree("entmtp-star", bank.topology(bank.policy.star))


def _ladder(cfg: DecodingConfig, bank: Bank) -> LadderPolicy:
    signal, p = _signal(cfg, bank)
    return LadderPolicy("entmtp-ladder", [bank.topology(t) for t in p.ladder_trees], p.ladder_thresholds, signal)


def _hysteresis(cfg: DecodingConfig, bank: Bank) -> HysteresisPolicy:
    signal, p = _signal(cfg, bank)
    return HysteresisPolicy("entmtp-tau", bank.topology(p.conservative), bank.topology(p.aggressive), p.tau_on,
                            p.tau_off, signal)


POLICIES = {
    "ar": lambda cfg: FixedTree("ar", "ar"),
    "hydra": lambda cfg: FixedTree("hydra", "hydra"),
    "medusa": lambda cfg: FixedTree("medusa", "medusa"),
    "fixed": _fixed,
}
BANK_POLICIES = {"entmtp-star": _star, "entmtp-ladder": _ladder, "entmtp-tau": _hysteresis}


def make_policy(cfg: DecodingConfig, bank: Bank | None = None) -> Policy:
    """The policy named by cfg.policy; the entmtp ones take their trees and thresholds from `bank`."""
    if cfg.policy not in POLICIES and cfg.policy not in BANK_POLICIES:
        raise ValueError(f"unknown policy '{cfg.policy}'; choose one of {sorted([*POLICIES, *BANK_POLICIES])}")
    if cfg.tree and cfg.policy != "fixed":
        raise ValueError(f"--tree applies to --policy fixed only (got --policy {cfg.policy})")
    if cfg.policy in BANK_POLICIES:
        if bank is None:
            raise ValueError(f"--policy {cfg.policy} needs a topology bank (--task or --bank)")
        return BANK_POLICIES[cfg.policy](cfg, bank)
    return POLICIES[cfg.policy](cfg)
