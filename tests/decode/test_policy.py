"""Scheduling signals and the switching policies (pure Python, no model)."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from entmtp_ray.decode.policy import Adaptive, FixedTree, HysteresisPolicy, LadderPolicy, make_signal
from entmtp_ray.decode.tree import make_topology


@dataclass
class Step:
    tree: str = "t"
    accepted_length: int = 1
    entropy: tuple = (0.0,)
    top1_prob: tuple = (1.0,)
    path: tuple = ()


def test_entropy_signal_is_an_ema_over_accepted_tokens():
    signal = make_signal("entropy", beta=0.9, initial=1.0)
    assert signal.update(Step(entropy=(2.0, 0.0))) == pytest.approx(0.9 * (0.9 * 1.0 + 0.1 * 2.0))
    signal.reset()
    assert signal.value == 1.0
    top1 = make_signal("top1", beta=0.5, initial=0.0)
    assert top1.update(Step(top1_prob=(0.2,))) == pytest.approx(0.4)
    path = make_signal("path", beta=0.0)
    assert path.update(Step(top1_prob=(0.5, 0.5))) == pytest.approx(0.75)
    with pytest.raises(ValueError, match="unknown signal"):
        make_signal("vibes")


def test_the_accepted_signal_is_an_ema_of_negated_accepted_lengths_and_reads_no_verifier_statistic():
    signal = make_signal("accepted", beta=0.5, initial=-2.0)
    assert signal.stat == "accepted"
    assert signal.update(Step(accepted_length=4, entropy=(), top1_prob=())) == pytest.approx(-3.0)
    policy = HysteresisPolicy("t", "small", "big", tau_on=-2.5, tau_off=-1.5,
                              signal=make_signal("accepted", beta=0.0, initial=-2.0))
    assert policy.signal_stat == "accepted"
    trail = []
    for length in [1, 3, 3, 2, 1, 1]:
        policy.observe(Step(accepted_length=length, entropy=(), top1_prob=()))
        trail.append(policy.choose())
    # s = -length: -1 (conservative), -3 (<= -2.5: aggressive), -3, -2 (between: stays), -1 (>= -1.5: back), -1
    assert trail == ["small", "big", "big", "big", "small", "small"]


def test_hysteresis_never_flips_on_a_signal_between_the_thresholds():
    rng = random.Random(0)
    for start in (False, True):
        policy = HysteresisPolicy("entmtp-tau", "small", "big", tau_on=1.0, tau_off=2.0,
                                  signal=make_signal("entropy", beta=0.0, initial=1.5), start_aggressive=start)
        chosen = set()
        for _ in range(500):
            policy.observe(Step(entropy=(rng.uniform(1.0001, 1.9999),)))
            chosen.add(policy.choose())
        assert chosen == {"big" if start else "small"}


def test_hysteresis_switches_past_each_threshold_and_resets():
    policy = HysteresisPolicy("entmtp-tau", "small", "big", tau_on=1.0, tau_off=2.0,
                              signal=make_signal("entropy", beta=0.0, initial=1.5))
    trail = []
    for h in [1.5, 0.9, 1.5, 1.9, 2.1, 1.5, 1.0, 1.9999, 2.0, 1.0001]:
        policy.observe(Step(entropy=(h,)))
        trail.append(policy.choose())
    # a signal exactly at a threshold crosses it: tau_on = 1.0 goes aggressive, tau_off = 2.0 goes back
    assert trail == ["small", "big", "big", "big", "small", "small", "big", "big", "small", "small"]
    policy.reset()
    assert policy.choose() == "small"
    with pytest.raises(ValueError, match="tau_on < tau_off"):
        HysteresisPolicy("x", "a", "b", 2.0, 1.0, make_signal("entropy"))


def test_ladder_picks_the_interval_of_the_signal():
    policy = LadderPolicy("entmtp-ladder", ["big", "mid", "small"], [0.5, 1.5],
                          make_signal("entropy", beta=0.0, initial=0.0))
    assert policy.choose() == "big"
    for h, want in [(0.49, "big"), (0.5, "mid"), (1.49, "mid"), (1.5, "small"), (0.1, "big")]:
        policy.observe(Step(entropy=(h,)))
        assert policy.choose() == want, h
    assert policy.trees() == ["big", "mid", "small"]
    with pytest.raises(ValueError, match="K-1 ascending"):
        LadderPolicy("x", ["a", "b"], [2.0, 1.0], make_signal("entropy"))


def test_a_policy_reads_only_its_signals_statistic_and_none_when_it_cannot_switch():
    """The decoder computes the verifier statistic a policy names and no other; a bank whose sweep
    chose one tree for every regime gets a policy that costs what a fixed tree costs."""
    assert HysteresisPolicy("t", "a", "b", 1.0, 2.0, make_signal("entropy")).signal_stat == "entropy"
    assert HysteresisPolicy("t", "a", "b", 0.1, 0.2, make_signal("path")).signal_stat == "top1"
    assert LadderPolicy("l", ["a", "b"], [0.5], make_signal("top1")).signal_stat == "top1"
    same = HysteresisPolicy("t", "a", "a", 1.0, 2.0, make_signal("entropy", initial=1.5))
    one = LadderPolicy("l", ["a"], [], make_signal("entropy", initial=1.5))
    for policy in (same, one):
        assert policy.signal_stat is None
        policy.observe(Step(entropy=()))  # what the decoder passes when no statistic is read
        assert policy.signal.value == 1.5 and policy.choose() == "a"


def test_settings_at_their_bounds():
    """beta in [0, 1): 0 follows the last observation, 1 would never move; tau_on must be strictly
    below tau_off; a ladder needs one threshold fewer than trees, ascending."""
    assert make_signal("entropy", beta=0.0).beta == 0.0
    for beta in (1.0, -0.1):
        with pytest.raises(ValueError, match=r"beta must be in \[0, 1\)"):
            make_signal("entropy", beta=beta)
    with pytest.raises(ValueError, match="tau_on < tau_off"):
        HysteresisPolicy("x", "a", "b", 1.0, 1.0, make_signal("entropy"))
    for trees, thresholds in [(["a", "b"], [1.0, 2.0]), (["a", "b", "c"], [1.0]), (["a", "b", "c"], [2.0, 1.0])]:
        with pytest.raises(ValueError, match="K trees and K-1 ascending thresholds"):
            LadderPolicy("x", trees, thresholds, make_signal("entropy"))
    assert LadderPolicy("x", ["a", "b", "c"], [1.0, 1.0], make_signal("entropy")).thresholds == [1.0, 1.0]


# three nested trees: the root alone, a chain of two drafts, and that chain with a second child at the root
ONE = make_topology([], "n1")
CHAIN = make_topology([(0,), (0, 0)], "n3")
WIDE = make_topology([(0,), (1,), (0, 0)], "n4")
COSTS = {"n1": 1.0, "n3": 1.5, "n4": 1.6}  # seconds a step: n3 pays over n1 from 1.5 tokens a step


def adaptive(inner_tree=WIDE, tau=None, **kw) -> Adaptive:
    return Adaptive(FixedTree("entmtp-star", inner_tree), [ONE, CHAIN], COSTS,
                    tau or {"n1": 1.0, "n3": 2.0, "n4": 2.4}, **kw)


def test_adaptive_runs_the_policys_tree_while_the_acceptance_it_was_chosen_for_holds():
    policy = adaptive()
    assert policy.trees() == [WIDE, ONE, CHAIN] and policy.name == "entmtp-star" and policy.signal_stat is None
    for i in range(50):  # the chain and the second root child in turn: n4 2.5 tokens a step, n3 2, n1 1
        assert policy.choose() == WIDE
        policy.observe(Step(tree="n4", accepted_length=3, path=(0, 0)) if i % 2 else
                       Step(tree="n4", accepted_length=2, path=(1,)))
    assert policy.tau["n4"] == pytest.approx(2.5, abs=0.06) and policy.tau["n3"] == pytest.approx(2.0, abs=0.11)


def run(policy: Adaptive, steps: int, step) -> list[str]:
    """The trees `policy` chooses over `steps` steps, each observing step(i, tree)."""
    chosen = []
    for i in range(steps):
        tree = policy.choose()
        chosen.append(tree.name)
        policy.observe(step(i, tree))
    return chosen


def test_adaptive_moves_to_the_smaller_tree_the_content_uses():
    # only the chain is ever accepted: n3 carries the same tokens for less
    chosen = run(adaptive(), 30, lambda i, tree: Step(tree=tree.name, accepted_length=3, path=(0, 0)))
    assert chosen[0] == "n4" and set(chosen[-8:]) == {"n3"} and "n1" not in chosen


def test_adaptive_falls_back_and_its_probes_bring_it_back_when_the_content_turns():
    def step(i, tree):  # first a stretch where drafts are rarely accepted, then one where the second child always is
        if tree == WIDE and (i >= 40 or i % 3 == 0):
            return Step(tree="n4", accepted_length=2, path=(1,))
        return Step(tree=tree.name, accepted_length=1, path=())

    policy = adaptive(probe=4)
    chosen = run(policy, 80, step)
    # poor stretch: n4 (1.33 tokens / 1.6 s) below n1 (1 / 1 s) once its mean has come down from the bank's 2.4,
    # then n4 every 4th step only; n3 never holds the accepted child
    assert "n3" not in chosen and chosen.index("n1") <= 20 and chosen[20:40].count("n1") >= 14
    assert chosen[-10:].count("n4") == 10  # rich stretch: n4 (2 / 1.6 s) again, found by its probes
    policy.reset()
    assert policy.tau == {"n1": 1.0, "n3": 2.0, "n4": 2.4} and policy.choose() == WIDE


def test_adaptive_falls_back_to_ar_within_a_few_steps_where_no_draft_is_accepted_and_still_probes():
    chosen = run(adaptive(probe=16), 64, lambda i, tree: Step(tree=tree.name, accepted_length=1, path=()))
    first_ar = chosen.index("n1")
    assert first_ar <= 10
    tail = chosen[first_ar:]
    assert tail.count("n4") == pytest.approx(len(tail) / 16, abs=1) and "n3" not in tail


def test_adaptive_settles_on_the_home_that_emits_fastest_at_the_costs_measured_where_it_runs():
    homes = [ONE, CHAIN, WIDE]

    def ladder() -> Adaptive:  # a switching policy over the wide tree and the root, from a bank timed elsewhere
        inner = LadderPolicy("entmtp-ladder", [WIDE, ONE], [1.0], make_signal("entropy"))
        return Adaptive(inner, [ONE], COSTS, {"n1": 1.0, "n3": 2.0, "n4": 2.4}, homes=homes)

    policy = ladder()
    # here the chain costs what the root does and the wide tree three times as much: the chain emits 2 tokens a
    # second, more than 5% over the wide tree's 0.8 and the root's 1; it runs as the star, the pair dropped, the
    # root its fallback
    assert policy.settle({"n1": 1.0, "n3": 1.0, "n4": 3.0}) == CHAIN
    assert isinstance(policy.inner, FixedTree) and policy.name == "entmtp-ladder" and policy.signal_stat is None
    assert policy.trees() == [CHAIN, ONE] and policy.choose() == CHAIN and policy.costs["n4"] == 3.0
    # within the margin of one of the policy's own trees: the policy stays, at the new costs
    stays = ladder()
    assert stays.settle({"n1": 1.0, "n3": 1.95, "n4": 2.35}) is None
    assert stays.inner.name == "entmtp-ladder" and stays.costs["n3"] == 1.95 and stays.signal_stat == "entropy"
    # of homes within the margin of the fastest, the fewest nodes: the chain only 4% faster than the root does not
    # replace the four-node star as the root does
    near = Adaptive(FixedTree("entmtp-star", WIDE), [ONE], COSTS, {"n1": 1.0, "n3": 2.0, "n4": 2.4}, homes=homes)
    assert near.settle({"n1": 1.0, "n3": 2.0 / 1.04, "n4": 5.0}) == ONE and near.trees() == [ONE]
    ar = Adaptive(FixedTree("entmtp-star", WIDE), [ONE], COSTS, {"n1": 1.0, "n3": 2.0, "n4": 2.4}, homes=homes)
    assert ar.settle({"n1": 1.0, "n3": 2.5, "n4": 3.0}) == ONE and ar.trees() == [ONE]
    assert Adaptive(FixedTree("x", WIDE), [ONE], COSTS, {"n1": 1.0, "n4": 2.4}).settle({"n1": 0.1}) is None  # no homes


def test_adaptive_counts_only_the_path_a_smaller_tree_holds_and_leaves_unknown_trees_alone():
    policy = adaptive(beta=0.0)
    policy.observe(Step(tree="n4", accepted_length=3, path=(0, 0)))
    assert (policy.tau["n1"], policy.tau["n3"], policy.tau["n4"]) == (1.0, 3.0, 3.0)
    policy.observe(Step(tree="n4", accepted_length=2, path=(1,)))
    assert (policy.tau["n3"], policy.tau["n4"]) == (1.0, 2.0)
    policy.observe(Step(tree="ar", accepted_length=1, path=()))  # a tree it was not given: nothing learnt
    assert policy.tau["n4"] == 2.0
    unknown = Adaptive(FixedTree("fixed", make_topology([(0,)], "n2")), [ONE], COSTS, {"n1": 1.0})
    assert unknown.choose().name == "n2" and unknown.trees() == [make_topology([(0,)], "n2")]
    with pytest.raises(ValueError, match="beta"):
        adaptive(beta=1.0)
