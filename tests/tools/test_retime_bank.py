"""tools/retime_bank.py: a bank re-timed on this machine keeps each tree's tau, takes tokens/s = tau / the step
measured here, and picks its star again from those (the tiny random Llama with 4 heads, fp32)."""

from __future__ import annotations

import json

import retime_bank  # tools/retime_bank.py (pytest puts tools/ on the path)
from entmtp_ray.calibrate.bank import load_bank, save_bank
from helpers.banks import make_bank


def test_a_retimed_bank_keeps_its_taus_and_chooses_its_star_from_costs_measured_here(tiny_model_dirs, tmp_path):
    model_dir, heads_dir = tiny_model_dirs
    bank = make_bank()
    save_bank(bank, tmp_path / "old.json")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"count to {k}"}) + "\n" for k in range(2)))
    assert retime_bank.main(["--bank", str(tmp_path / "old.json"), "--out", str(tmp_path / "new.json"),
                             "--model", str(model_dir), "--heads", str(heads_dir), "--threads", "1",
                             "--prompts-file", str(prompts), "--prompts", "2", "--new-tokens", "6"]) == 0
    new = load_bank(tmp_path / "new.json")
    assert [t.tau for t in new.trees] == [t.tau for t in bank.trees]
    assert all(t.tokens_per_s != o.tokens_per_s and t.tokens_per_s > 0 for t, o in zip(new.trees, bank.trees))
    fastest = max(t.tokens_per_s for t in new.trees)
    star = new.tree(new.policy.star)
    assert star.tokens_per_s >= 0.99 * fastest  # the smallest within the measured tolerance of the fastest
    assert all(t.nodes >= star.nodes for t in new.trees if t.tokens_per_s >= 0.99 * fastest)
    # the switching pair was replayed on the old costs: every signal's entmtp-tau now runs the star
    assert all(p.conservative == p.aggressive == star.name for p in new.policy.signals.values())
    assert new.selection.by == "replay" and "re-timed" in new.selection.reason
    assert new.hardware.threads == 1 and new.hardware.dtype == "float32"
