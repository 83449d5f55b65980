"""The decoding loop: prefill, choose a tree, draft, verify, accept, commit. Returns a traced result.

One request at a time (batch size 1). AR is the same loop with the one-node tree. Knows
nothing about Ray or Parquet; the policy decides the tree, acceptance decides the path.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass, field
from typing import Protocol

import torch

from entmtp_ray.decode.acceptance import exact_accept, greedy_accept, next_token, typical_accept
from entmtp_ray.config import DecodingConfig
from entmtp_ray.model.heads import HeadsPlan, HydraHeads
from entmtp_ray.model.kv_cache import KVCache
from entmtp_ray.model.llama import ONE_TOKEN_ROWS, Projection, forward_hidden, prepare
from entmtp_ray.model.loading import LoadedModel
from entmtp_ray.decode.policy import Policy, Signal, make_signal
from entmtp_ray.decode.tree import TreeBuffers, build_buffers, chain_topology, load_topology


@dataclass
class StepTrace:
    tree: str
    nodes: int
    accepted_length: int  # tokens this step added to the output (accepted drafts + the bonus token)
    # the verifier at each accepted position (T=1), each [] unless the policy's signal_stat names it:
    entropy: list[float]  # next-token entropy (nats)
    top1_prob: list[float]  # top-1 probability
    signal: float | None = None  # the scheduling signal when this step's tree was chosen (None: not traced)


@dataclass
class GenerationResult:
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # includes the EOS token when generation stopped on one
    output_text: str
    finish_reason: str  # stop (EOS) | length (max new tokens) | context (context window full)
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
        return torch.tensor([root], device=self.device)

    def advance(self, base_hidden, positions):
        pass


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

    def advance(self, base_hidden, positions):
        self.context = self.heads.context(base_hidden, positions, self.cache, self.rotary, self.plan)[-1]

    def draft(self, buffers: TreeBuffers, root: int) -> torch.Tensor:
        tokens = torch.empty(buffers.num_nodes, dtype=torch.long, device=self.context.device)  # [n]
        tokens[0] = root
        for level in buffers.levels:
            paths = tokens[level.parent_paths]  # [parents, d] tokens root..parent
            parents, d = paths.shape
            rows = torch.cat([self.context.expand(parents, -1), self.embed(paths).reshape(parents, -1)], dim=-1)
            hidden = self.plan.trunks[level.head_index](rows)  # [parents, H]
            top = self.top_tokens(level.head_index, hidden, level.top_k).reshape(-1)  # [parents * top_k]
            tokens[level.node_start: level.node_start + level.child_select.numel()] = top[level.child_select]
        return tokens

    def top_tokens(self, head: int, hidden: torch.Tensor, k: int) -> torch.Tensor:
        """Head `head`'s k best tokens ([rows, k], best first) from its trunk output hidden [rows, H]."""
        if self.projections is None:
            return self.heads.project(head, hidden, self.lm_head).topk(k, dim=-1).indices  # over [rows, V]
        return self.vocab_ids[self.projections[head](hidden).topk(k, dim=-1).indices]  # over [rows, K]


def _row_subset(layer: torch.nn.Linear, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Weight and bias of `layer`'s output features `rows`, copied (frozen: later changes to `layer` are not seen)."""
    with torch.no_grad():
        return layer.weight[rows].clone(), layer.bias[rows].clone() if layer.bias is not None else None


def row_generator(seed: int, row_id: str, device) -> torch.Generator:
    """A generator seeded from the run seed and the row id, so reruns and retries reproduce."""
    gen = torch.Generator(device=device)
    gen.manual_seed((seed * 1_000_003 + zlib.crc32(str(row_id).encode())) % (2**63))
    return gen


def _verifier_stats(logits: torch.Tensor) -> tuple[list[float], list[float]]:
    """Entropy (nats) and top-1 probability of each row of logits [a, V] at T=1, in fused kernels
    (log_softmax, one dot product per row)."""
    log_probs = torch.log_softmax(logits.float(), dim=-1).clamp_min_(-1e4)  # [a, V]; masked tokens: p = 0, finite
    probs = log_probs.exp()
    entropy = -torch.linalg.vecdot(probs, log_probs)  # [a]
    return entropy.tolist(), probs.amax(-1).tolist()


def _top1_probs(logits: torch.Tensor) -> list[float]:
    """Top-1 probability of each row of logits [a, V] at T=1: exp(max - logsumexp), no softmax written."""
    logits = logits.float()
    return (logits.amax(-1) - torch.logsumexp(logits, dim=-1)).exp().tolist()


class SpecDecoder:
    """Holds a model, its drafter and every tree a policy may pick (buffers built once)."""

    def __init__(self, loaded: LoadedModel, drafter: Drafter | None, policy: Policy):
        self.loaded = loaded
        self.drafter = drafter or NoDrafter(loaded.device)
        self.policy = policy
        self.buffers: dict[str, TreeBuffers] = {}
        for spec in policy.trees():
            topology = load_topology(spec)
            if topology.depth > 0 and isinstance(self.drafter, NoDrafter):
                raise ValueError(f"policy '{policy.name}' drafts with tree '{topology.name}' but no heads were "
                                 "loaded; pass --heads DIR")
            topology = load_topology(topology, max_depth=self.drafter.max_depth)  # no deeper than the heads
            self.buffers[spec] = build_buffers(topology, loaded.device)
        self.ar = build_buffers(chain_topology(0), loaded.device)
        self.max_nodes = max(b.num_nodes for b in self.buffers.values())
        self.cache: KVCache | None = None

    def _cache_for(self, capacity: int) -> KVCache:
        if self.cache is None or self.cache.capacity < capacity:
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

    def _accept(self, tokens, scored_logits, buffers, cfg: DecodingConfig,
                generator) -> tuple[torch.Tensor, list[int]]:
        """The accepted nodes ([a], root first) and the tokens the next token must not be (exact
        acceptance's rejected children of the last node; [] otherwise)."""
        if not buffers.children[0]:  # the one-node tree drafted nothing: the root alone, no rule to run
            return buffers.retrieve_indices[0], []
        if cfg.temperature > 0 and cfg.acceptance == "exact":
            path, rejected = exact_accept(tokens.tolist(), scored_logits, buffers.row_of_node, buffers.children,
                                          cfg.temperature, generator)
            return torch.tensor(path, device=tokens.device), rejected
        if cfg.temperature > 0 and cfg.acceptance == "typical":
            return typical_accept(tokens, scored_logits, buffers.row_of_node, buffers.retrieve_indices,
                                  cfg.temperature, cfg.typical_epsilon, cfg.typical_alpha), []
        return greedy_accept(tokens, scored_logits, buffers.row_of_node, buffers.retrieve_indices), []

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], cfg: DecodingConfig,
                 generator: torch.Generator | None = None) -> GenerationResult:
        model, dev = self.loaded.model, self.loaded.device
        eos = self.loaded.eos_token_ids
        max_new = cfg.max_new_tokens
        capacity = min(self.loaded.max_positions, len(prompt_ids) + max_new + max(self.max_nodes, ONE_TOKEN_ROWS))
        if len(prompt_ids) >= capacity:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens leaves no room in the model's "
                             f"{self.loaded.max_positions}-token context")
        self.policy.reset()
        start = time.perf_counter()

        # 0) prefill: the prompt, causally; its last logits give the first token (the first root)
        plan = prepare(model)  # weights checked once per generation, not per step
        lm_head = plan.lm_head
        cache = self._cache_for(capacity)
        prompt = torch.tensor(prompt_ids, dtype=torch.long, device=dev)  # [p]
        positions = torch.arange(prompt.numel(), device=dev)  # [p]
        hidden = forward_hidden(model, cache, prompt, positions, plan=plan)  # [p, H]
        cache.keep(positions)
        root = next_token(lm_head(hidden[-1]), cfg.temperature, generator)
        self.drafter.begin(hidden, positions, capacity)
        output: list[int] = []
        finish = _extend(output, [root], eos, max_new)
        self._sync()
        prefill_s = time.perf_counter() - start

        steps: list[StepTrace] = []
        schedule_s = 0.0
        tracer, own_tracer = self._tracer(cfg)
        stat = tracer.stat if tracer is not None else None
        while finish is None:
            # 1) choose the tree; near the end of the context fall back to one node
            tick = time.perf_counter()
            signal = tracer.value if tracer is not None else None
            spec = self.policy.choose()
            schedule_s += time.perf_counter() - tick
            buffers = self.buffers[spec]
            committed = cache.length
            if committed + buffers.num_nodes > capacity:
                if committed + 1 > capacity:
                    finish = "context"
                    break
                buffers = self.ar
            # 2) draft the tree's tokens below the root
            tokens = self.drafter.draft(buffers, root)  # [n]
            # 3) verify the whole tree in one forward under the tree mask
            positions = committed + buffers.depth_of  # [n]
            hidden = forward_hidden(model, cache, tokens, positions, buffers.tree_mask, plan)  # [n, H]
            scored_logits = lm_head(hidden[buffers.scored_nodes])  # [scored, V]
            # 4) accept a path, then pick the token after it
            accepted, rejected = self._accept(tokens, scored_logits, buffers, cfg, generator)  # [a], root first
            last = int(accepted[-1])
            last_row = int(buffers.row_of_node[last])
            last_logits = scored_logits[last_row] if last_row >= 0 else lm_head(hidden[last])  # [V]
            root_logits = last_logits
            if rejected:  # exact acceptance: the next token comes from the residual
                root_logits = last_logits.index_fill(0, torch.tensor(rejected, device=dev), float("-inf"))
            root = next_token(root_logits, cfg.temperature, generator)
            # 5) commit the accepted path to both caches
            cache.keep(accepted)
            self.drafter.advance(hidden[accepted], committed + torch.arange(accepted.numel(), device=dev))
            # 6) emit and trace
            new_tokens = tokens[accepted[1:]].tolist() + [root]
            before = len(output)
            finish = _extend(output, new_tokens, eos, max_new)
            tick = time.perf_counter()
            entropy = top1 = []
            if stat is not None:
                rows = buffers.row_of_node[accepted[:-1]]
                logits = torch.cat([scored_logits[rows], last_logits[None]])  # [a, V]
                if stat == "top1":
                    top1 = _top1_probs(logits)
                else:
                    entropy = _verifier_stats(logits)[0]
            steps.append(StepTrace(buffers.topology.name, buffers.num_nodes, len(output) - before, entropy, top1,
                                   signal))
            self.policy.observe(steps[-1])
            if own_tracer:
                tracer.update(steps[-1])
            schedule_s += time.perf_counter() - tick

        self._sync()
        decode_s = time.perf_counter() - start - prefill_s
        return GenerationResult(
            prompt_token_ids=list(prompt_ids), output_token_ids=output, output_text=self.loaded.decode(output),
            finish_reason=finish, prefill_s=prefill_s, decode_s=decode_s, steps=steps, schedule_s=schedule_s)


def _extend(output: list[int], new_tokens: list[int], eos: frozenset[int], max_new: int) -> str | None:
    """Append tokens until EOS or the token limit; return the finish reason, or None to go on."""
    for token in new_tokens:
        output.append(token)
        if token in eos:
            return "stop"
        if len(output) >= max_new:
            return "length"
    return None

