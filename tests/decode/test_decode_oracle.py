"""The decode loop on a tiny random Llama whose drafts are accepted (tests/helpers/oracle.py): long and
non-contiguous accepted paths, EOS and the token limit inside an accepted run, the context-window
fallback, switching trees on a signal recomputed by hand, and greedy equality with AR throughout
(fp32, so equality is exact). The KV cache's kept rows are checked against a fresh prefill."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from entmtp_ray.config import DecodingConfig
from entmtp_ray.decode.loop import SpecDecoder, profiled
from entmtp_ray.decode.policy import Adaptive, FixedTree, HysteresisPolicy, LadderPolicy, make_signal
from entmtp_ray.decode.tree import make_topology
from helpers.oracle import MAX_NEW, PROMPT, OracleDrafter, assert_cache_holds_the_committed_prefix, rotating, tree_of


@pytest.fixture(scope="module")
def forced_logits(loaded, reference) -> torch.Tensor:
    """[MAX_NEW, V] teacher-forced logits: row i is the distribution after output token i."""
    with torch.inference_mode():
        return loaded.model(torch.tensor([PROMPT + reference])).logits[0, len(PROMPT):].float()


def decode(loaded, reference, policy, plan=None, seed=0, profile=False, **cfg):
    """(decoder, result) of PROMPT through `policy` with the oracle (decoder.drafter) drafting; `profile`: through
    the decoder's profiling twin (loop.profiled)."""
    drafter = OracleDrafter(reference, len(PROMPT), loaded.model.config.vocab_size, **({"plan": plan} if plan else {}))
    decoder = SpecDecoder(loaded, drafter, policy)
    cfg = DecodingConfig(**{"policy": "fixed", "max_new_tokens": MAX_NEW, **cfg})
    return decoder, (profiled(decoder) if profile else decoder).generate(PROMPT, cfg,
                                                                         torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("tree, plan, min_tau, longest", [
    ("chain1", None, 1.9, 2),  # only the root is scored: one row of logits decides
    ("chain4", None, 4.5, 5),  # every step accepts the whole chain: contiguous rows
    ("branchy", None, 4.5, 5),  # the rank-0 path runs over nodes 0, 1, 4, 7, 9: kept rows are not contiguous
    ("branchy", rotating, 1.5, 5),  # later siblings and a depth-3 miss: paths end early and through ranks 1 and 2
    ("hydra", rotating, 2.0, 4),  # Hydra's tree has ranks 0-1 only at depth 4
])
def test_accepted_oracle_paths_give_exactly_the_ar_tokens(loaded, reference, tree, plan, min_tau, longest):
    decoder, result = decode(loaded, reference, FixedTree("fixed", tree_of(tree)), plan)
    assert result.output_token_ids == reference and result.finish_reason == "length"
    assert sum(result.step_accepted_lengths()) == MAX_NEW - 1  # the prefill's token is no step's
    assert result.mean_accepted_length >= min_tau
    lengths = set(result.step_accepted_lengths())
    assert max(lengths) == longest, f"the longest path of the plan is accepted at least once: {sorted(lengths)}"
    if plan is rotating:
        assert len(lengths) >= 2, f"accepted lengths should vary, got {sorted(lengths)}"
    assert_cache_holds_the_committed_prefix(loaded, decoder, result)


def test_eos_inside_an_accepted_run_stops_there(loaded, reference):
    # chain4 accepts 5 tokens a step after the prefill's one: step j emits output[5j-4 .. 5j]
    k = next(i for i in range(6, MAX_NEW) if reference[i] not in reference[:i] and i % 5 in (2, 3, 4))
    eos_model = dataclasses.replace(loaded, eos_token_ids=frozenset({reference[k]}))
    decoder, result = decode(eos_model, reference, FixedTree("fixed", tree_of("chain4")))
    assert result.finish_reason == "stop"
    assert result.output_token_ids == reference[: k + 1]
    assert result.step_accepted_lengths()[-1] == k % 5  # EOS is a drafted token, not the step's last
    assert sum(result.step_accepted_lengths()) == k
    assert_cache_holds_the_committed_prefix(loaded, decoder, result)


def test_token_limit_inside_an_accepted_run_cuts_the_run(loaded, reference):
    decoder, result = decode(loaded, reference, FixedTree("fixed", tree_of("chain4")), max_new_tokens=13)
    assert result.finish_reason == "length" and result.output_token_ids == reference[:13]
    assert result.step_accepted_lengths() == [5, 5, 2]


@pytest.mark.parametrize("room, trees", [
    (22, ["chain4"] * 4 + ["ar"] * 2),  # 20 committed by 4 chains, the last 2 one by one
    (20, ["chain4"] * 4),  # the 4th chain fills the context exactly: no fallback step needed
])
def test_near_the_context_end_steps_fall_back_to_one_node_then_stop(loaded, reference, monkeypatch, room, trees):
    monkeypatch.setattr(loaded.model.config, "max_position_embeddings", len(PROMPT) + room)
    decoder, result = decode(loaded, reference, FixedTree("fixed", tree_of("chain4")))
    assert result.finish_reason == "context"
    assert result.output_token_ids == reference[: room + 1]  # the committed tokens and the token after them
    assert [s.tree for s in result.steps] == trees
    assert decoder.cache.length == len(PROMPT) + room


def test_a_prompt_that_fills_the_context_is_refused(loaded, reference, monkeypatch):
    monkeypatch.setattr(loaded.model.config, "max_position_embeddings", len(PROMPT))
    with pytest.raises(ValueError, match=f"prompt of {len(PROMPT)} tokens leaves no room"):
        decode(loaded, reference, FixedTree("fixed", tree_of("chain4")))
    monkeypatch.setattr(loaded.model.config, "max_position_embeddings", len(PROMPT) + 1)
    _, result = decode(loaded, reference, FixedTree("fixed", tree_of("chain4")))
    assert result.output_token_ids == reference[:2] and result.finish_reason == "context"


@pytest.mark.parametrize("acceptance", ["exact", "typical"])
def test_sampling_rules_at_temperature_zero_decode_greedily(loaded, reference, acceptance):
    """--acceptance exact or typical with --temperature 0 means greedy: the decoder routes them to
    greedy acceptance (both rules need T > 0 to define their distributions)."""
    _, result = decode(loaded, reference, FixedTree("fixed", tree_of("branchy")), rotating, acceptance=acceptance)
    assert result.output_token_ids == reference


def test_time_is_split_into_prefill_decode_and_scheduling(loaded, reference, monkeypatch):
    """On a clock that ticks once per reading: the prefill is one tick, each step reads the clock once
    per phase after its start (choose, draft, verify, accept, commit, observe: six ticks), and the
    scheduling time is the choose and observe phases (two ticks per step)."""
    from itertools import count
    from types import SimpleNamespace

    from entmtp_ray.decode import loop, results

    ticks = count(100)
    clock = SimpleNamespace(perf_counter=lambda: float(next(ticks)))
    monkeypatch.setattr(loop, "time", clock)  # the request's prefill and decode times
    monkeypatch.setattr(results, "time", clock)  # each step's phase clock
    _, result = decode(loaded, reference, FixedTree("fixed", tree_of("chain4")), max_new_tokens=16)
    steps = len(result.steps)
    assert steps == 3
    assert (result.prefill_s, result.schedule_s, result.decode_s) == (1.0, 2.0 * steps, 7.0 * steps + 1)
    assert all(s.seconds == {} for s in result.steps)  # phases are kept only when profiled
    _, timed = decode(loaded, reference, FixedTree("fixed", tree_of("chain4")), max_new_tokens=16, profile=True)
    assert all(s.seconds == dict.fromkeys(results.PHASES, 1.0) for s in timed.steps)


def test_a_bank_policy_with_one_tree_traces_its_own_signal(loaded, reference, forced_logits):
    """A bank whose sweep chose one tree for every regime reads no signal while decoding; with
    --trace-signal the decoder updates the policy's own signal (its beta and initial value)."""
    one = LadderPolicy("entmtp-ladder", [tree_of("branchy")], [], make_signal("entropy", 0.5, 1.25))
    assert one.signal_stat is None
    _, result = decode(loaded, reference, one, rotating, trace_signal=True)
    want = ema_before_each_step(entropy_of(forced_logits), result.step_accepted_lengths(), 0.5, 1.25)
    assert result.step_signals() == pytest.approx(want, abs=1e-4)


def test_a_tree_that_drafts_needs_a_drafter(loaded):
    with pytest.raises(ValueError, match="drafts with tree 'chain1' but no heads were loaded; pass --heads"):
        SpecDecoder(loaded, None, FixedTree("fixed", tree_of("chain1")))


@pytest.mark.parametrize("temperature", [1e-4, 1e-3])
@pytest.mark.parametrize("acceptance", ["exact", "typical"])
def test_sampling_rules_at_a_tiny_temperature_give_the_greedy_tokens(loaded, reference, acceptance, temperature):
    """Near T=0 the verifier's distribution is one-hot: exact and typical acceptance must accept the
    oracle's true token at any rank and reject the rest, and the token after the path is the argmax."""
    decoder, result = decode(loaded, reference, FixedTree("fixed", tree_of("branchy")), rotating, temperature=temperature,
                             acceptance=acceptance)
    assert result.output_token_ids == reference
    assert result.mean_accepted_length >= 1.5
    assert_cache_holds_the_committed_prefix(loaded, decoder, result)


def test_exact_sampling_never_emits_a_draft_it_rejected(loaded, reference):
    """After a rejected draft the next token comes from the residual, which excludes it. On a chain
    whose drafts are the greedy tokens (likely at T=0.7), a step that stops at depth d emits, as its
    last token, anything but the depth-d draft it just rejected."""
    rejections = 0
    for seed in range(6):
        decoder, result = decode(loaded, reference, FixedTree("fixed", tree_of("chain4")), seed=seed,
                                 temperature=0.7, acceptance="exact")
        emitted = 1
        for step, drafts in zip(result.steps, decoder.drafter.drafts):
            a = step.accepted_length
            new = result.output_token_ids[emitted: emitted + a]
            assert new[:-1] == drafts[1:a], "accepted drafts are emitted as drafted"
            if a < 5 and emitted + a < MAX_NEW:  # the depth-a draft was rejected, not cut by the limit
                assert new[-1] != drafts[a]
                rejections += 1
            emitted += a
    assert rejections >= 20


@pytest.mark.parametrize("epsilon, alpha, accepts", [
    (1.5, 100.0, False),  # threshold min(1.5, 100 exp(-H)) > 1: nothing can pass
    (1e-30, 100.0, True),  # epsilon caps the threshold near 0
    (100.0, 1e-30, True),  # alpha scales it near 0
])
def test_typical_epsilon_and_alpha_reach_the_rule(loaded, reference, epsilon, alpha, accepts):
    _, result = decode(loaded, reference, FixedTree("fixed", tree_of("branchy")), temperature=0.7, acceptance="typical",
                       typical_epsilon=epsilon, typical_alpha=alpha)
    assert (result.mean_accepted_length > 2.0) is accepts, result.step_accepted_lengths()
    if not accepts:
        assert set(result.step_accepted_lengths()) == {1}


def ema_before_each_step(observations: list[float], lengths: list[int], beta: float, initial: float) -> list[float]:
    """The signal a policy saw before each step: observations[i] belongs to output token i."""
    want, s, seen = [], initial, 0
    for n in lengths:
        want.append(s)
        for x in observations[seen: seen + n]:
            s = beta * s + (1 - beta) * x
        seen += n
    return want


def entropy_of(logits: torch.Tensor) -> list[float]:
    log_p = torch.log_softmax(logits, -1)
    return (-(log_p.exp() * log_p).sum(-1)).tolist()


def test_a_switching_policy_switches_on_the_entropy_it_should_and_keeps_the_ar_tokens(loaded, reference,
                                                                                         forced_logits):
    entropy = entropy_of(forced_logits)
    q = sorted(entropy)
    on, off, initial = q[len(q) // 3], q[2 * len(q) // 3], q[len(q) // 2]
    policy = HysteresisPolicy("entmtp-tau", tree_of("chain1"), tree_of("branchy"), on, off, make_signal("entropy", 0.5, initial))
    decoder, result = decode(loaded, reference, policy, rotating)
    assert result.output_token_ids == reference
    trees = [step.tree for step in result.steps]
    assert result.tree_switches() == sum(a != b for a, b in zip(trees, trees[1:])) >= 2
    assert result.tree_usage() == {t: trees.count(t) for t in ("chain1", "branchy")}
    lengths = result.step_accepted_lengths()
    assert max(lengths) >= 3, "multi-token steps must feed the signal"
    assert 0 < result.schedule_s < result.decode_s
    signals = result.step_signals()
    assert signals == pytest.approx(ema_before_each_step(entropy, lengths, 0.5, initial), abs=1e-4)
    # and each step's tree is the one hysteresis picks from the signal before it (conservative first)
    aggressive, chosen = False, []
    for i, s in enumerate(signals):
        if i and aggressive and s >= off:
            aggressive = False
        elif i and not aggressive and s <= on:
            aggressive = True
        chosen.append("branchy" if aggressive else "chain1")
    assert [step.tree for step in result.steps] == chosen


def test_an_adaptive_policy_falls_back_to_one_node_and_its_probe_brings_it_back_with_the_ar_tokens(loaded, reference):
    """Drafts nowhere for the first 10 steps, then always at rank 0: the chain's accepted length falls from the
    prior 3 until the one-node tree emits 5% faster at these costs (under 1.9: 8 steps), and a probe finds the
    content turned."""
    one, chain = make_topology([], "n1"), tree_of("chain4")
    policy = Adaptive(FixedTree("entmtp-star", chain), [one], {"n1": 1.0, "chain4": 2.0}, {"n1": 1.0, "chain4": 3.0},
                      probe=8)
    decoder, result = decode(loaded, reference, policy, lambda call, depth: None if call < 10 else 0)
    assert result.output_token_ids == reference and result.finish_reason == "length"
    trees = [step.tree for step in result.steps]
    fell = trees.index("n1")
    assert trees[:fell] == ["chain4"] * fell == ["chain4"] * 8
    back = trees.index("chain4", fell)
    assert back - fell == 7 and set(trees[back:]) == {"chain4"}  # the probe after 7 one-node steps, then kept
    assert [step.path for step in result.steps][back:back + 2] == [(0, 0, 0, 0)] * 2
    assert_cache_holds_the_committed_prefix(loaded, decoder, result)


def test_an_adaptive_policys_step_costs_are_measured_where_it_runs_and_kept_for_the_next(loaded, reference,
                                                                                         tmp_path):
    """measure_costs puts each of the policy's trees' seconds per step, timed through the decoder, in place of the
    bank's costs and into the machine's cost table, which the next decoder reads instead of timing again; a table
    of another machine or setting is another file; a policy that does not adapt is left alone; the decoder then
    decodes as before."""
    from entmtp_ray.decode.costs import CostTable, measure_costs
    from entmtp_ray.decode.tree import load_topology

    one, chain = make_topology([], "n1"), tree_of("chain4")

    def star() -> Adaptive:
        return Adaptive(FixedTree("entmtp-star", chain), [one], {"n1": 1.0, "chain4": 2.0}, {"n1": 1.0, "chain4": 3.0})

    def decoder_of(policy) -> SpecDecoder:
        return SpecDecoder(loaded, OracleDrafter(reference, len(PROMPT), loaded.model.config.vocab_size), policy)

    key = {"model": "tiny/llama", "machine": "here", "threads": 1}
    policy = star()
    decoder = decoder_of(policy)
    line = measure_costs(policy, lambda: decoder, CostTable.open(key, tmp_path))
    assert set(policy.costs) == {"n1", "chain4"} and all(0 < c < 0.5 for c in policy.costs.values())
    path = tmp_path / f"tiny_llama-{CostTable.open(key, tmp_path).path.name.split('-')[-1]}"
    assert line.startswith(f"step costs measured now (2 trees, ") and f" in {path}: " in line and "chain4" in line
    again = star()
    line = measure_costs(again, lambda: pytest.fail("timed again"), CostTable.open(key, tmp_path))
    assert line.startswith("step costs cached from ") and again.costs == policy.costs
    assert CostTable.open({**key, "machine": "there"}, tmp_path).entries == {}
    fresh = star()
    assert measure_costs(fresh, lambda: decoder_of(fresh)).startswith("step costs measured now (2 trees, ")  # in memory
    assert measure_costs(FixedTree("ar", load_topology("ar")), lambda: pytest.fail("built")) is None
    result = decoder.generate(PROMPT, DecodingConfig(policy="fixed", max_new_tokens=MAX_NEW))
    assert result.output_token_ids == reference


def test_trees_that_cannot_win_at_the_costs_known_are_not_timed(loaded, reference, tmp_path):
    """A tree whose tokens a step, even at the cost a smaller tree bounds it by, stay below CONTENDER of the fastest
    tree's rate is left unpriced (no timing, no entry); the one-node tree is timed precisely with whatever else may
    win."""
    from entmtp_ray.decode.costs import CONTENDER, CostTable, price

    one, chain, wide = make_topology([], "n1"), tree_of("chain4"), make_topology([(i,) for i in range(15)], "w16")
    decoder = SpecDecoder(loaded, OracleDrafter(reference, len(PROMPT), loaded.model.config.vocab_size),
                          FixedTree("x", one))
    table = CostTable.open({"model": "tiny"}, tmp_path)
    table.add({one: (1.0, 1)})  # a made-up second a step: any tree of tau < CONTENDER is hopeless above it
    costs = price(lambda: decoder, [one, chain, wide], {"n1": 1.0, "chain4": CONTENDER * 0.99, "w16": 5.0}, table)
    assert set(costs) == {"n1", "w16"} and costs["n1"] == 1.0 and costs["w16"] < 0.5
    assert table.seconds(chain) is None and CostTable.open({"model": "tiny"}, tmp_path).seconds(wide) == costs["w16"]
    # the table records the tree as weighed (left out), so a later run neither times it nor takes the table as lacking
    assert table.covers([one, chain, wide]) and CostTable.open({"model": "tiny"}, tmp_path).covers([chain])
    assert price(lambda: pytest.fail("timed"), [one, chain, wide], {"n1": 1.0, "chain4": CONTENDER * 0.99, "w16": 5.0},
                 CostTable.open({"model": "tiny"}, tmp_path)) == costs
    # the bound grows with the nodes as the known trees' costs do (half their growth a node): 1 s at one node and
    # 3 s at five make 16 nodes at least 5.75 s, too dear for 2.5 tokens a step beside the root's 1 a second
    grown = CostTable({}, None)
    grown.add({one: (1.0, 1), chain: (3.0, 1)})
    tau = {"n1": 1.0, "chain4": 1.0, "w16": 2.5}
    assert price(lambda: pytest.fail("timed"), [one, chain, wide], tau, grown) == {"n1": 1.0, "chain4": 3.0}


def test_one_node_steps_of_a_drafting_policy_reach_the_drafter_with_its_next_drafting_step(loaded, reference):
    """A one-node step of a policy that drafts leaves its token's hidden state for the next step that drafts, so a
    fallback to AR pays no prefix layer: at every drafting step the heads' cache holds every committed token, and the
    context they draft from is the one a drafter advanced token by token has (the prefix layer's rows are its own)."""
    from entmtp_ray.decode.drafting import HydraDrafter
    from entmtp_ray.model.heads import init_heads
    from entmtp_ray.model.llama import forward_hidden
    from entmtp_ray.model.kv_cache import KVCache

    one, chain = make_topology([], "n1"), tree_of("chain2")

    class Alternating(FixedTree):  # three one-node steps, then one that drafts
        def __init__(self):
            super().__init__("alternating", chain)
            self.calls = 0

        def trees(self):
            return [one, chain]

        def choose(self):
            self.calls += 1
            return chain if self.calls % 4 == 0 else one

    seen = []

    advances = []

    class Watching(HydraDrafter):
        def advance(self, base_hidden, positions):
            advances.append(base_hidden.shape[0])
            super().advance(base_hidden, positions)

        def draft(self, buffers, root):
            if buffers.num_nodes > 1:
                seen.append((self.cache.length, decoder.cache.length, self.context.clone()))
            return super().draft(buffers, root)

    heads = init_heads(loaded.model, num_heads=4, seed=3).eval()
    decoder = SpecDecoder(loaded, Watching(heads, loaded.model), Alternating())
    result = decoder.generate(PROMPT, DecodingConfig(policy="fixed", max_new_tokens=MAX_NEW))
    assert result.output_token_ids == reference and len(seen) >= 8
    assert all(drafted == committed for drafted, committed, _ in seen)
    # two prefix-layer calls a cycle of four steps (the catch-up on three tokens, the drafting step's own), not four
    assert len(advances) <= 2 * len(seen) + 2 and 3 in advances[1:]
    with torch.inference_mode():  # the context after each drafting step's committed prefix, advanced row by row
        tokens = torch.tensor(PROMPT + reference)
        cfg = loaded.model.config
        cache = KVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, len(tokens), torch.float32, "cpu")
        hidden = forward_hidden(loaded.model, cache, tokens, torch.arange(len(tokens)))
        twin = HydraDrafter(heads, loaded.model)
        twin.begin(hidden[:len(PROMPT)], torch.arange(len(PROMPT)), len(tokens))
        contexts = {len(PROMPT): twin.context.clone()}
        for i in range(len(PROMPT), len(tokens)):
            twin.advance(hidden[i:i + 1], torch.tensor([i]))
            contexts[i + 1] = twin.context.clone()
    for _, committed, context in seen:
        assert torch.allclose(context, contexts[committed], atol=1e-5)


def test_a_switching_policy_on_the_accepted_signal_reads_no_verifier_statistic_and_keeps_the_ar_tokens(
        loaded, reference):
    """The accepted signal needs no statistic of the verifier: the decoder computes none (the steps carry no
    entropy or top-1 values), the signal follows the accepted lengths, and the tokens stay AR's."""
    policy = HysteresisPolicy("entmtp-tau", tree_of("chain1"), tree_of("chain4"), -1.9, -1.2,
                              make_signal("accepted", 0.5, -1.5))
    _, result = decode(loaded, reference, policy, rotating)
    assert result.output_token_ids == reference
    assert all(step.entropy == [] and step.top1_prob == [] for step in result.steps)
    lengths = result.step_accepted_lengths()
    want, s = [], -1.5
    for n in lengths:
        want.append(s)
        s = 0.5 * s - 0.5 * n
    assert result.step_signals() == pytest.approx(want)
    assert len(result.tree_usage()) == 2, "the lengths should carry the policy across both thresholds"


@pytest.mark.parametrize("signal", ["top1", "path"])
def test_a_ladder_on_top1_signals_reads_the_verifier_at_every_accepted_token(loaded, reference, forced_logits,
                                                                              signal):
    top1 = torch.softmax(forced_logits, -1).amax(-1).tolist()
    if signal == "top1":
        observations = [1 - p for p in top1]
    # the signal's observations: per token (top1), per step over ~3 accepted tokens (path)
    span = 1 if signal == "top1" else 3
    values = sorted(1 - float(torch.tensor(top1[i: i + span]).prod()) for i in range(len(top1) - span))
    mid = values[len(values) // 2]
    ladder = LadderPolicy("entmtp-ladder", [tree_of("branchy"), tree_of("chain4"), tree_of("chain1")], [values[len(values) // 4], mid],
                          make_signal(signal, 0.5, mid))
    _, result = decode(loaded, reference, ladder, rotating)
    assert result.output_token_ids == reference
    assert len(result.tree_usage()) >= 2
    lengths = result.step_accepted_lengths()
    if signal == "top1":
        want = ema_before_each_step(observations, lengths, 0.5, mid)
    else:  # one observation per step: 1 - the product of top-1 probabilities along the accepted path
        want, seen, s = [], 0, mid
        for n in lengths:
            want.append(s)
            value = 1.0
            for p in top1[seen: seen + n]:
                value *= p
            s = 0.5 * s + 0.5 * (1 - value)
            seen += n
    assert result.step_signals() == pytest.approx(want, abs=1e-4)


def test_trace_signal_records_the_entropy_a_fixed_tree_would_switch_on(loaded, reference, forced_logits):
    _, result = decode(loaded, reference, FixedTree("fixed", tree_of("branchy")), rotating, trace_signal=True)
    assert result.output_token_ids == reference
    want = ema_before_each_step(entropy_of(forced_logits), result.step_accepted_lengths(), 0.9, 0.0)
    assert result.step_signals() == pytest.approx(want, abs=1e-4)
    _, plain = decode(loaded, reference, FixedTree("fixed", tree_of("branchy")), rotating)
    assert plain.step_signals() is None and all(s.entropy == [] and s.top1_prob == [] for s in plain.steps)


def test_row_generators_are_pinned_so_a_relabel_reproduces_across_releases():
    """A row's sampling stream depends only on the run seed and the row id, by a fixed formula: the
    same --seed on the same ids draws the same samples in any later release (change it only on purpose)."""
    from entmtp_ray.decode.acceptance import row_generator

    assert row_generator(123, "q1", "cpu").initial_seed() == 762851491
    assert row_generator(0, "HumanEval/0", "cpu").initial_seed() == 2719863463
    assert row_generator(2**62, "q1", "cpu").initial_seed() == 4611686019067239026  # any seed: reduced mod 2**63
    assert row_generator(123, "q2", "cpu").initial_seed() != row_generator(123, "q1", "cpu").initial_seed()


def test_result_figures_of_short_and_empty_generations():
    from entmtp_ray.decode.results import GenerationResult, StepTrace

    one = GenerationResult([1], [5, 6], "", "length", prefill_s=0.5, decode_s=0.5, schedule_s=0.0,
                           steps=[StepTrace("t", 3, 1, [], [], signal=0.25)])
    assert one.step_signals() == [0.25] and one.tree_switches() == 0 and one.tokens_per_s == 2.0
    assert one.accepted_per_position(2) == [0.0, 0.0]
    empty = GenerationResult([1], [2], "", "stop", prefill_s=0.0, decode_s=0.0, schedule_s=0.0)
    assert empty.tokens_per_s == 0.0 and empty.mean_accepted_length == 0.0 and empty.step_signals() is None
    assert empty.accepted_per_position(3) == [0.0, 0.0, 0.0] and empty.tree_usage() == {}
    trees = ["a", "a", "b", "b", "a", "c"]
    steps = [StepTrace(t, 1, n, [], []) for t, n in zip(trees, [1, 2, 3, 1, 5, 2])]
    many = GenerationResult([1], [0] * 15, "", "length", prefill_s=1.0, decode_s=2.0, schedule_s=0.1, steps=steps)
    assert many.tree_switches() == 3 and many.tree_usage() == {"a": 3, "b": 2, "c": 1}
    assert many.mean_accepted_length == 14 / 6 and many.accepted_per_position(4) == [4 / 6, 2 / 6, 1 / 6, 1 / 6]
    assert many.step_signals() is None and many.step_accepted_lengths() == [1, 2, 3, 1, 5, 2]
