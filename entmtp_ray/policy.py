"""Tree-choosing policies behind one method, looked up by name. No model or tensor maths here.

A policy names every tree it may use up front (so their buffers are built once, at load),
picks one tree per step with `choose()`, and sees each finished step through `observe()`.
"""

from __future__ import annotations

from typing import Protocol

from .config import DecodingConfig


class StepView(Protocol):
    """What a policy may read of a finished step (decoding.StepTrace satisfies it)."""

    tree: str
    accepted_length: int
    entropy: list[float]
    top1_prob: list[float]


class Policy(Protocol):
    name: str

    def trees(self) -> list[str]: ...

    def reset(self) -> None: ...

    def choose(self) -> str: ...

    def observe(self, step: StepView) -> None: ...


class FixedTree:
    """The same tree every step (AR, Hydra's and Medusa's defaults, any tree file)."""

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


def _fixed(cfg: DecodingConfig) -> FixedTree:
    if not cfg.tree:
        raise ValueError("--policy fixed needs --tree NAME_OR_JSON_FILE")
    return FixedTree("fixed", cfg.tree)


POLICIES = {
    "ar": lambda cfg: FixedTree("ar", "ar"),
    "hydra": lambda cfg: FixedTree("hydra", "hydra"),
    "medusa": lambda cfg: FixedTree("medusa", "medusa"),
    "fixed": _fixed,
}


def make_policy(cfg: DecodingConfig) -> Policy:
    if cfg.policy not in POLICIES:
        raise ValueError(f"unknown policy '{cfg.policy}'; choose one of {sorted(POLICIES)}")
    if cfg.tree and cfg.policy != "fixed":
        raise ValueError(f"--tree applies to --policy fixed only (got --policy {cfg.policy})")
    return POLICIES[cfg.policy](cfg)
