"""Greedy decoding through any tree equals transformers `generate(do_sample=False)` on SmolLM2 (fp32 and bf16).

The real embedded model, 10 prompts x 128 new tokens. Trees: Hydra's default and Medusa's (64
nodes), the one-node tree (AR) and a random small tree. Drafts come from the shipped Hydra++
heads (and untrained ones), and from an oracle drafter that hides the true next token at a random rank, so
long accepted paths are committed too. A mismatch fails unless the reference's top-2 logits
at the first differing position are within float noise (a tie, reported as a warning): 1e-4 in
fp32, two units in the last place of the top logit in bf16, where a tree verifies its nodes in one
multi-row attention whose rounding differs from a one-token step's.
"""

from __future__ import annotations

import json
import random
import warnings
from pathlib import Path

import pytest
import torch

from entmtp_ray.acceptance import greedy_up_to_tie
from entmtp_ray.config import DecodingConfig
from entmtp_ray.decoding import HydraDrafter, SpecDecoder
from entmtp_ray.loading import draft_vocab_for, load_model, load_model_heads
from entmtp_ray.policy import FixedTree
from entmtp_ray.tree import make_topology

pytestmark = pytest.mark.slow

PROMPTS = [json.loads(line)["prompt"] for line in
           (Path(__file__).parent.parent / "examples" / "bench_prompts.jsonl").read_text().splitlines()]
MAX_NEW = 128


@pytest.fixture(scope="module")
def loaded():
    return load_model("smollm2-135m-instruct", dtype="fp32", device="cpu")


@pytest.fixture(scope="module")
def references(loaded):
    """(prompt ids, reference output ids, reference logits per step) for every prompt."""
    refs = []
    with torch.inference_mode():
        for prompt in PROMPTS:
            ids = loaded.encode_prompt(prompt)
            out = loaded.model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=MAX_NEW,
                                        output_logits=True, return_dict_in_generate=True)
            refs.append((ids, out.sequences[0, len(ids):].tolist(), [step[0] for step in out.logits]))
    return refs


class OracleDrafter:
    """Drafts from the known greedy continuation: at each on-path parent the true token sits at a
    random rank (or is missing with probability 0.2); every other slot holds a random wrong token."""

    def __init__(self, prompt_len: int, reference: list[int], max_depth: int, seed: int, vocab: int):
        self.prompt_len, self.reference, self.max_depth = prompt_len, reference, max_depth
        self.rng = random.Random(seed)
        self.vocab = vocab
        self.committed = 0

    def begin(self, base_hidden, positions, capacity):
        self.committed = int(positions[-1]) + 1

    def advance(self, base_hidden, positions):
        self.committed = int(positions[-1]) + 1

    def draft(self, buffers, root):
        index = self.committed - self.prompt_len  # output index of the root
        tokens = [root] + [0] * (buffers.num_nodes - 1)
        on_path = [index < len(self.reference) and self.reference[index] == root] + [False] * (buffers.num_nodes - 1)
        parent_of = buffers.parent_of.tolist()
        depth_of = buffers.depth_of.tolist()
        children: dict[int, list[int]] = {}
        for node in range(1, buffers.num_nodes):
            children.setdefault(parent_of[node], []).append(node)
        for parent, kids in children.items():
            target_at = index + depth_of[parent] + 1
            truth = self.reference[target_at] if on_path[parent] and target_at < len(self.reference) else None
            slot = self.rng.randrange(len(kids)) if truth is not None and self.rng.random() > 0.2 else None
            used = {truth}
            for i, node in enumerate(kids):
                if i == slot:
                    tokens[node], on_path[node] = truth, True
                    continue
                tok = self.rng.randrange(self.vocab)
                while tok in used:
                    tok = self.rng.randrange(self.vocab)
                used.add(tok)
                tokens[node] = tok
        return torch.tensor(tokens, dtype=torch.long)


def random_tree(seed: int, nodes: int, depth: int):
    rng = random.Random(seed)
    paths = set()
    while len(paths) < nodes:
        parent = rng.choice([()] + [p for p in paths if len(p) < depth])
        rank = sum(1 for p in paths if p[:-1] == parent and len(p) == len(parent) + 1)
        paths.add(parent + (rank,))
    return make_topology(sorted(paths), name=f"random{seed}")


def assert_same_or_tie(got: list[int], want: list[int], logits: list[torch.Tensor], label: str,
                       dtype: torch.dtype = torch.float32):
    if got == want:
        return
    first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    assert first < len(logits), f"{label}: lengths differ ({len(got)} vs {len(want)}) with equal prefix"
    top2 = logits[first].float().topk(2).values
    gap = float(top2[0] - top2[1])
    # the model computes logits in `dtype` (generate hands them back as fp32)
    assert bool(greedy_up_to_tie(logits[first], torch.tensor(got[first]), dtype)), (
        f"{label}: token {first} is {got[first]} but greedy gives {want[first]} (top-2 logit gap {gap:.2e}, "
        "not a floating-point tie)")
    warnings.warn(f"{label}: floating-point tie at token {first} (top-2 logit gap {gap:.2e})", stacklevel=2)


def run_tree(loaded, references, tree_spec, drafter_for, limit=None):
    cfg = DecodingConfig(policy="fixed", tree=tree_spec, max_new_tokens=MAX_NEW)
    taus = []
    for k, (ids, want, logits) in enumerate(references[:limit]):
        drafter = drafter_for(k, ids, want)
        policy = FixedTree("fixed", tree_spec)
        decoder = SpecDecoder(loaded, drafter, policy)
        result = decoder.generate(ids, cfg)
        assert_same_or_tie(result.output_token_ids, want, logits, f"{tree_spec} prompt {k}", loaded.dtype)
        taus.append(result.mean_accepted_length)
    return taus


def test_one_node_tree_equals_generate(loaded, references):
    taus = run_tree(loaded, references, "ar", lambda k, ids, want: None)
    assert taus == [1.0] * len(PROMPTS)


@pytest.mark.parametrize("tree", ["hydra", "medusa"])
def test_default_trees_with_shipped_heads_equal_generate(loaded, references, tree):
    """The real Hydra++ drafting path (prefix layer, grounded heads, the default draft vocabulary)
    with the heads shipped for the model, which are accepted often, so long paths are committed."""
    heads = load_model_heads(loaded, None)
    vocab = draft_vocab_for(loaded.name, None, None)
    taus = run_tree(loaded, references, tree, lambda k, ids, want: HydraDrafter(heads, loaded.model, vocab))
    assert sum(taus) / len(taus) > 1.5, f"shipped heads should be accepted often, got tau {taus}"


def test_untrained_heads_equal_generate(loaded, references):
    """Random heads: drafts almost never accepted; the output must not care."""
    heads = load_model_heads(loaded, "untrained")
    run_tree(loaded, references, "hydra", lambda k, ids, want: HydraDrafter(heads, loaded.model), limit=2)


@pytest.mark.parametrize("tree", ["hydra", "medusa", "random"])
def test_trees_with_oracle_drafts_equal_generate(loaded, references, tree, tmp_path):
    spec = tree
    if tree == "random":
        spec = str(tmp_path / "random.json")
        (tmp_path / "random.json").write_text(json.dumps(random_tree(7, 12, 4).to_json()))
    vocab = loaded.model.config.vocab_size
    taus = run_tree(loaded, references, spec,
                    lambda k, ids, want: OracleDrafter(len(ids), want, 4, seed=k, vocab=vocab))
    assert min(taus) > 1.5, f"oracle drafts should be accepted often, got tau {taus}"


@pytest.mark.parametrize("task", ["gsm8k", "humaneval", "sharegpt"])
def test_entmtp_policies_with_shipped_banks_equal_generate(loaded, references, task):
    """entmtp-star, -ladder and -tau with the bank shipped for each task (its default signal on two
    prompts, every other signal it tunes on one): the shipped banks load, resolve their trees
    against the shipped heads, and decode plain greedy's tokens. (Switching mid-generation is
    checked against greedy in test_calibration with a policy that is made to switch.)"""
    from entmtp_ray.banks import default_bank_path, load_bank
    from entmtp_ray.policy import make_policy

    bank = load_bank(default_bank_path(loaded.name, task), max_depth=4)
    drafter = HydraDrafter(load_model_heads(loaded, None), loaded.model, draft_vocab_for(loaded.name, None, None))
    others = [s for s in sorted(bank.policy.signals) if s != bank.policy.signal]
    runs = [("entmtp-star", None, 2), ("entmtp-ladder", None, 2), ("entmtp-tau", None, 2)]
    runs += [(policy, signal, 1) for signal in others for policy in ("entmtp-ladder", "entmtp-tau")]
    for policy_name, signal, prompts in runs:
        cfg = DecodingConfig(policy=policy_name, task=task, signal=signal, max_new_tokens=MAX_NEW)
        decoder = SpecDecoder(loaded, drafter, make_policy(cfg, bank))
        for k, (ids, want, logits) in enumerate(references[:prompts]):
            result = decoder.generate(ids, cfg)
            assert_same_or_tie(result.output_token_ids, want, logits, f"{task} {policy_name} {signal} prompt {k}")


@pytest.fixture(scope="module")
def loaded_bf16():
    return load_model("smollm2-135m-instruct", dtype="bf16", device="cpu")


BF16_PROMPTS = 4


def assert_greedy_in_bf16(loaded, ids: list[int], got: list[int], label: str):
    """Every emitted token is the argmax of transformers' bf16 logits for our own prefix, up to a tie.

    In bf16 ties are common (a logit of 13 is representable only to 0.0625), and once a tree path
    breaks one differently from a one-token step, the continuation differs from `generate`'s. So
    the whole output is checked by one teacher-forced forward over it, not only up to the first
    difference.
    """
    with torch.inference_mode():
        logits = loaded.model(torch.tensor([ids + got])).logits[0, len(ids) - 1: len(ids) - 1 + len(got)].float()
    tokens = torch.tensor(got)  # [len(got)]
    bad = (~greedy_up_to_tie(logits, tokens, torch.bfloat16)).nonzero().flatten().tolist()
    gaps = logits.max(-1).values - logits.gather(-1, tokens[:, None])[:, 0]
    assert not bad, f"{label}: token {bad[0]} ({got[bad[0]]}) is {float(gaps[bad[0]]):.3f} below the argmax, not a tie"


def test_bf16_paths_equal_bf16_generate(loaded_bf16, tmp_path):
    """The bf16 fast path (fused, oneDNN-prepacked projections) against transformers on the same
    bf16 weights: AR equals `generate`; Hydra's tree with the shipped heads and a random tree fed
    oracle drafts (long accepted paths) emit only greedy tokens (see assert_greedy_in_bf16)."""
    loaded = loaded_bf16
    refs = []
    with torch.inference_mode():
        for prompt in PROMPTS[:BF16_PROMPTS]:
            ids = loaded.encode_prompt(prompt)
            out = loaded.model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=MAX_NEW,
                                        output_logits=True, return_dict_in_generate=True)
            refs.append((ids, out.sequences[0, len(ids):].tolist(), [step[0] for step in out.logits]))
    assert run_tree(loaded, refs, "ar", lambda k, ids, want: None) == [1.0] * BF16_PROMPTS
    heads = load_model_heads(loaded, None)
    oracle = tmp_path / "random.json"
    oracle.write_text(json.dumps(random_tree(11, 16, 4).to_json()))
    drafters = {"hydra": lambda k, ids, want: HydraDrafter(heads, loaded.model),
                str(oracle): lambda k, ids, want: OracleDrafter(len(ids), want, 4, seed=k,
                                                                 vocab=loaded.model.config.vocab_size)}
    for tree, drafter_for in drafters.items():
        cfg = DecodingConfig(policy="fixed", tree=tree, max_new_tokens=MAX_NEW)
        taus = []
        for k, (ids, want, _) in enumerate(refs):
            result = SpecDecoder(loaded, drafter_for(k, ids, want), FixedTree("fixed", tree)).generate(ids, cfg)
            assert_greedy_in_bf16(loaded, ids, result.output_token_ids, f"bf16 {tree} prompt {k}")
            taus.append(result.mean_accepted_length)
        assert sum(taus) / len(taus) > 1.5, f"{tree}: drafts should be accepted often in bf16, got tau {taus}"
