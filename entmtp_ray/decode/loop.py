"""The decoding loop: prefill, then steps of choose, draft, verify, accept, commit, observe. Returns a
traced result (docs/design.md §2).

One request at a time (batch size 1). AR is the same loop with the one-node tree. Knows nothing
about Ray or Parquet; the policy decides the tree, acceptance decides the path. Each step is six
named methods over one `Request` (the state of a generation in flight) and returns its StepTrace; a profile of
each phase's wall time comes from a profiling twin of the decoder (`profiled`), not from the decoder itself. The
phases' parts live in their own modules: drafting.py (the drafter), verify.py (the verify seam and its dynamic
path; static.py its static one), acceptance.py (the accepted path under each rule, read back), results.py (the
request, traces and result).
"""

from __future__ import annotations

import copy
import functools
import logging
import math
import time

import torch

from entmtp_ray.config import DecodingConfig
from entmtp_ray.decode.acceptance import accept, sample_next
from entmtp_ray.decode.drafting import Drafter, NoDrafter
from entmtp_ray.decode.policy import Policy, Signal, make_signal
from entmtp_ray.decode.results import (SCHEDULING, Accepted, GenerationResult, PendingStep, PhaseClock, Request,
                                       StepTrace)
from entmtp_ray.decode.static import STATIC_CAPACITY, StaticKVCache, StaticVerifier, fitted_capacity, positions_needed
from entmtp_ray.decode.stop import StopStrings
from entmtp_ray.decode.tree import Topology, TreeBuffers, build_buffers, chain_topology, load_topology
from entmtp_ray.decode.verify import DynamicVerifier, Tree, Verified, Verifier
from entmtp_ray.model.kv_cache import KVCache
from entmtp_ray.model.llama import forward_hidden
from entmtp_ray.model.kernels import prepare
from entmtp_ray.model.loading import LoadedModel
from entmtp_ray.model.products import ROWS_PER_WIDENING

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


class SpecDecoder:
    """Holds a model, its drafter and every tree a policy may pick (buffers built once)."""

    def __init__(self, loaded: LoadedModel, drafter: Drafter | None, policy: Policy,
                 leaf_logits: bool | int | None = None, static: bool | None = None, graphs: bool | None = None,
                 capacity: int | None = None):
        """Each option defaults to on for CUDA and off elsewhere, but for leaf logits (docs/design.md §8):

        `leaf_logits`: the verify forward projects every node, not just the scored ones, so a greedy step reads
        back once (build_buffers). By default (None) on where the extra rows of the vocabulary projection cost next
        to nothing: on CUDA (where a read-back also waits for the queued kernels), and on CPU row products
        (products.py) for trees whose nodes the products widen the weight once for (ROWS_PER_WIDENING): there an
        accepted leaf's logits would otherwise cost a second read of the whole lm_head, about what the verify's
        own costs, while each extra row costs a tenth of it; off for larger trees and torch's CPU products. An int
        n: trees of at most n nodes.
        `static`: verify on static shapes, over a cache allocated once (decode/static.py) of `capacity` positions
        (the job's need, `static.static_capacity`; None: the model's context, up to STATIC_CAPACITY), grown when a
        request needs more; `graphs`: capture each tree's static verify as a CUDA graph here, once, and replay it
        every step.
        """
        self.loaded = loaded
        cuda = loaded.device.type == "cuda"
        if leaf_logits is None:  # CPU: the trees one widening of the row products serves, else none
            leaf_logits = cuda or (ROWS_PER_WIDENING if prepare(loaded.model).lm_head.native is not None else 0)
        static = cuda if static is None else static
        graphs = (cuda if graphs is None else graphs) and static
        self.drafter = drafter or NoDrafter(loaded.device)
        self.policy = policy
        # the largest tree whose verify projects its leaves: True every tree, False none
        self.leaf_nodes = math.inf if leaf_logits is True else int(leaf_logits)
        self.buffers = self._tree_buffers(policy, {})
        self.ar = build_buffers(chain_topology(0), loaded.device, self.leaf_logits_for(chain_topology(0)))
        self.max_nodes = max(b.num_nodes for b in self.buffers.values())
        self.cache: KVCache | None = None  # the static cache, or the dynamic one the last request grew
        self.static = static
        self.verifier: Verifier = DynamicVerifier(loaded.model)
        self.costs: str | None = None  # where an adaptive policy's step costs came from (decode/costs.py), when measured
        self.costs_pending = False  # built at its bank's costs, none measured here yet (Engine.settle_costs)
        self.graphs = graphs
        if static:
            self._static(min(loaded.max_positions, capacity or STATIC_CAPACITY))

    def leaf_logits_for(self, topology: Topology) -> bool:
        """Whether `topology`'s verify projects its leaves too."""
        return topology.num_nodes <= self.leaf_nodes

    def _tree_buffers(self, policy: Policy, built: dict[Topology, TreeBuffers]) -> dict[Topology, TreeBuffers]:
        """Buffers of every tree `policy` may pick (those in `built` reused), each checked against the heads."""
        buffers = {}
        for topology in policy.trees():
            if topology.depth > 0 and isinstance(self.drafter, NoDrafter):
                raise ValueError(f"policy '{policy.name}' drafts with tree '{topology.name}' but no heads were "
                                 "loaded; pass --heads DIR")
            if topology not in built:
                checked = load_topology(topology, max_depth=self.drafter.max_depth)  # no deeper than the heads
                built[topology] = build_buffers(checked, self.loaded.device, self.leaf_logits_for(checked))
            buffers[topology] = built[topology]
        return buffers

    def _static(self, capacity: int) -> None:
        """A static cache of `capacity` positions and its verifier over every tree (captured when graphs are on)."""
        cfg = self.loaded.model.config
        self.cache = None  # the old cache's memory is free before the new one is allocated
        self.verifier = None
        self.cache = StaticKVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, capacity,
                                   self.loaded.dtype, self.loaded.device)
        self.verifier = StaticVerifier(self.loaded.model, prepare(self.loaded.model), self.cache,
                                       [*self.buffers.values(), self.ar], capture=self.graphs)

    def _grow_static(self, need: int) -> None:
        """A request needs `need` positions, more than the static cache holds (a row asking more new tokens than
        the job sized it for): a larger cache, rounded up, and the graphs captured again; once per size."""
        capacity = fitted_capacity(need, self.loaded.max_positions)
        log.warning("a request needs %d positions, the static KV cache holds %d: growing it to %d%s", need,
                    self.cache.capacity, capacity, " and capturing the graphs again" if self.graphs else "")
        self._static(capacity)

    def _cache_for(self, capacity: int) -> KVCache:
        if not self.static and (self.cache is None or self.cache.capacity < capacity):
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
    def generate(self, prompt_ids: list[int], cfg: DecodingConfig, generator: torch.Generator | None = None
                 ) -> GenerationResult:
        """Decode one request to its end."""
        start = time.perf_counter()
        request = self.prefill(prompt_ids, cfg, generator)
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
    def prefill(self, prompt_ids: list[int], cfg: DecodingConfig, generator: torch.Generator | None = None
                ) -> Request:
        """The prompt, causally, into a fresh cache; its last logits give the first token (the first root)."""
        need = positions_needed(len(prompt_ids), cfg.max_new_tokens, self.max_nodes)
        if self.static and self.cache.capacity < min(need, self.loaded.max_positions):
            self._grow_static(need)
        context = self.cache.capacity if self.static else self.loaded.max_positions
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
        root = int(sample_next(cfg, plan.lm_head(hidden[-1]), generator))
        self.drafter.begin(hidden, positions, capacity)
        tracer, own_tracer = self._tracer(cfg)
        request = Request(cfg, generator, capacity, plan, root, [], None, tracer, own_tracer,
                          prompt_ids=list(prompt_ids), stop_ids=self.loaded.eos_token_ids | frozenset(cfg.stop_token_ids or ()),
                          stops=StopStrings(cfg.stop, self.loaded.decode) if cfg.stop else None)
        self.emit(request, [root])
        return request

    @in_inference_mode
    def step(self, request: Request) -> StepTrace | None:
        """One draft-verify step of a running request, its phases in the algorithm's order: its trace, or None when
        the context is full. A batch (decode/batch.py) runs the same phases, drafting and verifying its lanes'
        trees together."""
        pending = self.choose_step(request)  # choose the tree (the drafter catching up on one-node steps)
        if pending is None:
            return None
        pending.tokens = self.drafter.draft(pending.buffers, request.root)  # draft its tokens below the root
        pending.clock.mark("draft")
        verified = self.verify(request, pending.buffers, pending.tokens)  # one forward over the tree
        pending.clock.mark("verify")
        return self.finish_step(request, pending, verified)  # accept, commit, observe

    def choose_step(self, request: Request) -> PendingStep | None:
        """A step's tree (near the end of the context, one node), its tokens not drafted yet. None, with the
        request finished, when the context is full."""
        clock = self._clock()
        signal = request.tracer.value if request.tracer is not None else None
        buffers = self.choose(request)
        clock.mark("choose")
        if buffers is None:
            request.finish = "context"
            request.schedule_s += clock.seconds["choose"]
            return None
        if request.behind and buffers.topology.depth > 0:  # the drafter catches up on the one-node steps' tokens
            hidden, positions = zip(*request.behind)
            self.drafter.advance(torch.cat(hidden), torch.cat(positions))
            request.behind.clear()
        return PendingStep(buffers, None, signal, clock)

    @in_inference_mode
    def finish_step(self, request: Request, pending: PendingStep, verified: Verified) -> StepTrace:
        """A step's phases after its verify forward: accept a path and the token after it, commit it to both
        caches and emit its tokens, then let the policy (and the signal) see the step."""
        clock = pending.clock
        accepted = accept(request, verified)
        clock.mark("accept")
        emitted = self.commit(request, verified, accepted)
        clock.mark("commit")
        trace = self.observe(request, verified, accepted, emitted, pending.signal)
        clock.mark("observe")
        request.schedule_s += sum(clock.seconds[phase] for phase in SCHEDULING)
        return trace

    def _clock(self) -> PhaseClock:
        """A step's phase clock: its choose and observe phases are the request's scheduling time."""
        return PhaseClock()

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
        self.verifier.add(list(twin.buffers.values()))
        return twin

    def lane(self) -> SpecDecoder:
        """Another decoder over the same model, heads and tree buffers with caches and policy state of its own:
        one slot of a batch (decode/batch.py). It verifies on the dynamic path (no static cache or graphs)."""
        twin = copy.copy(self)
        twin.cache, twin.static, twin.verifier = None, False, DynamicVerifier(self.loaded.model)
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
        """The tree's verify forward through the decoder's verifier (verify.py: a batch of one): hidden states of
        its nodes and the verifier logits of its logit nodes, its k/v pending in the cache."""
        return self.verifier([Tree(self.cache, buffers, tokens, request.plan)])[0]

    def commit(self, request: Request, verified: Verified, accepted: Accepted) -> int:
        """Keep the accepted path in the base model's and the drafter's caches, and emit its tokens and the
        next root (up to EOS or the token limit). Returns how many tokens the step added."""
        nodes, a = accepted.nodes, len(accepted.node_ids)
        self.cache.keep(nodes, contiguous=accepted.node_ids == list(range(a)))
        positions = verified.committed + torch.arange(a, device=nodes.device)
        if verified.buffers.num_nodes > 1 or isinstance(self.drafter, NoDrafter):
            self.drafter.advance(verified.hidden[nodes], positions)
        else:  # a one-node step of a policy that drafts: its token reaches the drafter with the next drafting step
            request.behind.append((verified.hidden[nodes], positions))
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
        topology, last = verified.buffers.topology, accepted.node_ids[-1]
        trace = StepTrace(topology.name, verified.buffers.num_nodes, emitted, entropy, top1, signal,
                          drafts_kept=min(emitted, len(accepted.tokens) - 1),
                          path=topology.paths[last - 1] if last else ())
        request.steps.append(trace)
        self.policy.observe(trace)
        if request.own_tracer:
            request.tracer.update(trace)
        return trace



def _extend(output: list[int], new_tokens: list[int], stop_ids: frozenset[int], max_new: int) -> str | None:
    """Append tokens until EOS (or a stop token id) or the token limit; return the finish reason, or None to go on."""
    for token in new_tokens:
        output.append(token)
        if token in stop_ids:
            return "stop"
        if len(output) >= max_new:
            return "length"
    return None



class ProfiledDecoder(SpecDecoder):
    """A decoder whose steps synchronise the device at each phase boundary and keep each phase's wall time in their
    traces (StepTrace.seconds, PHASES): a profile, a little slower. Made by `profiled`, never by a job."""

    def _clock(self) -> PhaseClock:
        return PhaseClock(self._sync)

    def finish_step(self, request: Request, pending: PendingStep, verified: Verified) -> StepTrace:
        trace = super().finish_step(request, pending, verified)
        trace.seconds = pending.clock.seconds
        return trace


def profiled(decoder: SpecDecoder) -> ProfiledDecoder:
    """A profiling twin of `decoder`: the same model, drafter, policy and caches (so the two must not run at once),
    its steps' traces holding their phase times (ProfiledDecoder)."""
    twin = ProfiledDecoder.__new__(ProfiledDecoder)
    twin.__dict__.update(decoder.__dict__)
    return twin
