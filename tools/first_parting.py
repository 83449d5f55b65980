"""Where a tree's verify first rounds unlike the one-token steps it stands for, operation by operation.

    python tools/first_parting.py --dtype bf16 --prompt "Write a function digitSum(s) that ..." --tree hydra
    python tools/first_parting.py --dtype bf16 --prompt-file prose.txt --steps 32 --output runs/parting.json

Greedy one-token steps through the decoder's verifier (the AR steps a job runs) give the reference: every
operation's output of the token's row (`Probe`), the kept k/v and the logits, at each position. From a
copy of the cache at each of --steps positions, the tree's verify then scores a tree whose rank-0 chain holds
the greedy continuation (the path a perfect draft accepts; the other nodes hold other tokens). Each chain node
is compared bitwise with the one-token step at its position: the first operation whose output differs (the
layers in order, OPERATIONS within a layer), and whether the inputs it read were equal, so that a parting
caused by an earlier one is told from a new one. Prints a Markdown table of the partings by operation and where
each first appeared. Where the native step serves the model (step.py: fp32 or quantized weights on CPU), its tree
rows are then compared with its own one-token steps at its granularity (each layer's kept k/v, the logits). Ends
with one JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from entmtp_ray.cli import add_config_args, config_from_args, quiet_logging
from entmtp_ray.config import ModelConfig
from entmtp_ray.decode.tree import Topology, build_buffers, chain_topology, load_topology
from entmtp_ray.decode.verify import DynamicVerifier, Tree
from entmtp_ray.model import step
from entmtp_ray.model.kernels import ONE_TOKEN_ROWS, ModelPlan, prepare
from entmtp_ray.model.kv_cache import KVCache
from entmtp_ray.model.llama import forward_hidden, forward_hidden_batch, reference_forward
from entmtp_ray.model.loading import load_model

Trace = dict[tuple[int, str], torch.Tensor]  # (layer, op) -> one row's output [F]

# What a probe sees of a decoder layer, in the order the forward computes it (between "embed", layer -1, and
# "final_norm", layer len(layers)): each the output of one of the plan's products and norms, or the input of the
# next one. "attention" is what the o projection reads: the attention over the rotated q and k.
OPERATIONS = ("input_norm", "qkv", "attention", "o_proj", "residual", "post_norm", "gate_up", "act_mul", "down",
              "output")


@dataclass(frozen=True)
class Parting:
    """The first operation at which a tree row's output differs bitwise from the one-token step's."""

    layer: int  # -1: the embedding; the number of layers: the final norm
    op: str  # an entry of OPERATIONS, "embed", "final_norm" or "lm_head" (the logits)
    differing: int  # elements of the row's output that differ
    max_abs: float  # the largest difference
    inputs_equal: bool  # every row it read was equal: its ancestors' k/v at the layers up to this one (the prefix's
    # k/v is the step's own, copied), so the parting is this operation's and not inherited from an earlier one


@dataclass(frozen=True)
class RowCheck:
    """One chain node of one tree against the one-token step at its position."""

    position: int  # new tokens committed before the tree's root
    depth: int  # the node's depth in the tree (0: the root)
    parting: Parting | None  # None: every operation bit for bit
    kv_parting: int | None  # the first layer whose k/v the tree leaves for this node differ from the step's kept ones
    logits_equal: bool
    argmax_equal: bool


def _order(key: tuple[int, str]) -> tuple[int, int]:
    layer, op = key  # the final norm and the logits share the last "layer", in that order
    return layer, OPERATIONS.index(op) if op in OPERATIONS else int(op == "lm_head")


class Recorder:
    """Keeps the given rows of every operation's output that a probed plan (`probing`) reports: one trace per row."""

    def __init__(self, rows: list[int]):
        self.rows = rows
        self.seen: list[Trace] = [{} for _ in rows]

    def __call__(self, layer: int, op: str, out: torch.Tensor) -> None:
        out = out.reshape(-1, out.shape[-1])  # [rows, F]
        for trace, row in zip(self.seen, self.rows):
            trace[layer, op] = out[row].clone()


class Watched:
    """One of a plan's products or norms, reporting what it reads and what it returns to `seen` (either may be
    None); every other attribute is the wrapped one's."""

    def __init__(self, inner, seen_input, seen_output):
        self.inner, self.seen_input, self.seen_output = inner, seen_input, seen_output

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.seen_input is not None:
            self.seen_input(x)
        out = self.inner(x)
        if self.seen_output is not None:
            self.seen_output(out)
        return out

    def __getattr__(self, name):
        return getattr(self.inner, name)


def probing(plan: ModelPlan, recorder: Recorder) -> ModelPlan:
    """`plan` with its products and norms reporting each operation's output to `recorder` as the Python reference
    forward (llama.reference_forward) runs it: the forward itself carries no probe."""
    def at(layer: int, op: str):
        return lambda out: recorder(layer, op, out)

    layers = []
    for i, p in enumerate(plan.layers):
        layers.append(dataclasses.replace(
            p, input_norm=Watched(p.input_norm, at(i - 1, "output") if i else at(-1, "embed"), at(i, "input_norm")),
            qkv=Watched(p.qkv, None, at(i, "qkv")), o=Watched(p.o, at(i, "attention"), at(i, "o_proj")),
            post_attention_norm=Watched(p.post_attention_norm, at(i, "residual"), at(i, "post_norm")),
            gate_up=Watched(p.gate_up, None, at(i, "gate_up")), down=Watched(p.down, at(i, "act_mul"), at(i, "down"))))
    last = len(plan.layers)
    return dataclasses.replace(plan, layers=tuple(layers),
                               norm=Watched(plan.norm, at(last - 1, "output"), at(last, "final_norm")))


def chain_nodes(topology: Topology) -> list[int]:
    """The nodes of the tree's rank-0 chain, root first: (), (0,), (0, 0), ... as deep as the tree holds it."""
    index = {p: i for i, p in enumerate(topology.paths, start=1)}
    nodes, path = [0], (0,)
    while path in index:
        nodes.append(index[path])
        path += (0,)
    return nodes


def tree_tokens(topology: Topology, chain: list[int], greedy: list[int], vocab: int) -> torch.Tensor:
    """[n] tokens: the chain carries the greedy continuation `greedy` (root first), every other node a token its
    parent's greedy successor never is (that token shifted by the node's rank + 1), so only the chain is accepted."""
    tokens = [0] * topology.num_nodes
    for i, path in enumerate(topology.paths, start=1):
        tokens[i] = (greedy[len(path)] + path[-1] + 1) % vocab
    for depth, node in enumerate(chain):
        tokens[node] = greedy[depth]
    return torch.tensor(tokens)


def first_difference(reference: Trace, tree: Trace) -> tuple[int, str, torch.Tensor, torch.Tensor] | None:
    """The first (layer, op) in forward order whose outputs differ bitwise, with both outputs; None if none does."""
    for key in sorted(reference, key=_order):
        if not torch.equal(reference[key], tree[key]):
            return key[0], key[1], reference[key], tree[key]
    return None


def _parting(layer: int, op: str, a: torch.Tensor, b: torch.Tensor, ancestors: list[RowCheck]) -> Parting:
    """The parting at (layer, op) of a row whose outputs there are `a` (the step's) and `b` (the tree's). Its inputs
    were equal unless an ancestor's k/v parted at a layer it read: the layers before (the layers up to this one
    from its attention on)."""
    reads = layer if op in OPERATIONS and OPERATIONS.index(op) >= OPERATIONS.index("attention") else layer - 1
    equal = all(r.kv_parting is None or r.kv_parting > reads for r in ancestors)
    return Parting(layer, op, int((a != b).sum()), float((a.float() - b.float()).abs().max()), equal)


def _kv_parting(tree_cache: KVCache, slot: int, cache: KVCache, kept: int) -> int | None:
    for layer in range(cache.k.shape[0]):
        if not (torch.equal(tree_cache.k[layer, :, slot], cache.k[layer, :, kept])
                and torch.equal(tree_cache.v[layer, :, slot], cache.v[layer, :, kept])):
            return layer
    return None


def _copy_prefix(cache: KVCache, length: int) -> KVCache:
    """A new cache holding `cache`'s first `length` committed entries."""
    layers, kv_heads, capacity, head_dim = cache.k.shape
    copy = KVCache(layers, kv_heads, head_dim, capacity, cache.k.dtype, cache.k.device)
    copy.k[:, :, :length] = cache.k[:, :, :length]
    copy.v[:, :, :length] = cache.v[:, :, :length]
    copy.length = length
    return copy


def one_token_steps(verifier, cache: KVCache, plan, root: int, count: int, operations: bool = True
                    ) -> tuple[list[int], list[Trace], list[torch.Tensor]]:
    """`count` greedy one-token steps from `root` through the verifier, as a job's AR steps run: the tokens (root
    first, count + 1), each step's trace of the token's row (empty without `operations`: the native step, where it
    serves, has no operations to probe), and its logits [V]."""
    one = build_buffers(chain_topology(0), cache.k.device)
    greedy, traces, logits = [root], [], []
    for _ in range(count):
        recorder = Recorder([0])
        token = torch.tensor([greedy[-1]], device=cache.k.device)
        watched = probing(plan, recorder) if operations else plan
        verified = verifier([Tree(cache, one, token, watched)])[0]
        cache.commit(1)
        recorder.seen[0][len(plan.layers), "lm_head"] = verified.logits[0]
        traces.append(recorder.seen[0])
        logits.append(verified.logits[0])
        greedy.append(int(verified.logits[0].argmax()))
    return greedy, traces, logits


def find_partings(loaded, prompt_ids: list[int], topology: Topology, steps: int, operations: bool = True
                  ) -> list[RowCheck]:
    """Every chain node of the tree verified at each of the first `steps` positions of the greedy continuation,
    against the one-token steps (the module's docstring). With `operations` the forward is the Python one, probed
    operation by operation; without, the step a job runs (the native step where it serves: step.py), compared by
    each layer's kept k/v and the logits only."""
    model, device, cfg = loaded.model, loaded.device, loaded.model.config
    plan = prepare(model)
    # with `operations`, the Python reference forward, whose plan reports each operation (`probing`)
    verifier = DynamicVerifier(model, reference_forward if operations else forward_hidden_batch)
    chain = chain_nodes(topology)
    # the greedy continuation reaches the tree's depth: a node off the chain may lie deeper than the chain does
    reach, p = topology.depth, len(prompt_ids)
    capacity = p + steps + reach + max(topology.num_nodes, ONE_TOKEN_ROWS)
    cache = KVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, capacity, loaded.dtype, device)
    buffers = build_buffers(topology, device)
    checks = []
    with torch.inference_mode():
        # 1) the prompt (as SpecDecoder.prefill runs it), then the reference: greedy one-token steps
        prompt = torch.tensor(prompt_ids, device=device)
        hidden = forward_hidden(model, cache, prompt, torch.arange(p, device=device), plan=plan)  # [p, H]
        cache.commit(p)
        root = int(plan.lm_head(hidden[-1]).argmax())
        greedy, traces, logits = one_token_steps(verifier, cache, plan, root, steps + reach, operations)
        # 2) at each position, the tree over a copy of the cache there, its chain's rows recorded
        for position in range(steps):
            committed = p + position
            tree_cache = _copy_prefix(cache, committed)
            tokens = tree_tokens(topology, chain, greedy[position:position + reach + 1], cfg.vocab_size).to(device)
            recorder = Recorder(chain)
            watched = probing(plan, recorder) if operations else plan
            verified = verifier([Tree(tree_cache, buffers, tokens, watched)])[0]
            rows = []
            for d, node in enumerate(chain):
                at = position + d  # the one-token step that processed this node's token
                row = buffers.node_rows[node]
                tree_logits = verified.logits[row] if row >= 0 else plan.lm_head(verified.hidden[node][None])[0]
                recorder.seen[d][len(plan.layers), "lm_head"] = tree_logits
                found = first_difference(traces[at], recorder.seen[d]) if operations else None
                rows.append(RowCheck(position, d, None if found is None else _parting(*found, rows),
                                     _kv_parting(tree_cache, committed + node, cache, p + at),
                                     bool(torch.equal(tree_logits, logits[at])),
                                     int(tree_logits.argmax()) == greedy[at + 1]))
            checks.extend(rows)
    return checks


def summary(checks: list[RowCheck]) -> dict:
    """Counts over the checked rows, and the operations where rows first parted on equal inputs (new partings)."""
    new = [c for c in checks if c.parting is not None and c.parting.inputs_equal]
    first = min(new, key=lambda c: (c.position, c.depth), default=None)
    by_op = Counter(c.parting.op for c in new)
    return {
        "rows": len(checks),
        "rows_bitwise": sum(c.parting is None for c in checks),
        "rows_parted_on_equal_inputs": len(new),
        "rows_kv_differ": sum(c.kv_parting is not None for c in checks),
        "rows_logits_differ": sum(not c.logits_equal for c in checks),
        "rows_argmax_differ": sum(not c.argmax_equal for c in checks),
        "new_partings_by_op": dict(by_op.most_common()),
        "first": None if first is None else asdict(first),
    }


def table(checks: list[RowCheck]) -> str:
    """Markdown: per operation, the rows that first parted there on equal inputs, and the first such row."""
    new = [c for c in checks if c.parting is not None and c.parting.inputs_equal]
    lines = ["| operation | rows parted there first | layers | first at (position, depth, layer) | "
             "elements differing | max abs |", "|---|---:|---|---|---:|---:|"]
    for op in sorted({c.parting.op for c in new}, key=lambda o: OPERATIONS.index(o) if o in OPERATIONS else -1):
        rows = [c for c in new if c.parting.op == op]
        c = rows[0]
        layers = sorted({r.parting.layer for r in rows})
        lines.append(f"| {op} | {len(rows)} | {_span(layers)} | ({c.position}, {c.depth}, {c.parting.layer}) | "
                     f"{c.parting.differing} | {c.parting.max_abs:.3g} |")
    return "\n".join(lines)


def _span(layers: list[int]) -> str:
    return ", ".join(map(str, layers)) if len(layers) <= 6 else f"{layers[0]}..{layers[-1]} ({len(layers)})"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one user message (formatted with the model's chat format)")
    src.add_argument("--prompt-file", help="a file whose text is the user message")
    p.add_argument("--tree", default="hydra", help="the tree verified: a name (hydra, medusa) or a tree file")
    p.add_argument("--steps", type=int, default=16, help="positions of the greedy continuation a tree is tried at")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--output", default=None, help="also write every row's check as JSON here")
    add_config_args(p, ModelConfig, only=("model", "dtype", "device", "quantize", "chat_format"))
    args = p.parse_args(argv)
    quiet_logging()
    torch.set_num_threads(args.threads)
    if args.steps < 1:
        p.error(f"--steps {args.steps}: needs at least 1")
    try:
        model_cfg = config_from_args(ModelConfig, args)
        loaded = load_model(model_cfg.model, model_cfg.dtype, model_cfg.device, model_cfg.chat_format,
                            model_cfg.quantize, activations=model_cfg.activations)
        topology = load_topology(args.tree)
        text = args.prompt if args.prompt is not None else Path(args.prompt_file).read_text()
    except (ValueError, FileNotFoundError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if topology.depth == 0:
        print(f"error: --tree {args.tree} has no nodes below its root: pick a tree that drafts", file=sys.stderr)
        return 2
    checks = find_partings(loaded, loaded.encode_prompt(text), topology, args.steps)
    print(f"{loaded.name} in {str(loaded.dtype).removeprefix('torch.')}, tree {topology.name} "
          f"({topology.num_nodes} nodes, chain of {len(chain_nodes(topology))}), {args.steps} positions")
    print(table(checks))
    result = summary(checks)
    if step.for_model(loaded.model, prepare(loaded.model)) is not None:
        # the native step serves this model's single-request forwards: its rows against its own one-token steps
        native = summary(find_partings(loaded, loaded.encode_prompt(text), topology, args.steps, operations=False))
        print(f"native step (step.py), by each layer's kept k/v and the logits: {native['rows']} rows, "
              f"{native['rows_kv_differ']} with k/v differing, {native['rows_logits_differ']} with logits differing")
        result["native_step"] = {k: native[k] for k in ("rows", "rows_kv_differ", "rows_logits_differ",
                                                        "rows_argmax_differ")}
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps({**result, "checks": [asdict(c) for c in checks]}, indent=1))
    print(json.dumps({**result, "model": loaded.name, "dtype": str(loaded.dtype).removeprefix("torch."),
                      "tree": topology.name, "steps": args.steps}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
