"""The run manifest: settings compared field by field on --resume, heads and bank by content."""

from __future__ import annotations

import json

import pytest

from entmtp_ray.config import DecodingConfig, InputConfig, ModelConfig
from entmtp_ray.pipeline.manifest import MANIFEST, check_or_write, content_hash, differences, run_settings


def test_content_hash_reads_names_and_bytes(tmp_path):
    folder = tmp_path / "heads"
    folder.mkdir()
    (folder / "a.json").write_text("{}")
    (folder / "w.bin").write_bytes(b"\0" * 10)
    first = content_hash(folder)
    moved = tmp_path / "elsewhere"
    folder.rename(moved)
    assert content_hash(moved) == first  # where it lies is no part of it
    (moved / "w.bin").write_bytes(b"\0" * 9 + b"\1")
    assert content_hash(moved) != first
    (moved / "w.bin").write_bytes(b"\0" * 10)
    (moved / "w.bin").rename(moved / "v.bin")
    assert content_hash(moved) != first
    assert content_hash(moved / "a.json") != content_hash(moved)


def test_settings_differences_are_named_field_by_field():
    def settings(**decoding):
        return run_settings(ModelConfig(), DecodingConfig(**decoding), InputConfig(dataset="d.jsonl", limit=5),
                            needs_heads=False, bank_path=None)[0]

    base = settings()
    assert differences(base, settings()) == []
    changed = differences(base, settings(temperature=0.7, acceptance="exact"))
    assert changed == ["decoding.acceptance: 'greedy' -> 'exact'", "decoding.temperature: 0.0 -> 0.7"]
    limit = run_settings(ModelConfig(), DecodingConfig(), InputConfig(dataset="d.jsonl", limit=50), False, None)[0]
    assert differences(base, limit) == []  # --limit only adds or drops rows
    other = run_settings(ModelConfig(dtype="fp32"), DecodingConfig(), InputConfig(dataset="e.jsonl"), False, None)[0]
    assert differences(base, other) == ["input.dataset: 'd.jsonl' -> 'e.jsonl'", "model.dtype: 'auto' -> 'fp32'"]
    # an output of an older release lacks the settings added since: at their defaults they decode as before
    older = json.loads(json.dumps(base))
    del older["decoding"]["n"], older["decoding"]["stop"], older["decoding"]["top_k"]
    assert differences(older, base) == []
    assert differences(older, settings(n=2)) == ["decoding.n: None -> 2"]


def test_shipped_heads_and_bank_enter_by_content(tmp_path):
    from entmtp_ray.assets import shipped_bank, shipped_heads

    settings, sources = run_settings(ModelConfig(), DecodingConfig(policy="entmtp-tau", task="gsm8k"), None,
                                     needs_heads=True, bank_path=shipped_bank("smollm2-135m-instruct", "gsm8k"))
    assert settings["heads_sha256"] == content_hash(shipped_heads("smollm2-135m-instruct"))
    assert settings["bank_sha256"] == content_hash(shipped_bank("smollm2-135m-instruct", "gsm8k"))
    assert sources["bank"].endswith("gsm8k.json") and "input" not in settings
    other_bank = run_settings(ModelConfig(), DecodingConfig(policy="entmtp-tau", task="gsm8k"), None, True,
                              shipped_bank("smollm2-135m-instruct", "sharegpt"))[0]
    assert differences(settings, other_bank)[0].startswith("bank_sha256: ")


def test_a_fresh_output_gets_a_manifest_and_a_resume_must_match_it(tmp_path):
    out = tmp_path / "out"
    settings = {"decoding": {"policy": "ar", "seed": 1}, "heads_sha256": None}
    check_or_write(str(out), settings, resume=False, sources={"heads": None})
    written = json.loads((out / MANIFEST).read_text())
    assert written["settings"] == settings and written["format"] == 1 and written["created"]
    check_or_write(str(out), settings, resume=True)  # the same settings resume
    with pytest.raises(ValueError, match=r"decoding.seed: 1 -> 2.*new --output"):
        check_or_write(str(out), {**settings, "decoding": {"policy": "ar", "seed": 2}}, resume=True)
    assert json.loads((out / MANIFEST).read_text())["settings"] == settings  # a refused resume writes nothing
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    check_or_write(str(legacy), settings, resume=True)  # an output from before manifests gets one
    assert (legacy / MANIFEST).is_file()
