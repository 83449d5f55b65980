"""Counting host reads of device values (test_syncs): the Tensor methods that read back wrapped while a
block runs, and the tiny model (conftest.py's `tiny`) decoding PROMPT through each policy and acceptance
rule, counted step by step. test_static and test_verify decode the same settings."""

from __future__ import annotations

import contextlib

import torch

from entmtp_ray.config import DecodingConfig
from entmtp_ray.decode.loop import SpecDecoder
from entmtp_ray.decode.policy import FixedTree, LadderPolicy, make_signal
from entmtp_ray.decode.tree import load_topology, make_topology

READS_BACK = ("item", "tolist", "__int__", "__float__", "__bool__", "__index__", "cpu", "numpy", "nonzero")
PROMPT = [1, 5, 2, 7, 3]
TREE = make_topology([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]], "tree")


@contextlib.contextmanager
def read_backs():
    """The names of the Tensor methods that read device values, called inside the block, in order."""
    calls: list[str] = []
    saved = {name: getattr(torch.Tensor, name) for name in READS_BACK}

    def counted(name, method):
        def wrapper(self, *args, **kwargs):
            calls.append(name)
            return method(self, *args, **kwargs)
        return wrapper

    for name, method in saved.items():
        setattr(torch.Tensor, name, counted(name, method))
    try:
        yield calls
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)


POLICIES = {
    "ar": lambda: FixedTree("ar", load_topology("ar")),
    "tree": lambda: FixedTree("fixed", TREE),
    # switches trees on the entropy signal: the statistic rides on the same read-back
    "entropy-ladder": lambda: LadderPolicy("ladder", [TREE, load_topology("chain2")], [0.5], make_signal("entropy")),
    "top1-ladder": lambda: LadderPolicy("ladder", [load_topology("chain2"), TREE], [0.5], make_signal("top1")),
}
RULES = {"greedy": dict(), "typical": dict(temperature=0.7, acceptance="typical"),
         "exact": dict(temperature=0.7, acceptance="exact")}


def decode_counting(tiny, policy: str, rule: str, leaf_logits: bool, static: bool = False):
    """(output tokens, per-step (tree, accepted length, entropies, top-1s), read-backs of each step)."""
    loaded, drafter = tiny
    decoder = SpecDecoder(loaded, drafter if policy != "ar" else None, POLICIES[policy](), leaf_logits=leaf_logits,
                          static=static, graphs=False)
    cfg = DecodingConfig(policy="fixed", tree="unused", max_new_tokens=40, **RULES[rule])
    with torch.inference_mode():
        request = decoder.prefill(PROMPT, cfg, torch.Generator().manual_seed(0))
        counts = []
        while request.finish is None:
            with read_backs() as calls:
                decoder.step(request)
            counts.append(len(calls))
    steps = [(s.tree, s.accepted_length, s.entropy, s.top1_prob) for s in request.steps]
    return request.output, steps, counts
