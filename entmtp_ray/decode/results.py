"""What a generation carries and returns: the `Request` in flight, each step's `PendingStep` and `Accepted`
path, its `StepTrace`, and the `GenerationResult` a finished request gives (docs/design.md §2)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from entmtp_ray.config import DecodingConfig
from entmtp_ray.decode.policy import VERIFIER_STATS, Signal
from entmtp_ray.decode.stop import StopStrings
from entmtp_ray.decode.tree import TreeBuffers
from entmtp_ray.model.kernels import ModelPlan

PHASES = ("choose", "draft", "verify", "accept", "commit", "observe")  # one step, in order
SCHEDULING = ("choose", "observe")  # the phases GenerationResult.schedule_s adds up


@dataclass
class StepTrace:
    tree: str
    nodes: int
    accepted_length: int  # tokens this step added to the output: accepted drafts + the bonus token, fewer if it ended
    # the verifier at each accepted position (T=1), each [] unless the policy's signal_stat names it:
    entropy: list[float]  # next-token entropy (nats)
    top1_prob: list[float]  # top-1 probability
    signal: float | None = None  # the scheduling signal when this step's tree was chosen (None: not traced)
    seconds: dict[str, float] = field(default_factory=dict)  # phase -> wall seconds, when profiled (PHASES)
    # of accepted_length, the drafted tokens (the rest is the bonus token); None: all but one. A step cut by EOS,
    # a stop or the token limit before its bonus token kept only drafts
    drafts_kept: int | None = None
    path: tuple[int, ...] = ()  # the rank path of the deepest node verification accepted (policy.StepView)

    @property
    def accepted_drafts(self) -> int:
        """Draft tokens this step kept (vLLM's accepted tokens)."""
        return self.drafts_kept if self.drafts_kept is not None else max(0, self.accepted_length - 1)


@dataclass
class GenerationResult:
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # includes the EOS or stop token id, or the token that completed a stop string
    output_text: str  # the output decoded, special tokens skipped; a stop string and what follows it cut off
    finish_reason: str  # stop (EOS, stop token id, stop string) | length (max new tokens) | context (window full)
    prefill_s: float  # prompt forward + first token
    decode_s: float  # every draft-verify step after it
    schedule_s: float  # inside decode_s: the policy's choose/observe and the signal's verifier stats
    steps: list[StepTrace] = field(default_factory=list)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def tokens_per_s(self) -> float:
        return self.num_output_tokens / self.total_s if self.total_s > 0 else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """tau: tokens per draft-verify step, bonus included (the prefill's first token is no step)."""
        return sum(s.accepted_length for s in self.steps) / len(self.steps) if self.steps else 0.0

    def accepted_per_position(self, depth: int) -> list[float]:
        """Fraction of steps whose draft token at depth i (1-based) was accepted, for i = 1..depth."""
        if not self.steps:
            return [0.0] * depth
        return [sum(s.accepted_length > i for s in self.steps) / len(self.steps) for i in range(1, depth + 1)]

    def tree_usage(self) -> dict[str, int]:
        usage: dict[str, int] = {}
        for s in self.steps:
            usage[s.tree] = usage.get(s.tree, 0) + 1
        return usage

    def step_accepted_lengths(self) -> list[int]:
        return [s.accepted_length for s in self.steps]

    def step_signals(self) -> list[float] | None:
        """The signal before each step, when it was traced (an EntMTP policy that switches, or cfg.trace_signal)."""
        if not self.steps or self.steps[0].signal is None:
            return None
        return [s.signal for s in self.steps]

    def tree_switches(self) -> int:
        return sum(a.tree != b.tree for a, b in zip(self.steps, self.steps[1:]))


@dataclass
class Request:
    """One generation in flight: what the steps read and advance."""

    cfg: DecodingConfig
    generator: torch.Generator | None
    capacity: int  # positions the caches hold for this request
    plan: ModelPlan  # the model's projections and norms (kernels.prepare), checked once per generation
    root: int  # the next token, already chosen: the root of the next tree
    output: list[int]  # emitted tokens (EOS included when it stopped on one)
    finish: str | None  # None while running, else the finish reason
    tracer: Signal | None  # the signal whose value each step records (None: not traced)
    own_tracer: bool  # whether the decoder (not the policy) updates the tracer
    prompt_ids: list[int] = field(default_factory=list)
    stop_ids: frozenset[int] = frozenset()  # EOS and the stop token ids
    stops: StopStrings | None = None  # the stop strings (None: none)
    stopped_on_string: bool = False  # a stop string ended it: the text is cut before it
    steps: list[StepTrace] = field(default_factory=list)
    schedule_s: float = 0.0
    # committed hidden states [n, H] and positions [n] that the drafter has not seen: one-node steps leave them for
    # the next step that drafts (SpecDecoder.commit), so a policy that falls back to AR pays what AR does
    behind: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    @property
    def logits_stat(self) -> str | None:
        """The verifier statistic each step computes for the traced signal (None: none, or one that needs none)."""
        stat = self.tracer.stat if self.tracer is not None else None
        return stat if stat in VERIFIER_STATS else None


@dataclass
class Accepted:
    """A step's accepted path, read back to the host once (twice under exact acceptance, docs/design.md §8)."""

    nodes: torch.Tensor  # [a] the accepted nodes on the device, root first
    node_ids: list[int]  # the same on the host
    tokens: list[int]  # their tokens (the first is the root, emitted by the step before)
    root: int  # the token after them: the next step's root
    stats: list[float]  # the traced signal's verifier statistic at each accepted node ([] when none is traced)


@dataclass
class PendingStep:
    """A step between its choice of tree and its verify forward (SpecDecoder.step, BatchDecoder.step)."""

    buffers: TreeBuffers  # the chosen tree
    tokens: torch.Tensor | None  # [n] its drafted tokens, root first (None until drafted)
    signal: float | None  # the traced signal when the tree was chosen
    clock: PhaseClock  # the step's phase times so far


class PhaseClock:
    """Wall time of each phase of a step, between marks; `sync` (the device's) runs before each reading."""

    def __init__(self, sync=None):
        self.sync = sync
        self.seconds: dict[str, float] = {}
        self.last = time.perf_counter()

    def mark(self, phase: str) -> None:
        if self.sync is not None:
            self.sync()
        now = time.perf_counter()
        self.seconds[phase] = now - self.last
        self.last = now
