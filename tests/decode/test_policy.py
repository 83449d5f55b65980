"""Scheduling signals and the switching policies (pure Python, no model)."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from entmtp_ray.decode.policy import HysteresisPolicy, LadderPolicy, make_signal


@dataclass
class Step:
    tree: str = "t"
    accepted_length: int = 1
    entropy: tuple = (0.0,)
    top1_prob: tuple = (1.0,)


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
