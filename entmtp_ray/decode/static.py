"""The verify forward on static shapes, so that CUDA can replay it as a graph (gpt-fast's approach).

The dynamic forward (llama.forward_hidden) attends over the committed prefix, whose length changes every
step: its shapes, and so its kernels' launch parameters, change too. Here the cache is allocated once at
a fixed capacity, the pending block is written at device positions (`start + 0..n-1`, `start` a one-element
device tensor the step fills), and every node attends over the whole capacity under a mask that opens the
committed prefix and the node's ancestors. For a given tree every shape is then fixed, and on CUDA the
forward and the vocabulary projection of the tree's logit nodes are captured once per tree at load, like
the tree buffers, and replayed each step: one graph launch in place of some 20 kernel launches per layer.

The same code runs eagerly on the CPU (capture off), which is how the tests check it; the CPU decoder
itself keeps the dynamic forward, whose attention reads only the committed prefix (docs/design.md §8).
`StaticVerifier` is this path's implementation of the verify seam (decode/verify.py), one request a call.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from entmtp_ray.decode.tree import TreeBuffers
from entmtp_ray.decode.verify import Tree, Verified
from entmtp_ray.model.kernels import ONE_TOKEN_ROWS, ModelPlan
from entmtp_ray.model.kv_cache import KVCache
from entmtp_ray.model.llama import decoder_layer, rotary_tables

log = logging.getLogger(__name__)

# Positions a static cache holds when no job sized it (library callers): the model's context, up to this (Vicuna's
# is 2048, SmolLM2's 8192; a longer one would spend memory and attention reads on columns a batch job rarely fills).
STATIC_CAPACITY = 8192
CAPACITY_GRAIN = 256  # a static cache's positions are a multiple of this: few distinct sizes, a little slack


def positions_needed(prompt_tokens: int, new_tokens: int, max_nodes: int) -> int:
    """Cache positions one request needs: its prompt, its new tokens and the last step's pending block (the largest
    tree's nodes, or a one-token step's ONE_TOKEN_ROWS copies when more). SpecDecoder.prefill sizes by it too."""
    return prompt_tokens + new_tokens + max(max_nodes, ONE_TOKEN_ROWS)


def fitted_capacity(positions: int, context: int) -> int:
    """A static cache's size for `positions`: rounded up to CAPACITY_GRAIN, never past the model's context."""
    return min(context, -(-positions // CAPACITY_GRAIN) * CAPACITY_GRAIN)


def static_capacity(max_prompt_tokens: int, max_new_tokens: int, max_nodes: int, context: int) -> int:
    """Positions a static cache holds for a job: what its longest prompt allowed needs with its new tokens and
    largest tree (positions_needed), fitted. Every graphed step attends over the whole capacity, so a cache sized
    from the job, not the context, is cheaper (Vicuna: 1,400 + 256 + 64 -> 1,792 of 2,048 positions; the embedded
    model's 8,192 -> 1,792). A request that needs more grows the decoder's cache (SpecDecoder.prefill)."""
    return fitted_capacity(positions_needed(max_prompt_tokens, max_new_tokens, max_nodes), context)


class StaticKVCache(KVCache):
    """A KVCache whose pending block can be written at device positions (`slots`) and read whole.

    With `slots` None it is a plain KVCache (the prefill writes it that way); with `slots` set ([n] device
    positions, start + 0..n-1), `write` scatters the block there and returns the whole capacity.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.slots: torch.Tensor | None = None
        self.columns = torch.arange(self.capacity, device=self.k.device)  # [capacity]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.slots is None:
            return super().write(layer, k, v)
        self.k[layer].index_copy_(1, self.slots, k)
        self.v[layer].index_copy_(1, self.slots, v)
        return self.k[layer], self.v[layer]  # [kv_heads, capacity, head_dim]


def static_mask(tree_mask: torch.Tensor, start: torch.Tensor, columns: torch.Tensor, groups: int) -> torch.Tensor:
    """[groups * n, capacity] boolean: node i sees every committed column (< start) and, in the pending block
    [start, start + n), the columns of its ancestors and itself (tree_mask [n, n]); nothing after."""
    n = tree_mask.shape[0]
    offset = columns - start  # [capacity]; a column's place in the pending block
    in_block = (offset >= 0) & (offset < n)
    block = tree_mask[:, offset.clamp(0, n - 1)] & in_block  # [n, capacity]
    mask = block | (offset < 0)
    return mask.repeat(groups, 1) if groups > 1 else mask


def forward_static(model, plan: ModelPlan, cache: StaticKVCache, tokens: torch.Tensor, buffers: TreeBuffers,
                   start: torch.Tensor) -> torch.Tensor:
    """Final hidden states [n, H] of a tree's tokens ([n]) whose root sits at position `start` ([1] on the
    device); their k/v land in the pending block at start + 0..n-1, as the dynamic forward's do."""
    base = model.model
    n = tokens.numel()
    x = base.embed_tokens(tokens)[None]  # [1, n, H]
    tables = rotary_tables(base.rotary_emb, x, start + buffers.depth_of)
    mask = static_mask(buffers.tree_mask, start, cache.columns, plan.layers[0].groups)
    cache.slots = start + cache.columns[:n]
    try:
        for i, (layer, layer_plan) in enumerate(zip(base.layers, plan.layers)):
            x = decoder_layer(layer, x, tables, cache, i, mask, layer_plan)
    finally:
        cache.slots = None
    return plan.norm(x)[0]


@dataclass
class _Graph:
    buffers: TreeBuffers  # held, so that the id the graph is found by is never another tree's
    graph: "torch.cuda.CUDAGraph"
    tokens: torch.Tensor  # [n] the captured input, filled before each replay
    hidden: torch.Tensor  # [n, H] the captured outputs, overwritten by each replay
    logits: torch.Tensor  # [rows, V]


class StaticVerifier:
    """The verify forward of each tree on static shapes (hidden states and the logits of its logit nodes),
    replayed from a CUDA graph per tree when `capture`, else run eagerly (the CPU tests)."""

    WARMUP = 3  # eager runs on a side stream before a capture, as torch.cuda.graphs asks (lazy inits, autotuning)

    def __init__(self, model, plan: ModelPlan, cache: StaticKVCache, trees: list[TreeBuffers], capture: bool):
        self.model, self.plan, self.cache = model, plan, cache
        self.start = torch.zeros(1, dtype=torch.long, device=cache.k.device)
        self.graphs: dict[int, _Graph] = {}
        self.pool = None  # the graphs' memory pool; None: verifying eagerly (no capture, or a capture failed)
        self.capture_error: str | None = None  # why a capture failed (the verifier then runs eagerly)
        if capture:
            if cache.k.device.type != "cuda":
                raise ValueError("CUDA graphs need a CUDA device; run the static verifier with capture off")
            self.pool = torch.cuda.graph_pool_handle()  # one memory pool: the graphs never run concurrently
        self.add(trees)

    def add(self, trees: list[TreeBuffers]) -> None:
        """Capture the verify of trees not captured yet (another policy's, sharing this verifier and its cache:
        SpecDecoder.for_policy), into the same memory pool. Eager verifiers have nothing to capture."""
        if self.pool is None:
            return
        try:
            with torch.inference_mode():  # as the decoder replays them
                for buffers in trees:
                    if id(buffers) not in self.graphs:
                        self.graphs[id(buffers)] = self._capture(buffers, self.pool)
        except RuntimeError as exc:  # a stack that cannot capture still decodes, eagerly, and says so
            log.exception("capturing the verify forward as CUDA graphs failed; verifying eagerly on static shapes")
            self.capture_error = f"{type(exc).__name__}: {exc}"
            self.graphs.clear()
            self.pool = None
        self.cache.reset()

    def _forward(self, buffers: TreeBuffers, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = forward_static(self.model, self.plan, self.cache, tokens, buffers, self.start)
        return hidden, self.plan.lm_head(hidden[buffers.logit_nodes])

    def _capture(self, buffers: TreeBuffers, pool) -> _Graph:
        tokens = torch.zeros(buffers.num_nodes, dtype=torch.long, device=self.start.device)
        self.start.fill_(0)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.WARMUP):
                self._forward(buffers, tokens)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            hidden, logits = self._forward(buffers, tokens)
        return _Graph(buffers, graph, tokens, hidden, logits)

    def __call__(self, trees: list[Tree]) -> list[Verified]:
        """The one tree's verify over this verifier's cache, its root at the cache's length. A replay's outputs
        are the graph's own tensors: read them before the same tree is verified again."""
        if len(trees) != 1 or trees[0].cache is not self.cache:
            raise ValueError("a static verifier scores one request's tree over its own cache a call")
        buffers, tokens = trees[0].buffers, trees[0].tokens
        committed = self.cache.length
        self.start.fill_(committed)  # a kernel that writes the value: no read-back
        graph = self.graphs.get(id(buffers))
        if graph is None:
            hidden, logits = self._forward(buffers, tokens)
        else:
            graph.tokens.copy_(tokens)
            graph.graph.replay()
            hidden, logits = graph.hidden, graph.logits
        return [Verified(buffers, tokens, committed, hidden, logits)]
