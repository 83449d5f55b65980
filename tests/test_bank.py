"""Bank files: JSON round trip and every check made on load."""

from __future__ import annotations

import json
import logging

import pytest
from pydantic import ValidationError

from entmtp_ray.bank import Bank, BankTree, Hardware, PolicyParams, load_bank, save_bank


def make_bank(**overrides) -> Bank:
    trees = [BankTree(name="n1", paths=[], nodes=1, tau=1.0, tokens_per_s=30.0),
             BankTree(name="n3", paths=[[0], [1]], nodes=3, tau_grown=1.6, tau=1.5, tokens_per_s=40.0),
             BankTree(name="n5", paths=[[0], [1], [0, 0], [0, 0, 0]], nodes=5, tau=2.0, tokens_per_s=42.0)]
    fields = dict(model="smollm2-135m-instruct", heads="heads/smollm2-135m-instruct", task="gsm8k",
                  hardware=Hardware(device="cpu", threads=2, dtype="float32", machine="x86_64"),
                  calibration={"source": "gsm8k train", "subset": "tune", "prompts": 100, "seed": 123},
                  created="2026-11-29", trees=trees,
                  policy=PolicyParams(initial=0.8, star="n3", ladder_trees=["n5", "n3", "n1"],
                                      ladder_thresholds=[0.5, 1.5], conservative="n3", aggressive="n5",
                                      tau_on=0.6, tau_off=1.2))
    fields.update(overrides)
    return Bank(**fields)


def test_bank_round_trips_through_json(tmp_path):
    bank = make_bank()
    save_bank(bank, tmp_path / "b.json")
    assert load_bank(tmp_path / "b.json", max_depth=4) == bank
    assert bank.tree("n5").nodes == 5


def test_unknown_version_and_deep_trees_name_the_fix(tmp_path):
    path = tmp_path / "b.json"
    raw = json.loads(make_bank().model_dump_json())
    path.write_text(json.dumps({**raw, "version": 99}))
    with pytest.raises(ValueError, match="format version 99 is not 1; rebuild it with jobs/build_bank.py"):
        load_bank(path)
    save_bank(make_bank(), path)
    with pytest.raises(ValueError, match="depth 3 but the heads draft at most 2"):
        load_bank(path, max_depth=2)
    with pytest.raises(FileNotFoundError, match="build one with jobs/build_bank.py"):
        load_bank(tmp_path / "missing.json")


def test_model_or_hardware_mismatch_warns_to_rebuild(tmp_path, caplog):
    path = tmp_path / "b.json"
    save_bank(make_bank(), path)
    with caplog.at_level(logging.WARNING):
        load_bank(path, model="vicuna-7b", hardware=Hardware(device="NVIDIA A100", threads=8, dtype="float16"))
    text = caplog.text
    assert "built for model smollm2-135m-instruct, not vicuna-7b" in text and "rebuild" in text
    assert "measured on cpu (2 threads, float32)" in text


def test_policy_must_use_trees_of_the_bank():
    with pytest.raises(ValidationError, match="policy uses tree 'n9'"):
        make_bank(policy=PolicyParams(star="n9", ladder_trees=["n1"], conservative="n1", aggressive="n3",
                                      tau_on=0.1, tau_off=0.2))
    with pytest.raises(ValidationError, match="tau_on"):
        PolicyParams(star="a", ladder_trees=["a"], conservative="a", aggressive="a", tau_on=1.0, tau_off=1.0)
