"""Acceptance tables: the ranks measured along a rollout predict what decoding accepts."""

from __future__ import annotations

import pytest
import torch

from entmtp_ray.calibrate.rollouts import NOT_RANKED, rank_rows
from entmtp_ray.config import DecodingConfig, ModelConfig
from helpers.engines import make_engine
from entmtp_ray.calibrate.growth import AcceptanceTable
from entmtp_ray.decode.tree import load_topology


def true_path_ranks(engine, seq, t, depth):
    """Reference for one step: commit seq[:t+1] through the drafter's own incremental API, then rank
    each true token under the head that drafts it, grounded on the true tokens before it, as drafting computes
    it (the drafter's plan: its trunk and its projection over the whole vocabulary)."""
    drafter, model = engine.decoder.drafter, engine.loaded.model
    ids = torch.tensor(seq)
    cache = engine.decoder._cache_for(len(seq))
    from entmtp_ray.model.llama import forward_hidden

    hidden = forward_hidden(model, cache, ids[: t + 1], torch.arange(t + 1))
    drafter.begin(hidden, torch.arange(t + 1), len(seq))
    ranks = []
    for k in range(depth):
        if t + 2 + k >= len(seq):
            ranks.append(NOT_RANKED)  # past the rollout's end: nothing to accept
            break
        row = torch.cat([drafter.context] + [drafter.embed(ids[t + 1 + j]) for j in range(k + 1)])
        order = drafter.top_tokens(k, drafter.plan.trunks[k](row[None]), model.config.vocab_size)[0]
        ranks.append(order.tolist().index(int(ids[t + 2 + k])))
    return ranks


def test_rank_rows_match_the_drafters_own_step_by_step_view(tiny_model_dirs):
    model_dir, heads_dir = tiny_model_dirs
    engine = make_engine(ModelConfig(model=str(model_dir), heads=str(heads_dir), dtype="fp32", device="cpu"),
                    DecodingConfig(policy="hydra", max_new_tokens=12))
    result = engine.generate("r", "Tell me about rivers.")
    seq = result.prompt_token_ids + result.output_token_ids
    first = len(result.prompt_token_ids)
    big = [engine.loaded.model.config.vocab_size] * 4  # every rank kept
    with torch.inference_mode():
        rows = rank_rows(engine.decoder, seq, first, big)
        assert len(rows) == len(seq) - first
        for i in range(0, len(rows), 3):
            assert rows[i] == true_path_ranks(engine, seq, first - 1 + i, 4), f"step position {i}"
        capped = rank_rows(engine.decoder, seq, first, [5, 5, 5, 5])
    for row, full in zip(capped, rows):
        want = []
        for r in full:
            want.append(r if r < 5 else NOT_RANKED)
            if r >= 5:
                break
        assert row == want


@pytest.mark.slow
@pytest.mark.parametrize("tree", ["hydra", "chain3"])
def test_table_predicts_every_steps_accepted_length_with_shipped_heads(tree):
    engine = make_engine(ModelConfig(dtype="fp32", device="cpu"),
                    DecodingConfig(policy="fixed", tree=tree, max_new_tokens=48))
    topology = load_topology(tree, max_depth=4)
    paths = set(topology.paths)
    ranks_needed = [max((p[k] for p in paths if len(p) > k), default=-1) + 1 for k in range(topology.depth)]
    predicted_total = actual_total = 0
    for k, prompt in enumerate(["Natalia sold clips to 48 of her friends in April, and then she sold half as many "
                                "clips in May. How many clips did Natalia sell altogether?",
                                "Write a Python function that reverses a string."]):
        result = engine.generate(f"p{k}", prompt)
        seq = result.prompt_token_ids + result.output_token_ids
        first = len(result.prompt_token_ids)
        with torch.inference_mode():
            rows = rank_rows(engine.decoder, seq, first, ranks_needed)
        position = 0  # rollout index of each step's root
        for step in result.steps[:-1]:  # the last step may be cut by the token limit
            row = rows[position]
            accepted = 1 + max([d for d in range(1, len(row) + 1) if tuple(row[:d]) in paths], default=0)
            assert step.accepted_length == accepted, (tree, k, position)
            predicted_total += accepted
            actual_total += step.accepted_length
            position += step.accepted_length
    assert actual_total == predicted_total
    table = AcceptanceTable(rows, max_depth=topology.depth)
    assert table.accepted_length(paths) >= 1.0


def test_replay_counts_steps_tokens_and_switches_by_hand():
    from entmtp_ray.calibrate.growth import replay
    from entmtp_ray.decode.policy import HysteresisPolicy, make_signal
    from entmtp_ray.decode.tree import make_topology

    one, chain = make_topology([], "one"), make_topology([(0,), (0, 0)], "chain")
    rows = [[0, 0], [0, 5], [-1], [0, 0], [0], [0]]  # a 6-token rollout (token 0 came from the prefill)
    entropy = [0.1, 0.1, 3.0, 3.0, 0.1, 0.1]
    policy = HysteresisPolicy("entmtp-tau", one, chain, tau_on=0.5, tau_off=2.0,
                              signal=make_signal("entropy", beta=0.0, initial=0.1), start_aggressive=True)
    result = replay(rows, entropy, [0.9] * 6, policy, {"one": 1.0, "chain": 3.0})
    # chain at root 0 accepts 0,0 -> 3 tokens (1,2,3), saw entropies 0.1 0.1 3.0 -> conservative;
    # one at root 3 -> 1 token, saw 3.0 -> stays; one at root 4 -> the last token (its low entropy
    # turns the policy aggressive, but the rollout has ended)
    assert (result.steps, result.tokens, result.switches) == (3, 5, 1)
    assert result.usage == {"chain": 1, "one": 2} and result.seconds == 5.0
    assert result.tau == 5 / 3


@pytest.mark.slow
def test_replay_reproduces_greedy_decoding_of_a_switching_policy():
    from entmtp_ray.calibrate.rollouts import measure_rollout
    from entmtp_ray.decode.loop import SpecDecoder
    from entmtp_ray.calibrate.growth import accepted_lengths, replay
    from entmtp_ray.decode.policy import HysteresisPolicy, make_signal

    base = make_engine(ModelConfig(dtype="fp32", device="cpu"), DecodingConfig(policy="hydra", max_new_tokens=64))
    trees = [load_topology(name, max_depth=4) for name in ("chain3", "hydra")]
    policy = HysteresisPolicy("entmtp-tau", *trees, tau_on=0.6, tau_off=1.2,
                              signal=make_signal("entropy", beta=0.5, initial=1.0))
    decoder = SpecDecoder(base.loaded, base.decoder.drafter, policy)
    switches = 0
    for k, prompt in enumerate(["Write a haiku about autumn, then explain it.",
                                "A farmer has 12 cows and buys 7 more. Each cow gives 3 litres of milk a day. "
                                "How much milk does he get in a week?"]):
        ids = base.loaded.encode_prompt(prompt)
        result = decoder.generate(ids, base.decoding)
        with torch.inference_mode():
            rollout = measure_rollout(decoder, ids + result.output_token_ids, len(ids), [10, 10, 10, 10])
        replayed = replay(rollout.rows, rollout.entropy, rollout.top1, policy, {"chain3": 1.0, "hydra": 1.0})
        assert replayed.steps == len(result.steps), k
        assert replayed.tokens == sum(s.accepted_length for s in result.steps), k
        assert dict(replayed.usage) == result.tree_usage(), k
        assert replayed.switches == result.tree_switches(), k
        fast = replay(rollout.rows, rollout.entropy, rollout.top1, policy, {"chain3": 1.0, "hydra": 1.0},
                      lengths=accepted_lengths(rollout.rows, trees))
        assert (fast.steps, fast.tokens, fast.usage, fast.switches) == (
            replayed.steps, replayed.tokens, replayed.usage, replayed.switches), k
        assert 0 < result.schedule_s < 0.05 * result.decode_s, k  # the scheduler is timed, and cheap
        switches += replayed.switches
    assert switches > 0, "the thresholds should make this policy switch at least once"


def test_cached_rank_tables_are_reused_only_for_the_same_heads(tiny_model_dirs, tmp_path):
    """A bank rebuilt after new heads were written over the same folder measures afresh (stale tables would
    calibrate the new heads' bank on the old heads' acceptance)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from entmtp_ray.pipeline.calibration import CalibrationRow, measure_tables

    model_dir, heads_dir = tiny_model_dirs
    heads = tmp_path / "heads"
    shutil.copytree(heads_dir, heads)
    cfg = ModelConfig(model=str(model_dir), heads=str(heads), dtype="fp32", device="cpu")
    engine = make_engine(cfg, DecodingConfig(policy="hydra", max_new_tokens=12))
    result = engine.generate("r", "Tell me about rivers.")
    rows = [CalibrationRow("r", "Tell me about rivers.", result.output_token_ids)]
    work = tmp_path / "work"
    work.mkdir()
    with torch.inference_mode():
        first = measure_tables(engine, rows, work)
    saved = json.loads((work / "tables.json").read_text())
    assert saved["measured_by"]["heads"] and saved["ids"] == ["r"]
    saved["rollouts"][0]["rows"] = [[0, 0, 0, 0]] * len(saved["rollouts"][0]["rows"])  # a marker: read, not measured
    (work / "tables.json").write_text(json.dumps(saved))
    with torch.inference_mode():
        assert measure_tables(engine, rows, work)[0].rows == saved["rollouts"][0]["rows"]

    weights = load_file(heads / "heads.safetensors")
    save_file({k: v + 0.5 * torch.randn_like(v) for k, v in weights.items()}, heads / "heads.safetensors")
    retrained = make_engine(cfg, DecodingConfig(policy="hydra", max_new_tokens=12))
    with torch.inference_mode():
        again = measure_tables(retrained, rows, work)
    assert again[0].rows != saved["rollouts"][0]["rows"], "new heads in the same folder were measured afresh"
    assert json.loads((work / "tables.json").read_text())["measured_by"]["heads"] != saved["measured_by"]["heads"]
    assert len(again[0].rows) == len(first[0].rows)


def test_a_bank_is_chosen_by_decoding_its_held_out_prompts(tiny_model_dirs, tmp_path):
    """build_bank holds a quarter of the rollouts out of growth and the sweeps, decodes those prompts with the best
    replayed trees, Hydra's tree, the 1-node tree (and a pair) side by side, and takes the measured fastest as the
    star; the bank records each candidate's replayed and measured figures, the replay predicts the measured
    accepted lengths exactly (greedy, fp32), and a rebuild reuses the measurements."""
    import json

    from entmtp_ray.calibrate.bank import Bank, selection_report
    from entmtp_ray.calibrate.sweep import MEASURED_TOLERANCE
    from entmtp_ray.pipeline.calibration import CalibrationRow, build_bank, split_held_out

    model_dir, heads_dir = tiny_model_dirs
    engine = make_engine(ModelConfig(model=str(model_dir), heads=str(heads_dir), dtype="fp32", device="cpu"),
                    DecodingConfig(policy="hydra", max_new_tokens=16))
    prompts = [f"Tell me about {topic}." for topic in ("rivers", "owls", "tea", "maps", "salt", "ice", "clay", "wind")]
    rows = [CalibrationRow(f"p{k}", p, engine.generate(f"p{k}", p).output_token_ids) for k, p in enumerate(prompts)]
    fit, held = split_held_out(rows)
    assert len(held) == 2 and len(fit) == 6 and not {r.id for r in fit} & {r.id for r in held}
    assert split_held_out(rows[::-1])[1] == held[::-1] or {r.id for r in split_held_out(rows[::-1])[1]} == {
        r.id for r in held}, "the same rows are held out whatever their order"

    work = tmp_path / "work"
    built = build_bank(engine, rows, prompts[:2], work, name="t", budget=8, max_new_tokens=16,
                       calibration={"source": "test"})
    bank = Bank.model_validate_json(built.bank.model_dump_json())  # it validates as a file would
    selection = bank.selection
    assert selection.by == "measured" and selection.held_out == 2
    assert bank.calibration["prompts"] == 6 and bank.calibration["held_out"] == 2
    measured = {c.name: c for c in selection.candidates}
    assert {"hydra", "t-n1"} <= set(measured), "Hydra's tree and plain decoding are always candidates"
    assert measured["t-n1"].measured_tau == 1.0 and measured["hydra"].nodes == 64
    for c in selection.candidates:
        if c.nodes is not None:  # a fixed tree: the replay's accepted lengths are decoding's, exactly
            assert c.replayed_tau == pytest.approx(c.measured_tau), c.name
    star = bank.policy.star
    assert star in {t.name for t in bank.trees} and star in measured
    fixed = [c.measured_tokens_per_s for c in selection.candidates if c.nodes is not None]
    assert measured[star].measured_tokens_per_s >= (1 - MEASURED_TOLERANCE) * max(fixed)
    assert f"star {star}" in selection.reason
    report = selection_report(bank)  # what build_bank and the bench print
    assert report.endswith(selection.reason) and all(f"  {c.name} " in report for c in selection.candidates)
    saved = json.loads((work / "measured.json").read_text())
    assert len(saved["rounds"]) == 2 and all(set(r) == set(measured) for r in saved["rounds"]), "side by side"

    stamp = (work / "measured.json").stat().st_mtime
    again = build_bank(engine, rows, prompts[:2], work, name="t", budget=8, max_new_tokens=16,
                       calibration={"source": "test"})
    assert (work / "measured.json").stat().st_mtime == stamp, "the measurements were reused"
    assert again.bank.selection == bank.selection and again.bank.policy == bank.policy
