"""Greedy decoding through any tree equals transformers' greedy decoding on SmolLM2 (fp32 and bf16).

The real embedded model. AR (the one-node tree) equals `generate(do_sample=False)` token for token.
Every other output is checked by one teacher-forced transformers forward over it: each emitted
token must be the argmax after its own prefix, which by induction is plain greedy decoding, and
unlike a comparison with one `generate` run it keeps checking after a tie has sent the two apart.
A token that is not the argmax passes only at a float tie (warned): 1e-4 in fp32, two units in the
last place of the top logit in bf16, where a tree verifies its nodes in one multi-row attention
whose rounding differs from a one-token step's. Trees: Hydra's and Medusa's (64 nodes), random
small ones and the shipped banks' trees; drafts from the shipped Hydra++ heads, untrained heads,
and an oracle that puts the true token at random ranks, so long accepted paths are committed too.
"""

from __future__ import annotations

import json
import random
import warnings
from pathlib import Path

import pytest
import torch

from entmtp_ray.decode.acceptance import greedy_up_to_tie
from entmtp_ray.config import DecodingConfig
from entmtp_ray.decode.drafting import HydraDrafter
from entmtp_ray.decode.loop import SpecDecoder
from entmtp_ray.model.loading import draft_vocab_for, load_model, load_model_heads
from entmtp_ray.decode.policy import FixedTree
from entmtp_ray.decode.tree import load_topology, make_topology
from helpers.oracle import OracleDrafter

pytestmark = pytest.mark.slow

PROMPTS = [json.loads(line)["prompt"] for line in
           (Path(__file__).resolve().parents[2] / "examples" / "bench_prompts.jsonl").read_text().splitlines()]
MAX_NEW = 40  # a few dozen tokens: enough for long accepted paths and several verify steps per output
MEDUSA_NEW = 32  # the 64-node tree verifies 64 rows per step: the costliest tree, so fewer tokens
BF16_NEW = 24  # bf16 is emulated on AVX2-only CPUs: every step is several times an fp32 one


@pytest.fixture(scope="module")
def loaded():
    return load_model("smollm2-135m-instruct", dtype="fp32", device="cpu")


@pytest.fixture(scope="module")
def ar_outputs(loaded):
    """Prompt index -> (prompt ids, our AR output), decoded on first use: the oracle drafts from these."""
    decoder = SpecDecoder(loaded, None, FixedTree("ar", load_topology("ar")))
    cfg = DecodingConfig(policy="ar", max_new_tokens=MAX_NEW)
    outputs = {}

    def get(k: int) -> tuple[list[int], list[int]]:
        if k not in outputs:
            ids = loaded.encode_prompt(PROMPTS[k])
            outputs[k] = ids, decoder.generate(ids, cfg).output_token_ids
        return outputs[k]
    return get


def random_oracle(loaded, ids, reference, seed: int) -> OracleDrafter:
    """The true token at a random rank of its parent's children, or (one time in five) nowhere."""
    rng = random.Random(seed)
    return OracleDrafter(reference, len(ids), loaded.model.config.vocab_size,
                         plan=lambda call, depth: None if rng.random() < 0.2 else rng.randrange(64))


def random_tree(seed: int, nodes: int, depth: int):
    rng = random.Random(seed)
    paths = set()
    while len(paths) < nodes:
        parent = rng.choice([()] + [p for p in paths if len(p) < depth])
        rank = sum(1 for p in paths if p[:-1] == parent and len(p) == len(parent) + 1)
        paths.add(parent + (rank,))
    return make_topology(sorted(paths), name=f"random{seed}")


def assert_greedy(loaded, ids: list[int], got: list[int], label: str):
    """Every token of `got` is the argmax of transformers' logits after its own prefix, up to a tie."""
    with torch.inference_mode():
        logits = loaded.model(torch.tensor([ids + got])).logits[0, len(ids) - 1: len(ids) - 1 + len(got)].float()
    tokens = torch.tensor(got)  # [len(got)]
    gaps = logits.max(-1).values - logits.gather(-1, tokens[:, None])[:, 0]  # [len(got)], 0 where greedy
    bad = (~greedy_up_to_tie(logits, tokens, loaded.dtype)).nonzero().flatten().tolist()
    assert not bad, f"{label}: token {bad[0]} ({got[bad[0]]}) is {float(gaps[bad[0]]):.3e} below the argmax, not a tie"
    ties = (gaps > 0).nonzero().flatten().tolist()
    if ties:
        warnings.warn(f"{label}: float tie at token {ties[0]} (gap {float(gaps[ties[0]]):.2e})", stacklevel=2)


def assert_same_as_generate_or_tie(loaded, ids: list[int], ours: list[int], label: str):
    """`ours` equals transformers' `generate(do_sample=False)`, or leaves it where both tokens tie."""
    with torch.inference_mode():
        want = loaded.model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=len(ours))[0, len(ids):]
    want = want.tolist()
    first = next((i for i, (a, b) in enumerate(zip(ours, want)) if a != b), None)
    if first is None:
        assert len(ours) == len(want), f"{label}: lengths differ ({len(ours)} vs {len(want)}) with equal prefix"
        return
    with torch.inference_mode():
        logits = loaded.model(torch.tensor([ids + ours[:first]])).logits[0, -1].float()  # [V]
    both = torch.tensor([ours[first], want[first]])
    assert bool(greedy_up_to_tie(logits[None].expand(2, -1), both, loaded.dtype).all()), (
        f"{label}: token {first} is {ours[first]}, generate gives {want[first]}, and they do not tie")
    warnings.warn(f"{label}: leaves generate at a float tie at token {first}", stacklevel=2)


def run_tree(loaded, tree_spec, drafter_for, prompts, max_new: int = MAX_NEW) -> list[float]:
    """Decode `prompts` (indices into PROMPTS) through one tree; check each output; return each tau."""
    cfg = DecodingConfig(policy="fixed", tree=tree_spec, max_new_tokens=max_new)
    taus = []
    for k in prompts:
        ids = loaded.encode_prompt(PROMPTS[k])
        policy = FixedTree("fixed", load_topology(tree_spec))
        result = SpecDecoder(loaded, drafter_for(k, ids), policy).generate(ids, cfg)
        assert result.num_output_tokens == max_new or result.finish_reason == "stop"
        assert_greedy(loaded, ids, result.output_token_ids, f"{tree_spec} prompt {k}")
        taus.append(result.mean_accepted_length)
    return taus


def test_one_node_tree_equals_generate(loaded, ar_outputs):
    for k in (0, 1):
        assert_same_as_generate_or_tie(loaded, *ar_outputs(k), f"ar prompt {k}")
        assert_greedy(loaded, *ar_outputs(k), f"ar prompt {k}")


@pytest.mark.parametrize("tree, prompts, max_new", [("hydra", [3], MAX_NEW), ("medusa", [6], MEDUSA_NEW)])
def test_default_trees_with_shipped_heads_are_greedy(loaded, tree, prompts, max_new):
    """The real Hydra++ drafting path (prefix layer, grounded heads, the default draft vocabulary)
    with the heads shipped for the model, which are accepted often, so long paths are committed."""
    heads = load_model_heads(loaded, None)
    vocab = draft_vocab_for(loaded.name, None, None)
    taus = run_tree(loaded, tree, lambda k, ids: HydraDrafter(heads, loaded.model, vocab), prompts, max_new)
    assert sum(taus) / len(taus) > 1.5, f"shipped heads should be accepted often, got tau {taus}"


def test_untrained_heads_are_greedy(loaded):
    """Random heads: drafts almost never accepted; the output must not care."""
    heads = load_model_heads(loaded, "untrained")
    run_tree(loaded, "hydra", lambda k, ids: HydraDrafter(heads, loaded.model), [8])


@pytest.mark.parametrize("tree, prompts", [("hydra", [0]), ("medusa", [1]), ("random", [2])])
def test_trees_with_oracle_drafts_are_greedy(loaded, ar_outputs, tree, prompts, tmp_path):
    spec = tree
    if tree == "random":
        spec = str(tmp_path / "random.json")
        (tmp_path / "random.json").write_text(json.dumps(random_tree(7, 12, 4).to_json()))
    taus = run_tree(loaded, spec, lambda k, ids: random_oracle(loaded, ids, ar_outputs(k)[1], seed=k), prompts)
    assert min(taus) > 1.5, f"oracle drafts should be accepted often, got tau {taus}"


@pytest.mark.parametrize("task", ["gsm8k", "humaneval", "sharegpt"])
def test_entmtp_policies_with_shipped_banks_are_greedy(loaded, task):
    """entmtp-star, -ladder and -tau (its default signal) with each bank shipped for each task, in every variant,
    and -tau under every other signal the banks tune, each in one of the variants in turn, each on another prompt:
    the shipped banks load, resolve their trees against the shipped heads, and decode plain greedy's tokens.
    (Switching mid-generation is checked against greedy in test_decode_oracle.py with policies made to switch.)"""
    from entmtp_ray.assets import shipped_bank_variants
    from entmtp_ray.calibrate.bank import load_bank
    from entmtp_ray.calibrate.bank import build_policy

    drafter = HydraDrafter(load_model_heads(loaded, None), loaded.model, draft_vocab_for(loaded.name, None, None))
    variants = shipped_bank_variants(loaded.name, task)
    assert len(variants) > 1  # the primary and the cpu-fp32 bank
    k = 0
    for v, path in enumerate(variants):
        bank = load_bank(path, max_depth=4)
        others = [s for s in sorted(bank.policy.signals) if s != bank.policy.signal]
        runs = [("entmtp-star", None), ("entmtp-ladder", None), ("entmtp-tau", None)]
        runs += [("entmtp-tau", signal) for i, signal in enumerate(others) if i % len(variants) == v]
        for policy_name, signal in runs:
            k += 1
            cfg = DecodingConfig(policy=policy_name, task=task, signal=signal, max_new_tokens=MAX_NEW)
            ids = loaded.encode_prompt(PROMPTS[k % len(PROMPTS)])
            result = SpecDecoder(loaded, drafter, build_policy(cfg, bank)).generate(ids, cfg)
            assert_greedy(loaded, ids, result.output_token_ids, f"{path} {policy_name} {signal} prompt {k}")


@pytest.fixture(scope="module")
def loaded_bf16():
    return load_model("smollm2-135m-instruct", dtype="bf16", device="cpu")


@pytest.fixture(scope="module")
def bf16_ar_outputs(loaded_bf16):
    """Prompt index -> (prompt ids, our bf16 AR output), decoded on first use: the oracle drafts from these."""
    decoder = SpecDecoder(loaded_bf16, None, FixedTree("ar", load_topology("ar")))
    cfg = DecodingConfig(policy="ar", max_new_tokens=BF16_NEW)
    outputs = {}

    def get(k: int) -> tuple[list[int], list[int]]:
        if k not in outputs:
            ids = loaded_bf16.encode_prompt(PROMPTS[k])
            outputs[k] = ids, decoder.generate(ids, cfg).output_token_ids
        return outputs[k]
    return get


def test_bf16_ar_is_bf16_greedy_and_equals_generate(loaded_bf16, bf16_ar_outputs):
    """The bf16 fast path (fused, oneDNN-prepacked projections) against transformers on the same
    bf16 weights: AR emits only greedy tokens and equals `generate` up to ties. In bf16 ties are
    common (a logit of 13 is representable only to 0.0625)."""
    assert_greedy(loaded_bf16, *bf16_ar_outputs(0), "bf16 ar prompt 0")
    assert_same_as_generate_or_tie(loaded_bf16, *bf16_ar_outputs(0), "bf16 ar prompt 0")


def test_bf16_trees_are_bf16_greedy(loaded_bf16, bf16_ar_outputs, tmp_path):
    """Hydra's and Medusa's trees with the shipped heads, a bank's switching policy, and a random tree fed oracle
    drafts (long accepted paths), on the bf16 fast path, emit only greedy tokens; and, where the fixed-order
    attention is built (design §7: every tree row computed as its one-token step would be), exactly our bf16 AR's
    tokens, with no tie rule."""
    from entmtp_ray.config import ModelConfig
    from entmtp_ray.model.attention import fixed_order_ready
    from entmtp_ray.pipeline.assemble import resolve

    loaded = loaded_bf16
    heads = load_model_heads(loaded, None)
    vocab = draft_vocab_for(loaded.name, None, None)
    oracle = tmp_path / "random.json"
    oracle.write_text(json.dumps(random_tree(11, 16, 4).to_json()))
    for k in (1, 2):
        assert_greedy(loaded, *bf16_ar_outputs(k), f"bf16 ar prompt {k}")  # the oracle's truth is greedy itself

    def shipped(k, ids):
        return HydraDrafter(heads, loaded.model, vocab)

    def truth(k, ids):
        return random_oracle(loaded, ids, bf16_ar_outputs(k)[1], seed=k)

    fixed = lambda tree: FixedTree("fixed", load_topology(tree))  # noqa: E731
    bank = lambda name: resolve(ModelConfig(dtype="bf16", device="cpu"),  # noqa: E731
                                DecodingConfig(policy=name, task="humaneval")).policy
    runs = [("hydra", fixed("hydra"), shipped, 1), ("medusa", fixed("medusa"), shipped, 2),
            ("entmtp-tau", bank("entmtp-tau"), shipped, 1), ("random", fixed(str(oracle)), truth, 2)]
    cfg = DecodingConfig(policy="fixed", max_new_tokens=BF16_NEW)
    exact = fixed_order_ready()
    for name, policy, drafter_for, k in runs:
        ids, ar = bf16_ar_outputs(k)
        result = SpecDecoder(loaded, drafter_for(k, ids), policy).generate(ids, cfg)
        assert_greedy(loaded, ids, result.output_token_ids, f"bf16 {name} prompt {k}")
        assert result.mean_accepted_length > 1.5, f"{name}: drafts should be accepted often in bf16"
        if exact:
            assert result.output_token_ids == ar, f"bf16 {name} prompt {k}: not our AR's tokens"
