"""The decoding loop: prefill, then steps of choose, draft, verify, accept, commit, observe. Returns a
traced result (docs/design.md §2).

One request at a time (batch size 1). AR is the same loop with the one-node tree. Knows nothing
about Ray or Parquet; the policy decides the tree, acceptance decides the path. Each step is six
named methods over one `Request` (the state of a generation in flight) and returns its StepTrace,
whose `seconds` holds each phase's wall time when the caller asks for a profile.
"""

from __future__ import annotations

import copy
import functools
import logging
import time
import zlib
from dataclasses import dataclass, field
from typing import Protocol

import torch

from entmtp_ray.decode.acceptance import exact_accept, greedy_path, sample_token, typical_path, warp
from entmtp_ray.config import DecodingConfig
from entmtp_ray.model.heads import HeadsPlan, HydraHeads
from entmtp_ray.model.kv_cache import KVCache
from entmtp_ray.model.llama import forward_hidden
from entmtp_ray.model.kernels import ModelPlan, Projection, prepare
from entmtp_ray.model.loading import LoadedModel
from entmtp_ray.decode.policy import VERIFIER_STATS, Policy, Signal, make_signal
from entmtp_ray.decode.static import (STATIC_CAPACITY, StaticKVCache, TreeVerifier, fitted_capacity,
                                      positions_needed)
from entmtp_ray.decode.stop import StopStrings
from entmtp_ray.decode.tree import Topology, TreeBuffers, build_buffers, chain_topology, load_topology

log = logging.getLogger(__name__)


def in_inference_mode(method):
    """Run `method` under torch.inference_mode (the graphs' inputs are inference tensors, so a caller stepping the
    decoder itself must not update them outside it), entering it only when the caller is not already inside: the
    steps call each other every step, and a nested inference_mode costs ~2 us a call."""
    @functools.wraps(method)
    def run(*args, **kwargs):
        if torch.is_inference_mode_enabled():
            return method(*args, **kwargs)
        with torch.inference_mode():
            return method(*args, **kwargs)
    return run


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


class Drafter(Protocol):
    """Proposes the tree's tokens. Hydra heads in production; tests plug in oracles."""

    max_depth: int

    def begin(self, base_hidden: torch.Tensor, positions: torch.Tensor, capacity: int) -> None: ...

    def draft(self, buffers: TreeBuffers, root: int) -> torch.Tensor: ...

    def advance(self, base_hidden: torch.Tensor, positions: torch.Tensor) -> None: ...


class NoDrafter:
    """For AR-only policies: the root alone."""

    max_depth = 0

    def __init__(self, device):
        self.device = device

    def begin(self, base_hidden, positions, capacity):
        pass

    def draft(self, buffers, root):
        assert buffers.num_nodes == 1
        return torch.full((1,), root, dtype=torch.long, device=self.device)  # a fill, not a host-to-device copy

    def advance(self, base_hidden, positions):
        pass

    def lane(self) -> NoDrafter:
        return self


class HydraDrafter:
    """Grounded Hydra drafting: each depth runs its head once over all expanding parents.

    With `draft_vocab` ([K] token ids) each depth projects onto those K tokens only (rows of each
    head's vocabulary projection, taken once here), so a depth's cost stops growing with the vocabulary.
    """

    def __init__(self, heads: HydraHeads, model, draft_vocab: list[int] | None = None):
        self.heads = heads
        self.embed = model.model.embed_tokens
        self.lm_head = model.lm_head
        self.vocab_ids = None  # [K] token id of each column of the draft logits; None = all
        self.projections = None  # per head: a Projection onto the K rows, when drafting on a shortlist
        if draft_vocab:
            device = model.lm_head.weight.device
            self.vocab_ids = torch.tensor(draft_vocab, dtype=torch.long, device=device)  # [K]
            sources = heads.lm_heads if heads.lm_heads is not None else [model.lm_head] * heads.config.num_heads
            self.projections = [Projection.of(*_row_subset(source, self.vocab_ids)).for_drafting()
                                for source in sources]
        self.rotary = model.model.rotary_emb
        self.max_depth = heads.config.num_heads
        self.cache: KVCache | None = None
        self.context: torch.Tensor | None = None  # [H] context vector at the last committed position
        self.plan: HeadsPlan | None = None  # the heads' inference plan, prepared once per generation

    def begin(self, base_hidden, positions, capacity):
        self.plan = self.heads.prepare()
        if self.cache is None or self.cache.capacity < capacity:
            self.cache = self.heads.new_cache(capacity, base_hidden.dtype, base_hidden.device)
        if self.cache is not None:
            self.cache.reset()
        self.advance(base_hidden, positions)

    def lane(self) -> HydraDrafter:
        """A drafter over the same heads and projections with a cache and context of its own (SpecDecoder.lane)."""
        twin = copy.copy(self)
        twin.cache, twin.context, twin.plan = None, None, None
        return twin

    def advance(self, base_hidden, positions):
        self.context = self.heads.context(base_hidden, positions, self.cache, self.rotary, self.plan)[-1]

    def draft(self, buffers: TreeBuffers, root: int) -> torch.Tensor:
        return draft_together([self], [buffers], [root])[0]

    def top_tokens(self, head: int, hidden: torch.Tensor, k: int) -> torch.Tensor:
        """Head `head`'s k best tokens ([rows, k], best first) from its trunk output hidden [rows, H]."""
        if self.projections is None:
            return self.heads.project(head, hidden, self.lm_head).topk(k, dim=-1).indices  # over [rows, V]
        return self.vocab_ids[self.projections[head](hidden).topk(k, dim=-1).indices]  # over [rows, K]


def draft_together(drafters: list, buffers: list[TreeBuffers], roots: list[int]) -> list[torch.Tensor]:
    """Each request's tree drafted ([n_i] tokens each, root first) by its HydraDrafter, with one trunk pass and one
    projection per depth over the expanding parents of every request (lanes of one batch: the same heads, each
    with its own context vector); one drafter is HydraDrafter.draft. Drafters of another kind draft one by one."""
    first = drafters[0]
    if not all(isinstance(d, HydraDrafter) and d.heads is first.heads for d in drafters):
        return [d.draft(b, r) for d, b, r in zip(drafters, buffers, roots)]
    device = first.context.device
    tokens = [torch.empty(b.num_nodes, dtype=torch.long, device=device) for b in buffers]  # [n_i] each
    for t, root in zip(tokens, roots):
        t[0] = root
    for depth in range(max(len(b.levels) for b in buffers)):
        active = [(i, b.levels[depth]) for i, b in enumerate(buffers) if depth < len(b.levels)]
        rows = []
        for i, level in active:
            paths = tokens[i][level.parent_paths]  # [parents, d] tokens root..parent
            parents = paths.shape[0]
            rows.append(torch.cat([drafters[i].context.expand(parents, -1), first.embed(paths).reshape(parents, -1)],
                                  dim=-1))
        head = active[0][1].head_index  # depth d is drafted by head d - 1 in every tree
        hidden = first.plan.trunks[head](rows[0] if len(rows) == 1 else torch.cat(rows))  # [all parents, H]
        top = first.top_tokens(head, hidden, max(level.top_k for _, level in active))  # [all parents, k], best first
        start = 0
        for (i, level), part in zip(active, rows):
            mine = top[start:start + part.shape[0], :level.top_k].reshape(-1)  # [parents * top_k]
            start += part.shape[0]
            tokens[i][level.node_start: level.node_start + level.child_select.numel()] = mine[level.child_select]
    return tokens


def _row_subset(layer: torch.nn.Linear, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Weight and bias of `layer`'s output features `rows`, copied (frozen: later changes to `layer` are not seen)."""
    with torch.no_grad():
        return layer.weight[rows].clone(), layer.bias[rows].clone() if layer.bias is not None else None


def row_generator(seed: int, row_id: str, device) -> torch.Generator:
    """A generator seeded from the run seed and the row id, so reruns and retries reproduce."""
    gen = torch.Generator(device=device)
    gen.manual_seed((seed * 1_000_003 + zlib.crc32(str(row_id).encode())) % (2**63))
    return gen


def verifier_stat(stat: str, logits: torch.Tensor) -> torch.Tensor:
    """The verifier statistic a signal reads at each row of logits [a, V] at T=1, [a] on the device:
    `entropy` (nats; log_softmax and one dot product per row) or `top1` (exp(max - logsumexp))."""
    logits = logits.float()
    if stat == "top1":
        return (logits.amax(-1) - torch.logsumexp(logits, dim=-1)).exp()
    log_probs = torch.log_softmax(logits, dim=-1).clamp_min_(-1e4)  # [a, V]; masked tokens: p = 0, finite
    return -torch.linalg.vecdot(log_probs.exp(), log_probs)


def _verifier_stats(logits: torch.Tensor) -> tuple[list[float], list[float]]:
    """Entropy (nats) and top-1 probability of each row of logits [a, V] at T=1, on the host."""
    return verifier_stat("entropy", logits).tolist(), verifier_stat("top1", logits).tolist()


PHASES = ("choose", "draft", "verify", "accept", "commit", "observe")  # one step, in order
SCHEDULING = ("choose", "observe")  # the phases GenerationResult.schedule_s adds up


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
    profile: bool  # synchronise the device at each phase boundary and keep the phase times
    prompt_ids: list[int] = field(default_factory=list)
    stop_ids: frozenset[int] = frozenset()  # EOS and the stop token ids
    stops: StopStrings | None = None  # the stop strings (None: none)
    stopped_on_string: bool = False  # a stop string ended it: the text is cut before it
    steps: list[StepTrace] = field(default_factory=list)
    schedule_s: float = 0.0

    @property
    def logits_stat(self) -> str | None:
        """The verifier statistic each step computes for the traced signal (None: none, or one that needs none)."""
        stat = self.tracer.stat if self.tracer is not None else None
        return stat if stat in VERIFIER_STATS else None


@dataclass
class Verified:
    """What one verification forward produced for the tree of a step."""

    buffers: TreeBuffers
    tokens: torch.Tensor  # [n] the tree's tokens, root first
    committed: int  # cache length before the step (position of the root)
    hidden: torch.Tensor  # [n, H] base model's last hidden state per node
    logits: torch.Tensor  # [rows, V] verifier logits at buffers.logit_nodes (the scored nodes' first)


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
    """A step between its drafting and its verify forward (SpecDecoder.draft_step)."""

    buffers: TreeBuffers  # the chosen tree
    tokens: torch.Tensor | None  # [n] its drafted tokens, root first (None until drafted)
    signal: float | None  # the traced signal when the tree was chosen
    clock: _PhaseClock  # the step's phase times so far


class SpecDecoder:
    """Holds a model, its drafter and every tree a policy may pick (buffers built once)."""

    def __init__(self, loaded: LoadedModel, drafter: Drafter | None, policy: Policy, leaf_logits: bool | None = None,
                 static: bool | None = None, graphs: bool | None = None, capacity: int | None = None):
        """Each option defaults to on for CUDA and off elsewhere (docs/design.md §8):

        `leaf_logits`: the verify forward projects every node, not just the scored ones, so a greedy step reads
        back once (build_buffers); on CUDA a read-back waits for the queued kernels and the extra rows of the
        vocabulary projection cost next to nothing; on CPU they cost more than a read-back saves.
        `static`: verify on static shapes, over a cache allocated once (decode/static.py) of `capacity` positions
        (the job's need, `static.static_capacity`; None: the model's context, up to STATIC_CAPACITY), grown when a
        request needs more; `graphs`: capture each tree's static verify as a CUDA graph here, once, and replay it
        every step.
        """
        self.loaded = loaded
        cuda = loaded.device.type == "cuda"
        leaf_logits = cuda if leaf_logits is None else leaf_logits
        static = cuda if static is None else static
        graphs = (cuda if graphs is None else graphs) and static
        self.drafter = drafter or NoDrafter(loaded.device)
        self.policy = policy
        self.leaf_logits = leaf_logits
        self.buffers = self._tree_buffers(policy, {})
        self.ar = build_buffers(chain_topology(0), loaded.device, leaf_logits)
        self.max_nodes = max(b.num_nodes for b in self.buffers.values())
        self.cache: KVCache | None = None
        self.verifier: TreeVerifier | None = None
        self.graphs = graphs
        if static:
            self._static(min(loaded.max_positions, capacity or STATIC_CAPACITY))

    def _tree_buffers(self, policy: Policy, built: dict[Topology, TreeBuffers]) -> dict[Topology, TreeBuffers]:
        """Buffers of every tree `policy` may pick (those in `built` reused), each checked against the heads."""
        buffers = {}
        for topology in policy.trees():
            if topology.depth > 0 and isinstance(self.drafter, NoDrafter):
                raise ValueError(f"policy '{policy.name}' drafts with tree '{topology.name}' but no heads were "
                                 "loaded; pass --heads DIR")
            if topology not in built:
                checked = load_topology(topology, max_depth=self.drafter.max_depth)  # no deeper than the heads
                built[topology] = build_buffers(checked, self.loaded.device, self.leaf_logits)
            buffers[topology] = built[topology]
        return buffers

    def _static(self, capacity: int) -> None:
        """A static cache of `capacity` positions and its verifier over every tree (captured when graphs are on)."""
        cfg = self.loaded.model.config
        self.cache = None  # the old cache's memory is free before the new one is allocated
        self.verifier = None
        self.cache = StaticKVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, capacity,
                                   self.loaded.dtype, self.loaded.device)
        self.verifier = TreeVerifier(self.loaded.model, prepare(self.loaded.model), self.cache,
                                     [*self.buffers.values(), self.ar], capture=self.graphs)

    def _grow_static(self, need: int) -> None:
        """A request needs `need` positions, more than the static cache holds (a row asking more new tokens than
        the job sized it for): a larger cache, rounded up, and the graphs captured again; once per size."""
        capacity = fitted_capacity(need, self.loaded.max_positions)
        log.warning("a request needs %d positions, the static KV cache holds %d: growing it to %d%s", need,
                    self.cache.capacity, capacity, " and capturing the graphs again" if self.graphs else "")
        self._static(capacity)

    def _cache_for(self, capacity: int) -> KVCache:
        if self.verifier is None and (self.cache is None or self.cache.capacity < capacity):
            cfg = self.loaded.model.config  # transformers fills head_dim (hidden / heads) when a config omits it
            self.cache = KVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, capacity,
                                 self.loaded.dtype, self.loaded.device)
        self.cache.reset()
        return self.cache

    def _tracer(self, cfg: DecodingConfig) -> tuple[Signal | None, bool]:
        """The signal whose value each step records, and whether the decoder (not the policy) updates it."""
        if self.policy.signal_stat is not None:
            return self.policy.signal, False
        if not cfg.trace_signal:
            return None, False
        own = getattr(self.policy, "signal", None)  # a bank policy with one tree still knows its signal
        if own is None:
            return make_signal(cfg.signal or "entropy"), True
        own.reset()
        return own, True

    def _sync(self) -> None:
        if self.loaded.device.type == "cuda":
            torch.cuda.synchronize(self.loaded.device)

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], cfg: DecodingConfig, generator: torch.Generator | None = None,
                 profile: bool = False) -> GenerationResult:
        """Decode one request to its end. `profile`: each step's trace keeps its phase times (the device
        is synchronised at every phase boundary, so a profiled run is a little slower)."""
        start = time.perf_counter()
        request = self.prefill(prompt_ids, cfg, generator, profile)
        self._sync()
        prefill_s = time.perf_counter() - start
        while request.finish is None:
            self.step(request)
        self._sync()
        return self.result(request, prefill_s, time.perf_counter() - start - prefill_s)

    def result(self, request: Request, prefill_s: float, decode_s: float) -> GenerationResult:
        """A finished request's result: its output decoded to text (cut at a stop string) and its traces."""
        text = self.loaded.decode(request.output)
        if request.stopped_on_string:
            text = request.stops.cut(text)
        return GenerationResult(
            prompt_token_ids=list(request.prompt_ids), output_token_ids=request.output, output_text=text,
            finish_reason=request.finish, prefill_s=prefill_s, decode_s=decode_s, steps=request.steps,
            schedule_s=request.schedule_s)

    @in_inference_mode
    def prefill(self, prompt_ids: list[int], cfg: DecodingConfig, generator: torch.Generator | None = None,
                profile: bool = False) -> Request:
        """The prompt, causally, into a fresh cache; its last logits give the first token (the first root)."""
        need = positions_needed(len(prompt_ids), cfg.max_new_tokens, self.max_nodes)
        if self.verifier is not None and self.cache.capacity < min(need, self.loaded.max_positions):
            self._grow_static(need)
        context = self.cache.capacity if self.verifier is not None else self.loaded.max_positions
        capacity = min(context, need)
        if len(prompt_ids) >= capacity:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens leaves no room in the model's "
                             f"{context}-token context")
        self.policy.reset()
        dev = self.loaded.device
        plan = prepare(self.loaded.model)  # weights checked once per generation, not per step
        cache = self._cache_for(capacity)
        prompt = torch.tensor(prompt_ids, dtype=torch.long, device=dev)  # [p]
        positions = torch.arange(prompt.numel(), device=dev)  # [p]
        hidden = forward_hidden(self.loaded.model, cache, prompt, positions, plan=plan)  # [p, H]
        cache.keep(positions)
        root = int(_sample(cfg, plan.lm_head(hidden[-1]), generator))
        self.drafter.begin(hidden, positions, capacity)
        tracer, own_tracer = self._tracer(cfg)
        request = Request(cfg, generator, capacity, plan, root, [], None, tracer, own_tracer, profile,
                          prompt_ids=list(prompt_ids), stop_ids=self.loaded.eos_token_ids | frozenset(cfg.stop_token_ids or ()),
                          stops=StopStrings(cfg.stop, self.loaded.decode) if cfg.stop else None)
        self.emit(request, [root])
        return request

    @in_inference_mode
    def step(self, request: Request) -> StepTrace | None:
        """One draft-verify step of a running request: its trace, or None when the context is full."""
        pending = self.draft_step(request)
        if pending is None:
            return None
        verified = self.verify(request, pending.buffers, pending.tokens)
        pending.clock.mark("verify")
        return self.finish_step(request, pending, verified)

    @in_inference_mode
    def draft_step(self, request: Request) -> PendingStep | None:
        """A step's first phases: choose the tree and draft its tokens below the root (`choose_step`, then the
        drafter). None, with the request finished, when the context is full."""
        pending = self.choose_step(request)
        if pending is not None:
            pending.tokens = self.drafter.draft(pending.buffers, request.root)  # [n]
            pending.clock.mark("draft")
        return pending

    def choose_step(self, request: Request) -> PendingStep | None:
        """A step's tree (near the end of the context, one node), its tokens not drafted yet. None, with the
        request finished, when the context is full."""
        clock = _PhaseClock(self._sync if request.profile else None)
        signal = request.tracer.value if request.tracer is not None else None
        buffers = self.choose(request)
        clock.mark("choose")
        if buffers is None:
            request.finish = "context"
            request.schedule_s += clock.seconds["choose"]
            return None
        return PendingStep(buffers, None, signal, clock)

    @in_inference_mode
    def finish_step(self, request: Request, pending: PendingStep, verified: Verified) -> StepTrace:
        """A step's phases after its verify forward: accept a path and the token after it, commit it to both
        caches and emit its tokens, then let the policy (and the signal) see the step."""
        clock = pending.clock
        accepted = self.accept(request, verified)
        clock.mark("accept")
        emitted = self.commit(request, verified, accepted)
        clock.mark("commit")
        trace = self.observe(request, verified, accepted, emitted, pending.signal)
        clock.mark("observe")
        request.schedule_s += sum(clock.seconds[phase] for phase in SCHEDULING)
        if request.profile:
            trace.seconds = clock.seconds
        return trace

    def for_policy(self, policy: Policy) -> SpecDecoder:
        """A decoder for another policy over this one's model, drafter, static cache and verifier (which captures
        the new policy's trees into the same graph memory pool), e.g. one per candidate tree in a bank's timing:
        on a GPU one cache and one pool instead of one per tree. The decoders share state, so they must run one
        at a time (a calibration does), never interleaved."""
        twin = copy.copy(self)
        twin.policy = policy
        if not any(t.depth > 0 for t in policy.trees()):  # as Stack.decoder: a policy that never drafts, no heads' work
            twin.drafter = NoDrafter(self.loaded.device)
        twin.buffers = self._tree_buffers(policy, dict(self.buffers))
        twin.max_nodes = max(b.num_nodes for b in twin.buffers.values())
        if self.verifier is not None:
            self.verifier.add(list(twin.buffers.values()))
        return twin

    def lane(self) -> SpecDecoder:
        """Another decoder over the same model, heads and tree buffers with caches and policy state of its own:
        one slot of a batch (decode/batch.py). It verifies on the dynamic path (no static cache or graphs)."""
        twin = copy.copy(self)
        twin.cache, twin.verifier = None, None
        twin.policy = copy.deepcopy(self.policy)
        twin.drafter = self.drafter.lane() if hasattr(self.drafter, "lane") else copy.deepcopy(self.drafter)
        return twin

    def choose(self, request: Request) -> TreeBuffers | None:
        """The policy's tree for this step, or the one-node tree when the context has no room for it;
        None when not even one more token fits."""
        buffers = self.buffers[self.policy.choose()]
        committed = self.cache.length
        if committed + buffers.num_nodes <= request.capacity:
            return buffers
        return self.ar if committed + 1 <= request.capacity else None

    @in_inference_mode
    def verify(self, request: Request, buffers: TreeBuffers, tokens: torch.Tensor) -> Verified:
        """One forward of the base model over the tree's nodes, and the verifier logits of its logit nodes."""
        committed = self.cache.length
        if self.verifier is not None:  # static shapes: positions come from the verifier's device-side start
            hidden, logits = self.verifier(buffers, tokens, committed)
            return Verified(buffers, tokens, committed, hidden, logits)
        positions = committed + buffers.depth_of  # [n]
        hidden = forward_hidden(self.loaded.model, self.cache, tokens, positions, buffers.tree_mask,
                                request.plan)  # [n, H]
        logits = request.plan.lm_head(hidden[buffers.logit_nodes])  # [rows, V]
        return Verified(buffers, tokens, committed, hidden, logits)

    def accept(self, request: Request, verified: Verified) -> Accepted:
        """The accepted path under the request's acceptance rule and the token after it (the request's next
        root), computed on the device and read back once: greedy and typical acceptance pick a row of the
        retrieve indices there; exact acceptance walks the tree on the host (exact_accept's read-back), and
        the residual's sample is a second one. A last node without logits (a leaf, unless the buffers have
        leaf logits) costs one more."""
        cfg, buffers, tokens = request.cfg, verified.buffers, verified.tokens
        stat = request.logits_stat
        scored = verified.logits[:buffers.num_scored]  # [scored, V]
        if buffers.children[0] and cfg.temperature > 0 and cfg.acceptance == "exact":
            # the walk and the residual sample the warped distribution (--top-p/--top-k) at T, given as T=1 logits
            warped = warp(scored, cfg.temperature, cfg.top_p, cfg.top_k)
            path, rejected = exact_accept(tokens, warped, buffers.row_of_node, buffers.children, 1.0,
                                          request.generator)
            last = path[-1]
            chain = buffers.chains[last]  # the walk's path: the nodes root..last
            logits = warp(self._logits_at(request, verified, last), cfg.temperature, cfg.top_p, cfg.top_k)  # [V]
            if rejected:  # every child of `last` was tried and rejected: sample from the residual
                logits = logits.index_fill(0, tokens[buffers.child_nodes[last]], float("-inf"))
            parts = [sample_token(logits, 1.0, request.generator), tokens[chain]]
            if stat is not None:
                parts.append(self._path_stats(stat, request, verified, chain))
            pulled = _read_back(parts)
            a = len(path)
            return Accepted(chain, path, [int(t) for t in pulled[1:1 + a]], int(pulled[0]), pulled[1 + a:])
        if not buffers.children[0]:  # the one-node tree drafted nothing: the root alone, no rule to run
            best = length = torch.zeros(1, dtype=torch.long, device=tokens.device)
        elif cfg.temperature > 0:
            best, length = typical_path(tokens, scored, buffers.row_of_node, buffers.retrieve_indices,
                                        cfg.temperature, cfg.typical_epsilon, cfg.typical_alpha)
        else:
            best, length = greedy_path(tokens, scored, buffers.row_of_node, buffers.retrieve_indices)
        path = buffers.retrieve_indices.index_select(0, best)[0]  # [depth + 1], -1 padded after the leaf
        nodes = path.clamp(min=0)
        last_row = buffers.row_of_node[nodes].index_select(0, length)  # [1]; -1: the last node has no logits
        # the token after the path when its last node has logits: right but for a leaf without them, and
        # free to compute at T=0; under sampling it would spend the generator's draws, so only when surely right
        guess = buffers.leaf_logits or cfg.temperature <= 0
        parts = [length, nodes, tokens[nodes]]
        if guess:
            parts.append(_sample(cfg, verified.logits.index_select(0, last_row.clamp(min=0))[0], request.generator))
        if stat is not None:
            parts.append(self._path_stats(stat, request, verified, nodes))
        pulled = _read_back(parts)  # the step's one read-back
        a, width = int(pulled[0]) + 1, nodes.numel()
        node_ids = [int(i) for i in pulled[1:1 + a]]
        accepted = [int(t) for t in pulled[1 + width:1 + width + a]]
        last, rest = node_ids[-1], pulled[1 + 2 * width:]
        if guess and buffers.node_rows[last] >= 0:
            return Accepted(path[:a], node_ids, accepted, int(rest[0]), rest[1:1 + a])
        # the last node is a leaf without logits (CPU buffers): its logits, the token after it and its statistic
        logits = self._logits_at(request, verified, last)
        parts = [_sample(cfg, logits, request.generator)]
        if stat is not None:
            parts.append(verifier_stat(stat, logits[None]))
        more = _read_back(parts)
        stats = rest[guess:guess + a - 1] + more[1:] if stat is not None else []
        return Accepted(path[:a], node_ids, accepted, int(more[0]), stats)

    def _logits_at(self, request: Request, verified: Verified, node: int) -> torch.Tensor:
        """The verifier logits ([V]) after `node`: its row, or a projection of its hidden state when it has none."""
        row = verified.buffers.node_rows[node]
        return verified.logits[row] if row >= 0 else request.plan.lm_head(verified.hidden[node])

    def _path_stats(self, stat: str, request: Request, verified: Verified, nodes: torch.Tensor) -> torch.Tensor:
        """The statistic at each of `nodes` ([k] on the device) that has logits (garbage at the others); its
        time counts as scheduling (on CUDA: the time to queue it)."""
        start = time.perf_counter()
        rows = verified.buffers.row_of_node[nodes].clamp(min=0)
        values = verifier_stat(stat, verified.logits.index_select(0, rows))
        request.schedule_s += time.perf_counter() - start
        return values

    def commit(self, request: Request, verified: Verified, accepted: Accepted) -> int:
        """Keep the accepted path in the base model's and the drafter's caches, and emit its tokens and the
        next root (up to EOS or the token limit). Returns how many tokens the step added."""
        nodes, a = accepted.nodes, len(accepted.node_ids)
        self.cache.keep(nodes, contiguous=accepted.node_ids == list(range(a)))
        positions = verified.committed + torch.arange(a, device=nodes.device)
        self.drafter.advance(verified.hidden[nodes], positions)
        request.root = accepted.root
        return self.emit(request, accepted.tokens[1:] + [accepted.root])

    def emit(self, request: Request, tokens: list[int]) -> int:
        """Append a step's tokens to the output up to the first that ends it (EOS or a stop token id, the one that
        completes a stop string, or the token limit), and set the request's finish. Returns how many it kept."""
        before = len(request.output)
        request.finish = _extend(request.output, tokens, request.stop_ids, request.cfg.max_new_tokens)
        if request.stops is not None:
            keep = request.stops.completed(request.output, before)
            if keep is not None:
                del request.output[keep:]
                request.finish, request.stopped_on_string = "stop", True
        return len(request.output) - before

    def observe(self, request: Request, verified: Verified, accepted: Accepted, emitted: int,
                signal: float | None) -> StepTrace:
        """The step's trace, with the verifier statistic the signal reads (only that one), shown to the
        policy and, when the decoder owns it, to the traced signal."""
        stat = request.logits_stat
        entropy = accepted.stats if stat == "entropy" else []
        top1 = accepted.stats if stat == "top1" else []
        trace = StepTrace(verified.buffers.topology.name, verified.buffers.num_nodes, emitted, entropy, top1, signal,
                          drafts_kept=min(emitted, len(accepted.tokens) - 1))
        request.steps.append(trace)
        self.policy.observe(trace)
        if request.own_tracer:
            request.tracer.update(trace)
        return trace


def _sample(cfg: DecodingConfig, logits: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """The next token ([1] on the device) from the verifier's logits ([V]): the argmax at T=0, else a sample of
    the distribution at T warped by --top-p/--top-k."""
    if cfg.temperature <= 0:
        return sample_token(logits, 0.0, None)
    return sample_token(warp(logits, cfg.temperature, cfg.top_p, cfg.top_k), 1.0, generator)


def _read_back(parts: list[torch.Tensor]) -> list[float]:
    """Device tensors, concatenated and read back to the host in one synchronisation (as float64: token
    ids and node indices below 2**53 come back exact)."""
    return torch.cat([p.reshape(-1).double() for p in parts]).tolist()


class _PhaseClock:
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


def _extend(output: list[int], new_tokens: list[int], stop_ids: frozenset[int], max_new: int) -> str | None:
    """Append tokens until EOS (or a stop token id) or the token limit; return the finish reason, or None to go on."""
    for token in new_tokens:
        output.append(token)
        if token in stop_ids:
            return "stop"
        if len(output) >= max_new:
            return "length"
    return None

