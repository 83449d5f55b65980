"""Acceptance tables: the ranks measured along a rollout predict what decoding accepts."""

from __future__ import annotations

import pytest
import torch

from entmtp_ray.calibration import NOT_RANKED, rank_rows
from entmtp_ray.config import DecodingConfig, ModelConfig
from entmtp_ray.engine import Engine
from entmtp_ray.growth import AcceptanceTable
from entmtp_ray.tree import load_topology


def true_path_ranks(engine, seq, t, depth):
    """Reference for one step: commit seq[:t+1] through the drafter's own incremental API, then rank
    each true token under the head that drafts it, grounded on the true tokens before it."""
    drafter, model = engine.decoder.drafter, engine.loaded.model
    ids = torch.tensor(seq)
    cache = engine.decoder._cache_for(len(seq))
    from entmtp_ray.llama import forward_hidden

    hidden = forward_hidden(model, cache, ids[: t + 1], torch.arange(t + 1))
    drafter.begin(hidden, torch.arange(t + 1), len(seq))
    ranks = []
    for k in range(depth):
        if t + 2 + k >= len(seq):
            ranks.append(NOT_RANKED)  # past the rollout's end: nothing to accept
            break
        row = torch.cat([drafter.context] + [drafter.embed(ids[t + 1 + j]) for j in range(k + 1)])
        logits = drafter.heads.project(k, drafter.heads.head_hidden(k, row).to(drafter.lm_head.weight.dtype),
                                       drafter.lm_head)
        ranks.append(int((logits > logits[ids[t + 2 + k]]).sum()))
    return ranks


def test_rank_rows_match_the_drafters_own_step_by_step_view(tiny_model_dirs):
    model_dir, heads_dir = tiny_model_dirs
    engine = Engine(ModelConfig(model=str(model_dir), heads=str(heads_dir), dtype="fp32", device="cpu"),
                    DecodingConfig(policy="hydra", max_new_tokens=12))
    result = engine.generate("r", "Tell me about rivers.")
    seq = result.prompt_token_ids + result.output_token_ids
    first = len(result.prompt_token_ids)
    big = [10**9] * 4
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
    engine = Engine(ModelConfig(dtype="fp32", device="cpu"),
                    DecodingConfig(policy="fixed", tree=tree, max_new_tokens=96))
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
