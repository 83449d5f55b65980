"""tools/first_parting.py: the tool that finds where a tree's verify first rounds unlike the one-token steps. A
difference planted at a known operation of the tree's forward is reported there, an inherited one is told from a
new one, and the job prints its table and JSON line. The tiny random Llama (fp32)."""

from __future__ import annotations

import json

import pytest
import torch

from entmtp_ray.decode.tree import load_topology
import first_parting  # tools/first_parting.py (pytest puts tools/ on the path)
from first_parting import OPERATIONS, chain_nodes, find_partings, first_difference, tree_tokens
from entmtp_ray.model.kv_cache import KVCache
from helpers.readbacks import PROMPT  # tiny: conftest.py

HYDRA = load_topology("hydra")


def test_the_first_difference_is_the_first_in_the_forwards_order():
    reference = {(-1, "embed"): torch.zeros(2), (2, "final_norm"): torch.zeros(2), (2, "lm_head"): torch.zeros(3)}
    for layer in range(2):
        reference |= {(layer, op): torch.zeros(2) for op in OPERATIONS}
    tree = {key: value.clone() for key, value in reference.items()}
    assert first_difference(reference, tree) is None
    tree[1, "down"][0] = 1.0
    tree[2, "lm_head"][1] = 1.0
    assert first_difference(reference, tree)[:2] == (1, "down")
    tree[1, "attention"][1] = -0.5
    layer, op, a, b = first_difference(reference, tree)
    assert (layer, op) == (1, "attention") and float(b[1] - a[1]) == -0.5
    tree[0, "output"][0] = 2.0
    assert first_difference(reference, tree)[:2] == (0, "output")
    assert first_difference(reference | {(2, "lm_head"): torch.ones(3)}, reference)[:2] == (2, "lm_head")


def test_the_chain_carries_the_greedy_tokens_and_no_other_node_is_a_greedy_successor():
    chain = chain_nodes(HYDRA)
    assert [HYDRA.paths[n - 1] for n in chain[1:]] == [(0,) * d for d in range(1, HYDRA.depth + 1)]
    greedy = [11, 22, 33, 44, 55]
    tokens = tree_tokens(HYDRA, chain, greedy, vocab=97).tolist()
    assert [tokens[n] for n in chain] == greedy
    for node, path in enumerate(HYDRA.paths, start=1):
        if node not in chain:
            assert tokens[node] != greedy[len(path)]


def _checks(tiny, steps=3):
    loaded, _ = tiny
    return find_partings(loaded, PROMPT, HYDRA, steps)


def test_a_difference_planted_in_the_trees_embedding_is_found_there(tiny):
    embed = tiny[0].model.model.embed_tokens

    def plant(module, inputs, out):
        return out + 0.5 if inputs[0].numel() == HYDRA.num_nodes else out  # the tree's forward only

    handle = embed.register_forward_hook(plant)
    try:
        checks = _checks(tiny)
    finally:
        handle.remove()
    assert len(checks) == 3 * len(chain_nodes(HYDRA))
    hidden = tiny[0].model.config.hidden_size
    for check in checks:
        assert (check.parting.layer, check.parting.op) == (-1, "embed")
        assert check.parting.differing == hidden and check.parting.max_abs == pytest.approx(0.5)
        assert check.parting.inputs_equal  # nothing before the embedding
        assert check.kv_parting == 0 and not check.logits_equal


def test_k_planted_at_layer_0_parts_every_row_there_and_a_deeper_rows_attention_inherits_it(tiny, monkeypatch):
    write = KVCache.write

    def plant(self, layer, k, v):
        if layer == 0 and k.shape[1] == HYDRA.num_nodes:
            k = k + 0.25
        return write(self, layer, k, v)

    monkeypatch.setattr(KVCache, "write", plant)
    checks = _checks(tiny)
    attention = OPERATIONS.index("attention")
    for check in checks:
        assert check.kv_parting == 0
        parting = check.parting
        assert parting.layer == 0 and OPERATIONS.index(parting.op) <= attention  # at the latest where k is read
        # the root reads no ancestor's k; a deeper row's attention reads its ancestors' planted ones
        assert parting.inputs_equal == (check.depth == 0 or parting.op != "attention")


def test_the_job_prints_its_table_and_one_json_line(tiny_model_dirs, capsys, tmp_path):
    model_dir, _ = tiny_model_dirs
    output = tmp_path / "parting.json"
    assert first_parting.main(["--model", str(model_dir), "--dtype", "fp32", "--prompt", "Name three colours.",
                               "--steps", "2", "--tree", "hydra", "--output", str(output)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[1].startswith("| operation | rows parted there first |")
    summary = json.loads(lines[-1])
    assert summary["rows"] == 2 * len(chain_nodes(HYDRA)) and summary["dtype"] == "float32"
    assert summary["rows_bitwise"] + sum(1 for c in json.loads(output.read_text())["checks"] if c["parting"]) == \
        summary["rows"]


def test_the_job_refuses_a_tree_that_drafts_nothing(tiny_model_dirs, capsys):
    model_dir, _ = tiny_model_dirs
    assert first_parting.main(["--model", str(model_dir), "--prompt", "hi", "--tree", "ar"]) == 2
    assert "pick a tree that drafts" in capsys.readouterr().err


def test_the_native_steps_rows_are_compared_by_their_kept_kv_and_logits(tiny):
    from entmtp_ray.model import step
    from entmtp_ray.model.kernels import prepare

    loaded = tiny[0]
    if step.for_model(loaded.model, prepare(loaded.model)) is None:
        pytest.skip("the native step cannot serve here (no C++ compiler)")
    checks = find_partings(loaded, PROMPT, HYDRA, 3, operations=False)
    assert len(checks) == 3 * len(chain_nodes(HYDRA))
    assert all(c.parting is None and c.kv_parting is None and c.logits_equal for c in checks)
    embed = loaded.model.model.embed_tokens  # the embedding stays in Python: plant there, the tree's forward only
    handle = embed.register_forward_hook(lambda m, i, out: out + 0.5 if i[0].numel() == HYDRA.num_nodes else out)
    try:
        planted = find_partings(loaded, PROMPT, HYDRA, 3, operations=False)
    finally:
        handle.remove()
    assert all(c.kv_parting == 0 and not c.logits_equal for c in planted)
