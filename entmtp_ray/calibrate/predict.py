"""How well each scheduling signal predicts the next step's accepted length, from measured rollouts and without
the model: a fixed tree is replayed over each rollout (greedy output does not depend on the tree), every signal
is read before each step and updated after it, and each signal's values are set against the accepted lengths
of the steps they preceded. A signal worth switching on separates steps that will accept much from steps that
will accept little: a clearly negative correlation (signals are oriented lower = more confident) and accepted
lengths falling from its lowest quintile to its highest.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from entmtp_ray.calibrate.growth import replay
from entmtp_ray.calibrate.rollouts import Rollout
from entmtp_ray.decode.policy import SIGNALS, make_signal
from entmtp_ray.decode.tree import Topology

QUINTILES = 5


class _Recorder:
    """A fixed tree (a policy for growth.replay) that reads every signal before each step and updates them
    all after it."""

    signal_stat = None

    def __init__(self, tree: Topology, signals: dict):
        self.tree, self.signals = tree, signals
        self.values: dict[str, list[float]] = {name: [] for name in signals}
        self.lengths: list[int] = []

    def trees(self) -> list[Topology]:
        return [self.tree]

    def reset(self) -> None:
        for signal in self.signals.values():
            signal.reset()

    def choose(self) -> Topology:
        return self.tree

    def observe(self, step) -> None:
        for name, signal in self.signals.items():
            self.values[name].append(signal.value)
            signal.update(step)
        self.lengths.append(step.accepted_length)


def signal_trace(rollout: Rollout, tree: Topology, beta: float, names: Iterable[str] = tuple(SIGNALS),
                 skip: int = 1) -> tuple[dict[str, list[float]], list[int]]:
    """({signal: its value before each step}, [each step's accepted length]) of `tree` replayed over one
    rollout (growth.replay); the first `skip` steps are left out (every signal starts from its initial value)."""
    recorder = _Recorder(tree, {name: make_signal(name, beta, 0.0) for name in names})
    replay(rollout.rows, rollout.entropy, rollout.top1, recorder, {tree.name: 0.0})
    return {name: v[skip:] for name, v in recorder.values.items()}, recorder.lengths[skip:]


def signal_power(rollouts: Iterable[Rollout], tree: Topology, beta: float = 0.9) -> dict[str, dict]:
    """Per signal over all rollouts' steps: `pearson` (its value before a step against that step's accepted
    length), `tau_by_quintile` (mean accepted length of the steps in each fifth of its values, lowest =
    most confident first) and `steps`."""
    pooled: dict[str, list[float]] = {name: [] for name in SIGNALS}
    lengths: list[int] = []
    for rollout in rollouts:
        values, steps = signal_trace(rollout, tree, beta)
        for name in pooled:
            pooled[name] += values[name]
        lengths += steps
    y = np.asarray(lengths, dtype=float)
    out = {}
    for name, values in pooled.items():
        x = np.asarray(values, dtype=float)
        pearson = float(np.corrcoef(x, y)[0, 1]) if len(x) > 2 and x.std() > 0 and y.std() > 0 else None
        order = np.argsort(x, kind="stable")
        out[name] = {"pearson": pearson, "steps": len(x),
                     "tau_by_quintile": [float(y[part].mean()) for part in np.array_split(order, QUINTILES)]}
    return out


def power_table(power: dict[str, dict]) -> str:
    """The figures as a Markdown table, a signal per line."""
    head = "| signal | steps | Pearson r | " + " | ".join(f"tau Q{q + 1}" for q in range(QUINTILES)) + " |"
    lines = [head, "|" + "---|" * (3 + QUINTILES)]
    for name, p in power.items():
        r = "-" if p["pearson"] is None else f"{p['pearson']:+.2f}"
        lines.append(f"| {name} | {p['steps']} | {r} | " + " | ".join(f"{t:.2f}" for t in p["tau_by_quintile"]) + " |")
    return "\n".join(lines)
