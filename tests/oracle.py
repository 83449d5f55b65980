"""A drafter that knows the answer: it drafts the base model's own greedy continuation, with the
mistakes a test chooses, so that the decoder commits long, non-contiguous accepted paths on a tiny
random model whose Hydra heads would accept almost nothing. Plain Python; no test lives here."""

from __future__ import annotations

from collections.abc import Callable

import torch

# (draft call, depth of the parent, 1-based) -> rank at which the true token sits among the
# parent's children, or None to leave it out (every child then is wrong and acceptance stops there)
Plan = Callable[[int, int], int | None]


def first_rank(call: int, depth: int) -> int | None:
    return 0


class OracleDrafter:
    """Drafts from `reference`, the greedy continuation of a prompt of `prompt_len` tokens.

    At each parent that lies on the true path, the true next token goes to the child of rank
    `plan(call, depth) % children` (None: nowhere); every other child gets a distinct wrong token.
    A rank above 0 puts the accepted path on later siblings, so the KV cache keeps a non-contiguous
    set of tree rows. `drafts` keeps every draft() call's tokens (one list per decoding step).
    """

    def __init__(self, reference: list[int], prompt_len: int, vocab: int, max_depth: int = 4,
                 plan: Plan = first_rank):
        self.reference, self.prompt_len, self.vocab = reference, prompt_len, vocab
        self.max_depth, self.plan = max_depth, plan
        self.committed = 0  # tokens in the base model's cache: prompt + committed output
        self.drafts: list[list[int]] = []

    def begin(self, base_hidden, positions, capacity):
        self.committed = int(positions[-1]) + 1

    def advance(self, base_hidden, positions):
        self.committed = int(positions[-1]) + 1

    def draft(self, buffers, root: int) -> torch.Tensor:
        at = self.committed - self.prompt_len  # output index of the root
        n = buffers.num_nodes
        tokens = [root] + [0] * (n - 1)
        on_path = [at < len(self.reference) and self.reference[at] == root] + [False] * (n - 1)
        depth_of = buffers.depth_of.tolist()
        for parent, kids in enumerate(buffers.children):
            if not kids:
                continue
            target = at + depth_of[parent] + 1
            truth = self.reference[target] if on_path[parent] and target < len(self.reference) else None
            rank = self.plan(len(self.drafts), depth_of[parent] + 1) if truth is not None else None
            slot = rank % len(kids) if rank is not None else None
            wrong = (t for t in range(self.vocab) if t != truth and t != root)
            for i, node in enumerate(kids):
                if i == slot:
                    tokens[node], on_path[node] = truth, True
                else:
                    tokens[node] = next(wrong)
        self.drafts.append(tokens)
        return torch.tensor(tokens, dtype=torch.long, device=buffers.depth_of.device)
