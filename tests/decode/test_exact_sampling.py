"""--acceptance exact keeps the base model's sampling distribution: a goodness-of-fit test.

A tiny random Llama with an 8-token vocabulary has 512 possible first-three-token outputs; their
exact probabilities under plain sampling at T (the product of the model's three next-token
distributions) are enumerated, and the outputs of N seeded generations are tested against them
with Pearson's chi-square (cells expected below 5 pooled). Each check fails when the p-value is
below ALPHA, so a correct sampler fails it with probability ALPHA = 1e-3 over the choice of seeds
(the seeds are fixed, so a run is deterministic). The same test must reject two deliberately
biased samplers, which shows it has the power to see the mistakes an implementation makes.

Those model-level runs take minutes (slow). The fast suite tests one tree step from crafted
logits the same way (the first two emitted tokens against the verifier's law, 6,000 draws in a
second, with the same two biased samplers as controls), and the decoder's residual through
tests/decode/test_decode_oracle.py (a rejected draft is never the next token).
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from entmtp_ray.decode import acceptance
from entmtp_ray.config import DecodingConfig
from entmtp_ray.decode.drafting import HydraDrafter
from entmtp_ray.decode.loop import SpecDecoder
from entmtp_ray.model.heads import init_heads
from entmtp_ray.model.loading import LoadedModel
from entmtp_ray.decode.policy import FixedTree
from entmtp_ray.decode.tree import load_topology

VOCAB, TOKENS, TEMPERATURE = 8, 3, 0.7
SAMPLES = 3000
SAMPLES_ONE_STEP = 6000  # draws of one tree step from crafted logits (no model): fast, same power
ALPHA = 1e-3
PROMPT = [1, 5, 2, 7, 3]
# 3 children at the root, 2 below the first, a depth-3 chain: every acceptance case occurs
TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64)
    model = LlamaForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():  # peaked next-token distributions, as a real model's are
            param.copy_((1.0 if name.endswith("norm.weight") else 0.0) + 0.5 * torch.randn(param.shape, generator=gen))
    loaded = LoadedModel(name="tiny", model=model, tokenizer=SimpleNamespace(decode=lambda ids, **_: ""),
                         chat_format="raw", dtype=torch.float32, device=torch.device("cpu"),
                         eos_token_ids=frozenset())
    heads = init_heads(model, num_heads=3, num_layers=1, seed=1)
    return loaded, HydraDrafter(heads, model)


def exact_distribution(model) -> torch.Tensor:
    """P(first three tokens) under plain sampling at TEMPERATURE: [VOCAB ** TOKENS]."""
    probs = torch.ones(1)
    prefixes = [[]]
    with torch.inference_mode():
        for _ in range(TOKENS):
            batch = torch.tensor([PROMPT + p for p in prefixes])  # [prefixes, len]
            step = torch.softmax(model(batch).logits[:, -1].double() / TEMPERATURE, -1)  # [prefixes, V]
            probs = (probs[:, None] * step).reshape(-1)
            prefixes = [p + [t] for p in prefixes for t in range(VOCAB)]
    return probs


def sample_counts(loaded, drafter, policy: FixedTree, acceptance_rule: str) -> torch.Tensor:
    decoder = SpecDecoder(loaded, drafter if policy.tree != "ar" else None, policy)
    cfg = DecodingConfig(policy="fixed", temperature=TEMPERATURE, acceptance=acceptance_rule, max_new_tokens=TOKENS)
    counts = torch.zeros(VOCAB ** TOKENS, dtype=torch.double)
    for seed in range(SAMPLES):
        out = decoder.generate(PROMPT, cfg, torch.Generator().manual_seed(seed)).output_token_ids
        counts[sum(t * VOCAB ** (TOKENS - 1 - k) for k, t in enumerate(out))] += 1
    return counts


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    small = expected < 5
    observed, expected = counts[~small], expected[~small]
    if small.any():
        observed = torch.cat([observed, counts[small].sum()[None]])
        expected = torch.cat([expected, (probs[small].sum() * counts.sum())[None]])
    stat = float(((observed - expected) ** 2 / expected).sum())
    df = observed.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.double), torch.tensor(stat / 2)))


@pytest.fixture(scope="module")
def reference(tiny, tmp_path_factory):
    loaded, drafter = tiny
    tree = tmp_path_factory.mktemp("tree") / "tree.json"
    tree.write_text(json.dumps(TREE))
    return exact_distribution(loaded.model), str(tree)


@pytest.mark.slow
def test_the_reference_is_what_ar_sampling_draws(tiny, reference):
    loaded, drafter = tiny
    probs, _ = reference
    assert float(probs.sum()) == pytest.approx(1.0)
    assert chi_square_p_value(sample_counts(loaded, drafter, FixedTree("ar", load_topology("ar")), "exact"), probs) > ALPHA


@pytest.mark.slow
def test_exact_acceptance_samples_the_base_distribution(tiny, reference):
    loaded, drafter = tiny
    probs, tree = reference
    decoder = SpecDecoder(loaded, drafter, FixedTree("fixed", load_topology(tree)))
    cfg = DecodingConfig(policy="fixed", temperature=TEMPERATURE, acceptance="exact", max_new_tokens=16)
    steps = [step.accepted_length for s in range(50)
             for step in decoder.generate(PROMPT, cfg, torch.Generator().manual_seed(s)).steps]
    # the drafts must be accepted often and below the first depth, or the tree walk goes untested
    assert sum(steps) / len(steps) > 1.3 and min(steps) == 1 and max(steps) >= 3
    assert chi_square_p_value(sample_counts(loaded, drafter, FixedTree("fixed", load_topology(tree)), "exact"), probs) > ALPHA


EXACT_ACCEPT = acceptance.exact_accept  # the rule itself, which the biased samplers below are put in place of


def _resample_from_p(tokens, logits, row_of_node, children, temperature, generator):
    """Bias 1: after rejecting every child, sample from p itself instead of the residual."""
    path, _ = EXACT_ACCEPT(tokens, logits, row_of_node, children, temperature, generator)
    return path, []


def _no_renormalising(tokens, logits, row_of_node, children, temperature, generator):
    """Bias 2: accept each child with p(x), not with its residual probability p(x) / (1 - rejected mass)."""
    node, path = 0, [0]
    while children[node]:
        probs = torch.softmax(logits[row_of_node[node]].float() / temperature, -1)
        rejected = []
        for child in children[node]:
            if float(torch.rand((), generator=generator)) < float(probs[tokens[child]]):
                path.append(child)
                node = child
                break
            rejected.append(tokens[child])
        else:
            return path, rejected
    return path, []


def first_two_tokens_counts(accept, node_logits, tokens, samples: int, seed: int = 0,
                            temperature: float = TEMPERATURE) -> dict[tuple, int]:
    """Counts of the first two tokens one tree step emits (the accepted drafts, then the token from
    the last node's residual), over `samples` seeded draws of `accept` (exact_accept's signature)."""
    from helpers.rules import next_token
    from entmtp_ray.decode.tree import build_buffers, make_topology

    buffers = build_buffers(make_topology(TREE))
    scored = node_logits[buffers.scored_nodes]  # [scored, V]
    gen = torch.Generator().manual_seed(seed)
    counts: dict[tuple, int] = {}
    for _ in range(samples):
        path, rejected = accept(tokens, scored, buffers.row_of_node, buffers.children, temperature, gen)
        last = node_logits[path[-1]]
        if rejected:
            last = last.index_fill(0, torch.tensor(rejected), float("-inf"))
        emitted = tuple(tokens[c] for c in path[1:]) + (next_token(last, temperature, gen),)
        counts[emitted[:2]] = counts.get(emitted[:2], 0) + 1
    return counts


def first_two_tokens_law(node_logits, tokens, temperature: float = TEMPERATURE) -> dict[tuple, float]:
    """What sampling from the verifier gives: x1 ~ p_root; after a drafted x1 (child c), x2 ~ p_c;
    after an undrafted x1 the step ends."""
    from entmtp_ray.decode.tree import build_buffers, make_topology

    buffers = build_buffers(make_topology(TREE))
    p = torch.softmax(node_logits.double() / temperature, -1)  # [n, V]
    child_of = {tokens[c]: c for c in buffers.children[0]}
    law = {}
    for x1 in range(VOCAB):
        if x1 in child_of:
            for x2 in range(VOCAB):
                law[(x1, x2)] = float(p[0, x1] * p[child_of[x1], x2])
        else:
            law[(x1,)] = float(p[0, x1])
    return law


@pytest.fixture(scope="module")
def crafted_step():
    """Verifier logits for every node of TREE ([8, VOCAB]) and drafts as good heads make them: each
    parent's children are its likeliest tokens, best first, so rejections remove real mass."""
    from entmtp_ray.decode.tree import build_buffers, make_topology

    gen = torch.Generator().manual_seed(3)
    node_logits = 1.5 * torch.randn(8, VOCAB, generator=gen)
    tokens = [0] * 8
    for parent, kids in enumerate(build_buffers(make_topology(TREE)).children):
        for kid, token in zip(kids, node_logits[parent].argsort(descending=True).tolist()):
            tokens[kid] = token
    return node_logits, tokens


def test_one_exact_step_emits_tokens_as_sampling_the_verifier_would(crafted_step):
    node_logits, tokens = crafted_step
    law = first_two_tokens_law(node_logits, tokens)
    counts = first_two_tokens_counts(acceptance.exact_accept, node_logits, tokens, SAMPLES_ONE_STEP)
    assert set(counts) <= set(law)
    cells = sorted(law)
    observed = torch.tensor([float(counts.get(c, 0)) for c in cells], dtype=torch.double)
    assert chi_square_p_value(observed, torch.tensor([law[c] for c in cells], dtype=torch.double)) > ALPHA


@pytest.mark.parametrize("biased", [_resample_from_p, _no_renormalising])
def test_the_one_step_test_rejects_a_biased_sampler(crafted_step, biased):
    node_logits, tokens = crafted_step
    law = first_two_tokens_law(node_logits, tokens)
    counts = first_two_tokens_counts(biased, node_logits, tokens, SAMPLES_ONE_STEP)
    cells = sorted(law)
    observed = torch.tensor([float(counts.get(c, 0)) for c in cells], dtype=torch.double)
    assert chi_square_p_value(observed, torch.tensor([law[c] for c in cells], dtype=torch.double)) < ALPHA


@pytest.mark.slow
@pytest.mark.parametrize("biased", [_resample_from_p, _no_renormalising])
def test_the_test_rejects_a_biased_sampler(tiny, reference, monkeypatch, biased):
    loaded, drafter = tiny
    probs, tree = reference
    monkeypatch.setattr(acceptance, "exact_accept", biased)
    assert chi_square_p_value(sample_counts(loaded, drafter, FixedTree("fixed", load_topology(tree)), "exact"), probs) < ALPHA


@pytest.mark.parametrize("seed", range(40))
def test_exact_at_a_tiny_temperature_accepts_what_greedy_accepts(seed):
    """Crafted logits with gaps of at least 0.25 between any two tokens: at T=1e-3 every
    distribution is one-hot to within exp(-250), so exact acceptance must take greedy's path,
    reject exactly the last node's drafted children (none is the argmax), and the residual's
    sample must be the argmax. (At T=0 the decoder sends exact to greedy, so T=0 proves nothing.)"""
    from entmtp_ray.decode.acceptance import exact_accept
    from helpers.rules import greedy_accept, next_token
    from entmtp_ray.decode.tree import build_buffers, make_topology

    rng = torch.Generator().manual_seed(seed)
    buffers = build_buffers(make_topology(TREE))
    vocab = 6
    logits = torch.stack([torch.randperm(vocab, generator=rng).float() * 0.25
                          for _ in range(buffers.scored_nodes.numel())])  # [scored, V], distinct values
    best = logits.argmax(-1)
    tokens = torch.empty(buffers.num_nodes, dtype=torch.long)
    tokens[0] = 0
    for node, kids in enumerate(buffers.children):  # siblings distinct; the argmax drafted 3 times in 4
        if not kids:
            continue
        row = int(buffers.row_of_node[node])
        order = torch.randperm(vocab, generator=rng)
        if torch.rand((), generator=rng) < 0.75:
            order = torch.cat([best[row][None], order[order != best[row]]])
            order = order[torch.randperm(len(kids), generator=rng).tolist() + list(range(len(kids), vocab))]
        else:
            order = order[order != best[row]]
        tokens[list(kids)] = order[: len(kids)]
    want = greedy_accept(tokens, logits, buffers.row_of_node, buffers.retrieve_indices).tolist()
    path, rejected = exact_accept(tokens.tolist(), logits, buffers.row_of_node, buffers.children, 1e-3,
                                  torch.Generator().manual_seed(seed))
    assert path == want
    last = path[-1]
    assert rejected == [int(tokens[c]) for c in buffers.children[last]]
    if buffers.children[last]:
        residual = logits[int(buffers.row_of_node[last])].index_fill(0, torch.tensor(rejected), float("-inf"))
        assert next_token(residual, 1e-3, torch.Generator().manual_seed(seed)) == int(best[buffers.row_of_node[last]])


def test_exact_acceptance_reproduces_with_the_seed_and_varies_across_seeds(tiny, reference):
    loaded, drafter = tiny
    _, tree = reference
    decoder = SpecDecoder(loaded, drafter, FixedTree("fixed", load_topology(tree)))
    cfg = DecodingConfig(policy="fixed", temperature=TEMPERATURE, acceptance="exact", max_new_tokens=20)
    runs = [decoder.generate(PROMPT, cfg, torch.Generator().manual_seed(s)).output_token_ids for s in (7, 7, 8)]
    assert runs[0] == runs[1] and runs[0] != runs[2]


# --- top-p / top-k: exact acceptance samples the warped distribution -------------------------------------------

def test_warp_keeps_the_top_k_then_the_smallest_set_reaching_top_p():
    from entmtp_ray.decode.acceptance import warp

    logits = torch.tensor([[2.0, 1.0, 3.0, 0.0, 1.0, -1.0]])
    assert torch.equal(warp(logits, 0.5), logits / 0.5)  # no warping: logits / T
    kept = lambda x: (x > float("-inf")).nonzero()[:, -1].tolist()  # noqa: E731
    assert kept(warp(logits, 1.0, top_k=2)) == [0, 2]
    assert kept(warp(logits, 1.0, top_k=3)) == [0, 1, 2, 4]  # a tie with the k-th stays, as in transformers
    p = torch.softmax(logits[0], -1).tolist()  # 3.0: 0.6, 2.0: 0.22, 1.0: 0.08 each, ...
    assert kept(warp(logits, 1.0, top_p=p[2] - 1e-3)) == [2]  # the likeliest alone reaches it
    assert kept(warp(logits, 1.0, top_p=p[2] + 1e-3)) == [0, 2]
    assert kept(warp(logits, 1.0, top_p=0.999999)) == [0, 1, 2, 3, 4, 5]
    # top-k first, then top-p over what is left, renormalised: 3.0 has 0.73 of the two kept
    assert kept(warp(logits, 1.0, top_p=0.75, top_k=2)) == [0, 2]
    assert kept(warp(logits, 1.0, top_p=0.7, top_k=2)) == [2]
    kept_law = torch.softmax(warp(logits, 1.0, top_k=2)[0], -1)
    assert torch.allclose(kept_law[[0, 2]], torch.softmax(logits[0, [0, 2]], -1))


@pytest.mark.parametrize("top_p, top_k", [(0.8, 0), (1.0, 3), (0.9, 4)])
def test_one_exact_step_over_warped_logits_emits_as_warped_sampling_would(crafted_step, top_p, top_k):
    from entmtp_ray.decode.acceptance import warp

    node_logits, tokens = crafted_step
    warped = warp(node_logits, TEMPERATURE, top_p, top_k)  # T applied: the rest runs at T=1
    law = first_two_tokens_law(warped, tokens, temperature=1.0)
    counts = first_two_tokens_counts(acceptance.exact_accept, warped, tokens, SAMPLES_ONE_STEP, temperature=1.0)
    assert set(counts) <= {c for c, q in law.items() if q > 0}  # never a token the warping removed
    cells = sorted(c for c, q in law.items() if q > 0)
    observed = torch.tensor([float(counts.get(c, 0)) for c in cells], dtype=torch.double)
    assert chi_square_p_value(observed, torch.tensor([law[c] for c in cells], dtype=torch.double)) > ALPHA
    # the control: the same test sees a sampler that ignores the warping (samples the plain law at T)
    plain = first_two_tokens_counts(acceptance.exact_accept, node_logits, tokens, SAMPLES_ONE_STEP)
    assert any(c not in cells for c in plain) or chi_square_p_value(
        torch.tensor([float(plain.get(c, 0)) for c in cells], dtype=torch.double),
        torch.tensor([law[c] for c in cells], dtype=torch.double)) < ALPHA


@pytest.mark.parametrize("tree", ["ar", "tree"])
def test_top_k_1_sampling_through_the_decoder_is_greedy(tiny, tree, tmp_path):
    """With only the likeliest token left, exact sampling must emit greedy's tokens: every sampling site of the
    decoder (the prefill's token, the walk, the residual, a leaf's token) applies the warping."""
    loaded, drafter = tiny
    path = tmp_path / "tree.json"
    path.write_text(json.dumps(TREE))
    policy = FixedTree("ar", load_topology("ar")) if tree == "ar" else FixedTree("fixed", load_topology(str(path)))
    decoder = SpecDecoder(loaded, drafter if tree != "ar" else None, policy)
    greedy = decoder.generate(PROMPT, DecodingConfig(policy="fixed", max_new_tokens=12)).output_token_ids
    for seed in range(5):
        for warping in (dict(top_k=1), dict(top_p=1e-6)):
            cfg = DecodingConfig(policy="fixed", temperature=TEMPERATURE, max_new_tokens=12, **warping)
            assert cfg.acceptance == "exact"
            assert decoder.generate(PROMPT, cfg, torch.Generator().manual_seed(seed)).output_token_ids == greedy


def test_typical_acceptance_refuses_top_p_and_top_k():
    from pydantic import ValidationError

    for warping in (dict(top_p=0.9), dict(top_k=5)):
        with pytest.raises(ValidationError, match="typical acceptance has no definition with --top-p or --top-k"):
            DecodingConfig(temperature=0.7, acceptance="typical", **warping)
    DecodingConfig(temperature=0.0, acceptance="typical", top_k=5)  # no sampling, nothing to warp


def _step(node_logits, tokens, stat=None, seed=0):
    """One crafted tree step as acceptance.accept reads it: the request (exact at TEMPERATURE) and its verify
    forward (logits at every node: leaf logits)."""
    from entmtp_ray.decode.tree import build_buffers, make_topology

    buffers = build_buffers(make_topology(TREE), "cpu", leaf_logits=True)
    cfg = DecodingConfig(policy="fixed", temperature=TEMPERATURE, acceptance="exact")
    request = SimpleNamespace(cfg=cfg, generator=torch.Generator().manual_seed(seed), logits_stat=stat,
                              plan=None, schedule_s=0.0)
    verified = SimpleNamespace(buffers=buffers, tokens=torch.tensor(tokens), committed=0, hidden=None,
                               logits=node_logits[buffers.logit_nodes])
    return request, verified


def test_one_exact_step_through_accept_emits_tokens_as_sampling_the_verifier_would(crafted_step):
    """The product's call (acceptance.accept: the walk over the logits warped at T, then the token after its path
    sampled from the last node's distribution or its residual), over seeded steps of the crafted tree: its first two
    tokens follow the verifier's law at T."""
    node_logits, tokens = crafted_step
    request, verified = _step(node_logits, tokens)
    counts: dict[tuple, int] = {}
    for _ in range(SAMPLES_ONE_STEP):
        got = acceptance.accept(request, verified)
        emitted = tuple(got.tokens[1:] + [got.root])[:2]
        counts[emitted] = counts.get(emitted, 0) + 1
    law = first_two_tokens_law(node_logits, tokens)
    assert set(counts) <= set(law)
    cells = sorted(law)
    observed = torch.tensor([float(counts.get(c, 0)) for c in cells], dtype=torch.double)
    assert chi_square_p_value(observed, torch.tensor([law[c] for c in cells], dtype=torch.double)) > ALPHA


def test_an_exact_step_reads_the_traced_statistic_at_each_accepted_node(crafted_step):
    """Under exact acceptance with a traced signal, the step's read-back carries the statistic at every node of its
    path, beside the path's tokens (each part of the read-back its own, by name)."""
    from entmtp_ray.decode.verify import verifier_stat

    node_logits, tokens = crafted_step
    for seed in range(20):
        request, verified = _step(node_logits, tokens, stat="entropy", seed=seed)
        got = acceptance.accept(request, verified)
        assert len(got.tokens) == len(got.node_ids) == len(got.stats) and got.tokens[0] == tokens[0]
        assert got.tokens == [tokens[n] for n in got.node_ids]
        want = verifier_stat("entropy", node_logits[got.node_ids]).tolist()
        assert got.stats == pytest.approx(want, rel=1e-6)


def test_the_next_token_at_a_temperature_is_drawn_from_the_verifier_at_it():
    """sample_next under sampling draws from softmax(logits / T) (no top-p or top-k), as the chi-square says."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, -3.0])
    cfg = DecodingConfig(policy="fixed", temperature=TEMPERATURE, acceptance="exact")
    gen = torch.Generator().manual_seed(5)
    draws = [int(acceptance.sample_next(cfg, logits, gen)) for _ in range(SAMPLES)]
    counts = torch.bincount(torch.tensor(draws), minlength=VOCAB).double()
    assert chi_square_p_value(counts, torch.softmax(logits.double() / TEMPERATURE, -1)) > ALPHA
