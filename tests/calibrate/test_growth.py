"""Tree growth (Algorithm 1) over acceptance tables, and the Pareto frontier."""

from __future__ import annotations

import json
import random

import pytest

from entmtp_ray.calibrate.growth import AcceptanceTable, brute_force_best, grow_trees, pareto_frontier
from entmtp_ray.decode.tree import make_topology


def synthetic_rows(n: int, seed: int, depth: int = 3) -> list[list[int]]:
    """A synthetic acceptance model: at depth k the true token is within the kept ranks with
    probability 0.8 * 0.75^k, at a geometric rank (q = 0.45); otherwise the row stops there."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        row = []
        for k in range(depth):
            if rng.random() > 0.8 * 0.75 ** k:
                row.append(-1)
                break
            rank = 0
            while rng.random() < 0.45 and rank < 5:
                rank += 1
            row.append(rank)
        rows.append(row)
    return rows


def test_accepted_length_counts_matching_prefixes():
    table = AcceptanceTable([[0, 0], [0, 1], [1, -1], [-1]], max_depth=2)
    assert table.accepted_length([]) == 1.0
    assert table.accepted_length([(0,)]) == pytest.approx(1.5)
    assert table.accepted_length([(0,), (1,), (0, 0), (0, 1)]) == pytest.approx(1 + 3 / 4 + 2 / 4)


@pytest.mark.parametrize("budget", [3, 4, 5])
@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_growth_recovers_the_brute_force_tree(budget, seed):
    table = AcceptanceTable(synthetic_rows(3000, seed), max_depth=3)
    grown = grow_trees(table, budget, max_depth=3)[-1]
    assert len(grown) + 1 == budget
    best, winners = brute_force_best(table, budget, max_depth=3, max_rank=3)
    assert table.accepted_length(grown) == pytest.approx(best)
    assert frozenset(grown) in winners


def test_grown_trees_are_valid_nested_and_respect_depth():
    table = AcceptanceTable(synthetic_rows(2000, 5, depth=4), max_depth=4)
    trees = grow_trees(table, 64, max_depth=3)
    assert [len(t) + 1 for t in trees] == list(range(2, 65))
    for small, big in zip(trees, trees[1:]):
        assert set(small) < set(big)
        assert table.accepted_length(big) >= table.accepted_length(small)
    topology = make_topology(trees[-1], "grown", max_depth=3)  # validates prefix closure and ranks
    assert topology.depth <= 3


def test_ties_prefer_shallower_then_smaller_rank_sum():
    # no position accepts anything: every candidate gains 0, so the order is the tie-break alone
    table = AcceptanceTable([[-1]] * 4, max_depth=3)
    assert grow_trees(table, 4, max_depth=3)[-1] == ((0,), (1,), (2,))


def test_pareto_frontier_keeps_exactly_the_undominated_points():
    rng = random.Random(3)
    points = [(rng.randint(1, 30), round(rng.random() * 3, 2)) for _ in range(200)]
    keep = set(pareto_frontier(points))

    def dominated(i):
        c, v = points[i]
        return any((c2 <= c and v2 >= v) and (c2 < c or v2 > v) for c2, v2 in points)

    for i in range(len(points)):
        if i in keep:
            assert not dominated(i)
        else:
            assert dominated(i) or any(points[j] == points[i] for j in keep)


def regime_rollouts(n: int, seed: int, stretch: tuple[int, int] = (10, 30), length: int = 120):
    """Rollouts alternating confident stretches (low entropy; the true token is always the top
    draft) and uncertain ones (high entropy; nothing is accepted), each `stretch` tokens long."""
    from entmtp_ray.calibrate.rollouts import Rollout

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        rows, entropy = [], []
        while len(rows) < length:
            confident = rng.random() < 0.5
            for _ in range(rng.randint(*stretch)):
                rows.append([0, 0, 0] if confident else [-1])
                entropy.append(rng.uniform(0.0, 0.3) if confident else rng.uniform(2.0, 3.0))
        out.append(Rollout(rows=rows, entropy=entropy, top1=[1 - e / 4 for e in entropy]))
    return out


def test_policy_sweep_finds_a_switching_policy_that_beats_the_static_tree():
    from entmtp_ray.calibrate.sweep import choose_policies, replay_all
    from entmtp_ray.decode.policy import FixedTree, HysteresisPolicy, make_signal
    from entmtp_ray.decode.tree import make_topology

    rollouts = regime_rollouts(20, 0)
    trees = {"n1": make_topology([], "n1"), "n4": make_topology([(0,), (0, 0), (0, 0, 0)], "n4")}
    cost = {"n1": 1.0, "n4": 2.5}  # the deep chain pays off only where it is accepted
    params, figures = choose_policies(rollouts, trees, cost, 0.0, ["n1", "n4"], beta=0.5)
    fixed = figures["fixed_tokens_per_s"]
    assert params.star == max(fixed, key=fixed.get)
    entropy = params.signals["entropy"]
    assert (entropy.conservative, entropy.aggressive) == ("n1", "n4")
    tau = HysteresisPolicy("t", trees[entropy.conservative], trees[entropy.aggressive], entropy.tau_on,
                           entropy.tau_off, make_signal("entropy", 0.5, entropy.initial))
    switching = replay_all(rollouts, tau, cost).tokens_per_s
    static = replay_all(rollouts, FixedTree("s", trees[params.star]), cost).tokens_per_s
    assert switching > 1.1 * static  # an oracle would get about 1.3x here
    assert figures["signals"]["entropy"]["tau_tokens_per_s"] == pytest.approx(switching)
    assert entropy.gain == pytest.approx(switching / static - 1) == figures["signals"]["entropy"]["gain"]
    # under the one-node tree every step accepts 1, so the accepted signal cannot leave n1: it never switches
    assert params.signals["accepted"].gain == 0.0


def test_a_pair_that_gains_less_than_the_threshold_leaves_entmtp_tau_on_the_star(monkeypatch):
    """A switching pair must replay MIN_SWITCH_GAIN faster than the star to be kept: the replay counts no
    scheduling time. Below it, the pair is the star twice (which reads no signal); the gain is still recorded."""
    from entmtp_ray.calibrate import sweep
    from entmtp_ray.decode.tree import make_topology

    assert sweep.MIN_SWITCH_GAIN == 0.02
    rollouts = regime_rollouts(20, 0)
    trees = {"n1": make_topology([], "n1"), "n4": make_topology([(0,), (0, 0), (0, 0, 0)], "n4")}
    cost = {"n1": 1.0, "n4": 2.5}

    def entropy_pair(threshold):
        monkeypatch.setattr(sweep, "MIN_SWITCH_GAIN", threshold)
        params, _ = sweep.choose_policies(rollouts, trees, cost, 0.0, ["n1", "n4"], beta=0.5)
        return params.star, params.signals["entropy"]

    star, kept = entropy_pair(0.0)
    assert (kept.conservative, kept.aggressive) == ("n1", "n4") and kept.gain > 0.1
    star, dropped = entropy_pair(kept.gain + 1e-6)
    assert dropped.conservative == dropped.aggressive == star and dropped.gain == kept.gain


def test_the_star_is_the_smallest_tree_within_the_tolerance_of_the_fastest(monkeypatch):
    from entmtp_ray.calibrate import sweep
    from entmtp_ray.decode.tree import make_topology

    rollouts = regime_rollouts(20, 0)
    trees = {"n1": make_topology([], "n1"), "n2": make_topology([(0,)], "n2"),
             "n4": make_topology([(0,), (0, 0), (0, 0, 0)], "n4")}
    cost = {"n1": 1.0, "n2": 1.3, "n4": 1.6}

    def star(tolerance):
        monkeypatch.setattr(sweep, "STAR_TOLERANCE", tolerance)
        params, figures = sweep.choose_policies(rollouts, trees, cost, 0.0, list(trees), beta=0.5)
        return params.star, figures["fixed_tokens_per_s"]

    fastest, fixed = star(0.0)
    assert fastest == max(fixed, key=fixed.get) != "n1"
    nodes = {name: tree.num_nodes for name, tree in trees.items()}
    smaller = max((n for n in trees if nodes[n] < nodes[fastest]), key=fixed.get)  # the best of the smaller trees
    gap = 1 - fixed[smaller] / fixed[fastest]
    assert gap > 0
    assert star(gap + 1e-9)[0] == smaller  # within the tolerance: the smaller tree is the star
    assert star(gap - 1e-9)[0] == fastest


def test_measured_selection_takes_the_fastest_measured_tree_and_keeps_a_pair_only_if_it_measured_faster():
    """A bank's star is what decoded fastest on its held-out prompts, Hydra's tree and plain decoding (the 1-node
    tree) among the candidates, so the default never runs measured-slower than either; the smaller of two trees
    within MEASURED_TOLERANCE wins; the pair stays only MIN_SWITCH_GAIN above the star."""
    from entmtp_ray.calibrate.sweep import MEASURED_TOLERANCE, MIN_SWITCH_GAIN, select_measured

    nodes = {"t-n1": 1, "t-n5": 5, "t-n12": 12, "hydra": 64}
    fixed = {"t-n1": 40.0, "t-n5": 60.0, "t-n12": 60.0 * (1 + MEASURED_TOLERANCE / 2), "hydra": 55.0}
    assert select_measured(fixed, nodes, None) == ("t-n5", False)
    assert select_measured(fixed, nodes, 60.0 * (1 + MIN_SWITCH_GAIN) - 0.01) == ("t-n5", False)
    assert select_measured(fixed, nodes, 60.0 * (1 + MIN_SWITCH_GAIN)) == ("t-n5", True)
    assert select_measured(fixed | {"hydra": 70.0}, nodes, None) == ("hydra", False)  # the guard: Hydra's tree won
    assert select_measured(fixed | {"t-n1": 80.0}, nodes, 79.0) == ("t-n1", False)  # plain decoding won: no tree


def test_with_star_collapses_every_signals_pair_onto_the_new_star_unless_kept():
    from entmtp_ray.calibrate.bank import PolicyParams, SignalParams
    from entmtp_ray.calibrate.sweep import with_star

    pair = SignalParams(ladder_trees=["b"], conservative="a", aggressive="b", tau_on=0.1, tau_off=0.2, gain=0.05)
    policy = PolicyParams(star="a", signal="entropy", signals={"entropy": pair, "top1": pair})
    kept = with_star(policy, "c", keep_pair=True)
    assert kept.star == "c" and kept.signals == policy.signals
    dropped = with_star(policy, "c", keep_pair=False)
    assert dropped.star == "c" and all((p.conservative, p.aggressive) == ("c", "c") and p.gain == 0.05
                                       for p in dropped.signals.values())


def test_the_accepted_signal_switches_between_drafting_trees_as_regimes_change():
    """In long regimes what the last steps accepted predicts the next step, once the conservative tree
    drafts something to be accepted. (It lags a regime change by a few steps, which the entropy of the
    accepted tokens does not: in short regimes it gains nothing, as the test above finds.)"""
    from entmtp_ray.calibrate.sweep import choose_policies
    from entmtp_ray.decode.tree import make_topology

    rollouts = regime_rollouts(10, 1, stretch=(60, 150), length=600)
    trees = {"n1": make_topology([], "n1"), "n2": make_topology([(0,)], "n2"),
             "n4": make_topology([(0,), (0, 0), (0, 0, 0)], "n4")}
    cost = {"n1": 1.0, "n2": 1.2, "n4": 1.6}
    params, figures = choose_policies(rollouts, trees, cost, 0.0, ["n1", "n2", "n4"], beta=0.5)
    accepted = params.signals["accepted"]
    assert (accepted.conservative, accepted.aggressive) == ("n2", "n4") and accepted.gain > 0.05
    assert accepted.tau_on < accepted.tau_off < 0  # negated accepted lengths
    assert accepted.gain == figures["signals"]["accepted"]["gain"]


def test_signal_power_reads_each_signal_before_each_step_of_the_replayed_tree():
    """signal_trace by hand: the values each signal held before the steps it is set against, and the steps'
    accepted lengths (the first step left out, as every signal starts from its initial value there)."""
    from entmtp_ray.calibrate.predict import signal_trace
    from entmtp_ray.calibrate.rollouts import Rollout
    from entmtp_ray.decode.tree import make_topology

    chain = make_topology([(0,), (0, 0)], "chain")
    rollout = Rollout(rows=[[0, 0], [0, 5], [-1], [0, 0], [0], [0]], entropy=[0.1, 0.2, 3.0, 3.0, 0.1, 0.1],
                      top1=[0.9] * 6)
    values, lengths = signal_trace(rollout, chain, beta=0.0, names=("entropy", "accepted"), skip=1)
    # steps: root 0 accepts 3 (tokens 0-2 seen), root 3 accepts 2 (tokens 3-4), root 5 is the rollout's end
    assert lengths == [2]
    assert values == {"entropy": [3.0], "accepted": [-3.0]}  # beta 0: the last observation of step one
    values, lengths = signal_trace(rollout, chain, beta=0.0, skip=0)
    assert lengths == [3, 2] and values["entropy"] == [0.0, 3.0]


def test_signal_power_finds_the_entropy_that_predicts_and_the_accepted_lengths_that_lag():
    """On regimes of 10-30 tokens the entropy of the accepted tokens separates the steps that will accept
    much from those that will not; on regimes of 60-150 tokens the accepted lengths do too."""
    from entmtp_ray.calibrate.predict import power_table, signal_power
    from entmtp_ray.decode.tree import make_topology

    chain = make_topology([(0,), (0, 0), (0, 0, 0)], "n4")
    short = signal_power(regime_rollouts(20, 0), chain, beta=0.5)
    assert short["entropy"]["pearson"] < -0.5
    taus = short["entropy"]["tau_by_quintile"]
    assert taus[0] > 2.5 > 1.5 > taus[-1] and len(taus) == 5
    long = signal_power(regime_rollouts(10, 1, stretch=(60, 150), length=600), chain, beta=0.5)
    assert long["accepted"]["pearson"] < -0.5 and long["accepted"]["pearson"] < short["accepted"]["pearson"]
    table = power_table(short)
    assert table.splitlines()[0].startswith("| signal | steps | Pearson r | tau Q1") and "| accepted |" in table


def test_the_signal_power_job_on_held_out_prompts(tiny_model_dirs, tmp_path, capsys):
    from entmtp_ray.jobs.signal_power import main

    model_dir, heads_dir = tiny_model_dirs
    args = ["--task", "humaneval", "--prompts", "2", "--max-new-tokens", "12", "--model", str(model_dir),
            "--heads", str(heads_dir), "--threads", "1", "--work", str(tmp_path / "work"),
            "--output", str(tmp_path / "power.json")]
    assert main(args) == 0
    power = json.loads((tmp_path / "power.json").read_text())
    assert power["prompts"] == 2 and power["tree"] == "hydra" and set(power["signals"]) == {"entropy", "top1",
                                                                                              "path", "accepted"}
    assert "| entropy |" in capsys.readouterr().out
    saved = next((tmp_path / "work").glob("rollouts-12-*.jsonl"))  # named by the model and heads measured
    cached = saved.read_text().splitlines()
    assert len(cached) == 2
    assert main(args) == 0  # from the cache: nothing decoded again
    assert saved.read_text().splitlines() == cached
