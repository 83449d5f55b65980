"""Topology bank files: the Pareto trees and policy settings measured for one (model, heads, task,
hardware), as versioned JSON (shipped ones under assets/banks/<model>/<task>.json), and the EntMTP
policies built from them. Validated on load: what cannot work is an error that names the fix; what
may merely be slow (another model or machine) is a warning. Format: docs/design.md §6.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from pydantic import BaseModel, Field, model_validator

from entmtp_ray.assets import shipped_bank, shipped_bank_variants
from entmtp_ray.config import DecodingConfig
from entmtp_ray.decode.policy import (POLICIES, SIGNALS, Adaptive, FixedTree, HysteresisPolicy, LadderPolicy,
                                      Policy, fallbacks, make_signal)
from entmtp_ray.decode.tree import Topology, make_topology
from entmtp_ray.model.loading import machine_name

log = logging.getLogger(__name__)
BANK_VERSION = 1


class BankTree(BaseModel):
    name: str = Field(..., description="unique within the bank, e.g. gsm8k-n28")
    paths: list[list[int]] = Field(..., description="child-rank paths (root implicit)")
    nodes: int = Field(..., ge=1, description="nodes including the root")
    tau_grown: float | None = Field(None, description="accepted length estimated during growth (joint tree)")
    tau: float | None = Field(None, description="accepted length re-measured with the tree's own mask")
    tokens_per_s: float | None = Field(None, description="end-to-end output tokens/s on the bank's hardware")

    @classmethod
    def of(cls, tree: Topology, **measured) -> BankTree:
        """The record of `tree` (its name and paths) with its measured figures."""
        return cls(name=tree.name, paths=[list(p) for p in tree.paths], nodes=tree.num_nodes, **measured)


@dataclass(frozen=True)
class Actors:
    """What the job knows of the actors that will decode before any of them starts: the facts the resolver
    (pipeline/assemble.resolve) checks a bank against (Hardware.matches)."""

    on_gpu: bool
    concurrency: int = 1
    quantize: str = "none"
    dtype: str | None = None  # what they compute in ('float32', 'bfloat16', ...), once known (--dtype auto: per host)


class Hardware(BaseModel):
    device: str = Field(..., description="cpu, or the GPU's name")
    threads: int = Field(..., ge=1, description="torch CPU threads")
    dtype: str = Field(..., description="base model dtype the bank was measured in")
    machine: str = Field("", description="CPU model / platform, for people reading the file")
    concurrency: int = Field(1, ge=1, description="requests in flight per actor (--concurrent-requests) the step "
                             "times were measured at: a tree's cost per request depends on how many share a forward")
    quantize: str = Field("none", description="the base model's weight quantization (--quantize) the step times "
                          "were measured with: it changes what a step of each tree size costs")
    activations: str = Field("float", description="the CPU products' inputs (--activations, resolved) the step times "
                             "were measured with: int8 makes every row cheaper; float in older files")
    backend: str = Field("", description="on a GPU, the torch and CUDA (or ROCm) versions the step times were "
                         "measured with: their kernels set what a step costs; empty on a CPU, and in older files")

    @property
    def on_gpu(self) -> bool:
        return self.device != "cpu"

    @property
    def step_cost(self) -> tuple[str, ...]:
        """The fields that set what a decoding step costs here, which a bank's trees were sized for: a GPU step
        depends on the GPU, dtype, backend, concurrency and quantization, not on the host CPU or its threads; a
        CPU step on its threads instead of a backend."""
        if self.on_gpu:
            return "device", "dtype", "backend", "concurrency", "quantize"
        return "device", "threads", "dtype", "concurrency", "quantize", "activations"

    def same_as(self, other: Hardware) -> bool:
        """Step costs measured here would be measured there too (a warning when a bank runs elsewhere)."""
        return self.step_cost == other.step_cost and all(getattr(self, name) == getattr(other, name)
                                                         for name in self.step_cost)

    def matches(self, actors: Actors) -> list[str]:
        """How `actors` differ from this hardware in what sizes a bank's trees by a large factor (empty: a bank
        timed here serves them): the kind of device, the requests per forward, the weights, and the dtype where
        `actors` know it (on a CPU without native bf16 a tree step costs several times what it does with it, so a
        bank's trees are far too big there). The rest of step_cost (the GPU's name, the CPU threads) only warns
        (same_as)."""
        differences = []
        if self.on_gpu != actors.on_gpu:
            differences.append(f"{'a GPU' if self.on_gpu else 'a CPU'}, not {'a GPU' if actors.on_gpu else 'a CPU'}")
        if self.concurrency != actors.concurrency:
            differences.append(f"{self.concurrency} concurrent requests, not {actors.concurrency}")
        if self.quantize != actors.quantize:
            differences.append(f"{self.quantize} weights, not {actors.quantize}")
        if actors.dtype is not None and self.dtype != actors.dtype:
            differences.append(f"{self.dtype}, not {actors.dtype}")
        return differences

    def key(self) -> dict:
        """The hardware in an auto bank's cache key: what sets its step costs (step_cost), so a GPU job reuses its
        bank on another host CPU. A CPU's key also holds the CPU model and leaves out the settings added since
        (concurrency 1, no quantization, no backend), so banks cached before they were settings keep their keys."""
        if self.on_gpu:
            return self.model_dump(include=set(self.step_cost))
        return self.model_dump(exclude={"backend"} | {name for name, old in (("concurrency", 1), ("quantize", "none"),
                                                                             ("activations", "float"))
                                                      if getattr(self, name) == old})

    def describe(self) -> str:
        extra = ([f"{self.concurrency} concurrent requests"] if self.concurrency > 1 else []) + (
            [f"{self.quantize} weights"] if self.quantize != "none" else []) + (
            [f"{self.activations} activations"] if self.activations != "float" else [])
        if self.on_gpu:
            return f"{self.device} ({', '.join([self.dtype, self.backend or 'backend not recorded', *extra])})"
        return f"{self.device} ({', '.join([f'{self.threads} threads', self.dtype, *extra])})"


class SignalParams(BaseModel):
    """The switching policies' settings for one signal (thresholds are in that signal's units)."""

    initial: float = Field(0.0, description="signal value at the start of a request (calibration mean)")
    ladder_trees: list[str] = Field(..., min_length=1, description="entmtp-ladder: trees, most confident first")
    ladder_thresholds: list[float] = Field(default_factory=list, description="ascending, one fewer than trees")
    conservative: str = Field(..., description="entmtp-tau: tree while the signal is high")
    aggressive: str = Field(..., description="entmtp-tau: tree while the signal is low")
    tau_on: float = Field(..., description="go aggressive once the signal <= tau_on")
    tau_off: float = Field(..., description="go conservative once the signal >= tau_off")
    gain: float | None = Field(None, description="replayed tokens/s of entmtp-tau with this signal over the star "
                               "tree's, less 1, on the calibration rollouts (0: switching gains nothing here)")

    @model_validator(mode="after")
    def _consistent(self):
        if len(self.ladder_thresholds) != len(self.ladder_trees) - 1 or \
                self.ladder_thresholds != sorted(self.ladder_thresholds):
            raise ValueError("ladder_thresholds must be ascending and one fewer than ladder_trees")
        if not self.tau_on < self.tau_off:
            raise ValueError(f"tau_on ({self.tau_on}) must be below tau_off ({self.tau_off})")
        return self


class PolicyParams(BaseModel):
    star: str = Field(..., description="entmtp-star: the one task-optimal tree")
    signal: str = Field("entropy", description="the signal used unless --signal picks another of `signals`")
    beta: float = Field(0.9, ge=0, lt=1, description="EMA factor of every signal")
    signals: dict[str, SignalParams] = Field(..., min_length=1, description="settings tuned per signal")

    @model_validator(mode="after")
    def _known(self):
        unknown = sorted(set(self.signals) - set(SIGNALS))
        if unknown:
            raise ValueError(f"unknown signal(s) {unknown}; choose from {sorted(SIGNALS)}")
        if self.signal not in self.signals:
            raise ValueError(f"default signal '{self.signal}' has no settings in the bank")
        return self

    def for_signal(self, name: str | None) -> tuple[str, SignalParams]:
        name = name or self.signal
        if name not in self.signals:
            raise ValueError(f"this bank has no settings for signal '{name}' (it has {sorted(self.signals)}); "
                             "drop --signal or rebuild the bank with it")
        return name, self.signals[name]


class Measured(BaseModel):
    """One policy the bank builder measured on its held-out prompts: what the replay predicted there, and what
    decoding them here gave."""

    name: str = Field(..., description="a bank tree, `hydra` (Hydra's tree) or `entmtp-tau` (the switching pair)")
    nodes: int | None = Field(None, description="the tree's nodes; None for the switching pair")
    replayed_tokens_per_s: float = Field(..., description="the replay's tokens/s on the held-out rollouts")
    replayed_tau: float
    measured_tokens_per_s: float = Field(..., description="median over the held-out prompts of decoding's tokens/s")
    measured_tau: float = Field(..., description="accepted tokens per step decoding the held-out prompts")


class Selection(BaseModel):
    """How the star and the switching pair were chosen: by decoding held-out prompts (prompts no tree was grown or
    replayed on), or, with too few rollouts to hold any out, by the replay alone."""

    by: str = Field(..., description="`measured` or `replay`")
    held_out: int = Field(0, ge=0, description="held-out prompts the candidates were measured on")
    candidates: list[Measured] = Field(default_factory=list)
    reason: str = Field("", description="why the star (and the pair, or none) won, in a line")


class Bank(BaseModel):
    version: int = Field(BANK_VERSION, description="file format version")
    model: str
    heads: str = Field(..., description="heads the acceptance was measured with")
    task: str
    hardware: Hardware
    calibration: dict = Field(..., description="prompts (source, subset, count, seed), tokens per rollout")
    created: str = Field(..., description="ISO date")
    trees: list[BankTree] = Field(..., min_length=1, description="the frontier, fewest nodes first")
    policy: PolicyParams
    selection: Selection | None = Field(None, description="how the policy was chosen (absent in older banks)")

    @model_validator(mode="after")
    def _names_resolve(self):
        names = [t.name for t in self.trees]
        if len(set(names)) != len(names):
            raise ValueError("bank tree names must be unique")
        p = self.policy
        used_trees = [p.star] + [t for q in p.signals.values() for t in (q.conservative, q.aggressive, *q.ladder_trees)]
        for used in used_trees:
            if used not in names:
                raise ValueError(f"policy uses tree '{used}', which is not in the bank")
        return self

    def tree(self, name: str) -> BankTree:
        return next(t for t in self.trees if t.name == name)

    def topology(self, name: str) -> Topology:
        return make_topology(self.tree(name).paths, name)


def selection_report(bank: Bank) -> str:
    """How the bank's policy was chosen: per measured candidate, replayed vs measured tokens/s and tau on the
    held-out prompts (how well the replay predicted), and the reason."""
    selection = bank.selection
    if selection is None or not selection.candidates:
        return f"selection: {selection.reason if selection else 'by replay (a bank from before measured selection)'}"
    lines = [f"selection on {selection.held_out} held-out prompts (tokens/s and tau: replayed / measured):"]
    for c in sorted(selection.candidates, key=lambda c: -c.measured_tokens_per_s):
        nodes = f"{c.nodes} nodes" if c.nodes else "switching"
        lines.append(f"  {c.name:<20} {nodes:>10}  {c.replayed_tokens_per_s:7.1f} / {c.measured_tokens_per_s:7.1f} "
                     f"tok/s  {c.replayed_tau:5.2f} / {c.measured_tau:5.2f} tau")
    return "\n".join([*lines, selection.reason])


def bank_hardware(path: str | Path) -> Hardware:
    """The hardware a bank file was timed on, read without checking its trees."""
    return Hardware.model_validate(json.loads(Path(path).read_text())["hardware"])


def default_bank_path(model_name: str, task: str, actors: Actors | None = None) -> Path:
    """The bank shipped for a model and task: assets/banks/<model>/<task>.json, or, for `actors` it was not timed on
    the kind of (Hardware.matches), the first variant of it that was (assets/banks/<model>/<variant>/<task>.json:
    for example fp32 CPUs). A path that may not exist when none ships."""
    shipped = shipped_bank_variants(model_name, task)
    if actors is not None:
        suited = next((p for p in shipped if not bank_hardware(p).matches(actors)), None)
        if suited is not None:
            return suited
    return shipped[0] if shipped else shipped_bank(model_name, task)


def resolve_bank_path(model_name: str, task: str | None, bank: str | None, actors: Actors | None = None) -> Path:
    if bank:
        return Path(bank)
    if not task:
        raise ValueError("the entmtp policies read a topology bank: pass --task NAME (uses "
                         "banks/<model>/<task>.json) or --bank FILE")
    return default_bank_path(model_name, task, actors)


def current_hardware(device: torch.device | str, dtype: torch.dtype | str, concurrency: int = 1,
                     quantize: str = "none", activations: str = "float") -> Hardware:
    """The hardware a bank measured here would record (Hardware.step_cost: what its step times depend on)."""
    device = torch.device(device)
    on_gpu = device.type == "cuda"
    return Hardware(device=torch.cuda.get_device_name(device) if on_gpu else "cpu", threads=torch.get_num_threads(),
                    dtype=str(dtype).replace("torch.", ""), machine=machine_name(), concurrency=concurrency,
                    quantize=quantize, activations=activations, backend=gpu_backend() if on_gpu else "")


def gpu_backend() -> str:
    """The torch build a GPU step runs on: 'torch 2.5.1, CUDA 12.4' (ROCm builds name their HIP version)."""
    toolkit = f"CUDA {torch.version.cuda}" if torch.version.cuda else f"ROCm {torch.version.hip}"
    return f"torch {torch.__version__}, {toolkit}"


def save_bank(bank: Bank, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(bank.model_dump_json(indent=1) + "\n")
    tmp.replace(path)


def warn_if_other_hardware(bank: Bank, hardware: Hardware, path: str | Path) -> None:
    if not bank.hardware.same_as(hardware):
        log.warning("bank %s was measured on %s, this is %s: tree throughput differs by hardware and "
                    "concurrency; rebuild it here with jobs/build_bank.py, or run --bank auto", path,
                    bank.hardware.describe(), hardware.describe())


def load_bank(path: str | Path, max_depth: int | None = None, model: str | None = None,
              hardware: Hardware | None = None) -> Bank:
    """Read and check a bank. Errors name the fix; a model or hardware mismatch only warns."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"bank {path}: no such file; build one with jobs/build_bank.py or pass --bank")
    import json

    raw = json.loads(path.read_text())
    version = raw.get("version") if isinstance(raw, dict) else None
    if version != BANK_VERSION:
        raise ValueError(f"bank {path}: format version {version!r} is not {BANK_VERSION}; rebuild it with "
                         "jobs/build_bank.py (or use the entmtp-ray release that wrote it)")
    bank = Bank.model_validate(raw)
    for tree in bank.trees:
        make_topology(tree.paths, tree.name, max_depth=max_depth)  # depth beyond the heads names the fix
        if len(tree.paths) + 1 != tree.nodes:
            raise ValueError(f"bank {path}: tree '{tree.name}' says {tree.nodes} nodes but has "
                             f"{len(tree.paths) + 1}; rebuild the bank")
    if model is not None and bank.model != model:
        log.warning("bank %s was built for model %s, not %s: its trees may be far from optimal; rebuild it "
                    "with jobs/build_bank.py --model %s", path, bank.model, model, model)
    if hardware is not None:
        warn_if_other_hardware(bank, hardware, path)
    return bank


# ---- the EntMTP policies a bank defines ------------------------------------------------------------

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


BANK_POLICIES = {"entmtp-star": _star, "entmtp-ladder": _ladder, "entmtp-tau": _hysteresis}


def build_policy(cfg: DecodingConfig, bank: Bank | None = None) -> Policy:
    """The one registry: the policy cfg.policy names, built without a bank (decode.policy.POLICIES: AR, Hydra's and
    Medusa's trees, --tree) or with its trees and thresholds from `bank` (BANK_POLICIES); with cfg.adapt an EntMTP
    policy falls back to smaller trees of the bank where a request's acceptance says they emit faster (`adaptive`).
    (`auto` is the resolver's choice of one of these: pipeline/assemble.resolve_policy.)"""
    if cfg.tree and cfg.policy != "fixed":
        raise ValueError(f"--tree applies to --policy fixed only (got --policy {cfg.policy})")
    if cfg.policy in BANK_POLICIES:
        if bank is None:
            raise ValueError(f"--policy {cfg.policy} needs a topology bank (--task or --bank)")
        policy = BANK_POLICIES[cfg.policy](cfg, bank)
        return adaptive(policy, bank) if cfg.adapt else policy
    if cfg.policy not in POLICIES:
        raise ValueError(f"unknown policy '{cfg.policy}'; choose one of {sorted(['auto', *POLICIES, *BANK_POLICIES])}")
    return POLICIES[cfg.policy](cfg)


def step_costs(bank: Bank) -> dict[str, float]:
    """Seconds a step of each bank tree takes on the bank's hardware (its tau over its tokens/s), where known."""
    return {t.name: t.tau / t.tokens_per_s for t in bank.trees if t.tau and t.tokens_per_s}


def adaptive(policy: Policy, bank: Bank) -> Policy:
    """`policy` adapting to each request's content (policy.Adaptive) among the bank's trees inside its own (the
    one-node tree and up to policy.FALLBACKS of the largest with at most half a tree's nodes), at the bank's step
    costs until a decoder measures its own (decode/costs.py), which may also settle it on another of the bank's
    trees. The policy itself where the bank has no one-node tree or no costs for its trees."""
    costs = step_costs(bank)
    known = [bank.topology(t.name) for t in bank.trees if t.name in costs and t.tau]
    if not any(t.num_nodes == 1 for t in known):
        return policy
    candidates = [t for tree in policy.trees() for t in fallbacks(tree, known)]
    if not candidates:
        return policy
    return Adaptive(policy, candidates, costs, {t.name: t.tau for t in bank.trees if t.tau},
                    homes=[bank.topology(t.name) for t in bank.trees if t.tau])
