"""The production code path (a local model directory, per-head vocab projections, Vicuna chat
format) on a tiny random Llama: the same Engine that serves the embedded model."""

from __future__ import annotations

import pytest
import torch

from entmtp_ray.decode.tree import load_topology
from entmtp_ray.config import DecodingConfig, ModelConfig
from helpers.engines import make_engine
from entmtp_ray.model.loading import VICUNA_SYSTEM, load_model
from helpers.checkpoints import make_sentencepiece_vicuna


@pytest.fixture(scope="module")
def local_dirs(tiny_model_dirs):
    return tiny_model_dirs


def test_vicuna_named_directory_uses_vicuna_template(local_dirs):
    loaded = load_model(str(local_dirs[0]), dtype="fp32", device="cpu")
    assert loaded.chat_format == "vicuna_v1.1"
    text = loaded.tokenizer.decode(loaded.encode_prompt("Hello there"))
    assert VICUNA_SYSTEM in text and text.rstrip().endswith("USER: Hello there ASSISTANT:")


@pytest.mark.parametrize("policy", ["ar", "hydra", "medusa"])
def test_local_model_and_heads_greedy_equals_generate(local_dirs, policy):
    model_dir, heads_dir = local_dirs
    decoding = DecodingConfig(policy=policy, max_new_tokens=40)
    engine = make_engine(ModelConfig(model=str(model_dir), heads=str(heads_dir), dtype="fp32", device="cpu"), decoding)
    ids = engine.encode("Write a poem.")
    want = engine.loaded.model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=40)[0, len(ids):]
    row = engine.run("r1", "Write a poem.")
    assert row["error"] is None
    assert row["output_token_ids"] == want.tolist()
    assert row["heads"] == str(heads_dir) if policy != "ar" else row["heads"] is None


def test_tree_deeper_than_heads_is_refused(local_dirs):
    model_dir, heads_dir = local_dirs
    with pytest.raises(ValueError, match=r"depth 5 but the heads draft at most 4"):
        make_engine(ModelConfig(model=str(model_dir), heads=str(heads_dir)),
                    DecodingConfig(policy="fixed", tree="chain5"))


def test_typical_sampling_reproduces_per_row_seed(local_dirs):
    model_dir, heads_dir = local_dirs
    model_cfg = ModelConfig(model=str(model_dir), heads=str(heads_dir), dtype="fp32", device="cpu")
    decoding = DecodingConfig(policy="hydra", acceptance="typical", temperature=0.7, max_new_tokens=30, seed=5)
    engine = make_engine(model_cfg, decoding)
    first = engine.run("row-a", "Tell me a story.")["output_token_ids"]
    assert engine.run("row-a", "Tell me a story.")["output_token_ids"] == first
    others = {tuple(engine.run(f"row-{k}", "Tell me a story.")["output_token_ids"]) for k in range(4)}
    assert len(others) > 1, "different row ids should draw different samples"


def test_trace_signal_records_the_running_entropy_before_each_step(local_dirs):
    """--trace-signal: a fixed tree records the entropy EMA (beta 0.9, from 0) the step was chosen
    under; the per-step accepted lengths sum to the output after the prefill's token; without the
    flag a fixed tree records no signal (and computes no verifier statistic)."""
    from entmtp_ray.decode.verify import verifier_stats

    model_dir, heads_dir = local_dirs
    model_cfg = ModelConfig(model=str(model_dir), heads=str(heads_dir), dtype="fp32", device="cpu")
    traced = make_engine(model_cfg, DecodingConfig(policy="hydra", max_new_tokens=30, trace_signal=True))
    row = traced.run("r1", "Write a poem.")
    lengths, signals = row["step_accepted_lengths"], row["step_signals"]
    assert len(lengths) == len(signals) == row["steps"] and sum(lengths) == row["num_output_tokens"] - 1
    assert row["verified_nodes"] == row["steps"] * load_topology("hydra").num_nodes
    # recompute the EMA from a teacher-forced pass: entropy at each position after the prompt
    ids = traced.encode("Write a poem.")
    out = row["output_token_ids"]
    with torch.inference_mode():
        logits = traced.loaded.model(torch.tensor([ids + out])).logits[0, len(ids):]  # [tokens, V]
    entropy = verifier_stats(logits)[0]  # entropy[i]: after output token i
    want, s, seen = [], 0.0, 0
    for n in lengths:
        want.append(s)
        for h in entropy[seen: seen + n]:
            s = 0.9 * s + 0.1 * h
        seen += n
    assert signals == pytest.approx(want, abs=1e-4)
    plain = make_engine(model_cfg, DecodingConfig(policy="hydra", max_new_tokens=30)).run("r1", "Write a poem.")
    assert plain["step_signals"] is None and plain["output_token_ids"] == out


def test_a_sentencepiece_only_tokenizer_loads_as_vicunas_does(tmp_path):
    """lmsys/vicuna-7b-v1.3 has only tokenizer.model: without sentencepiece, transformers 5 fell back to
    tiktoken and raised ValueError, which failed every actor's constructor."""
    model_dir = make_sentencepiece_vicuna(tmp_path)
    assert sorted(p.name for p in model_dir.iterdir() if "token" in p.name) == ["tokenizer.model",
                                                                               "tokenizer_config.json"]
    loaded = load_model(str(model_dir), dtype="fp32", device="cpu")
    assert loaded.chat_format == "vicuna_v1.1" and loaded.eos_token_ids == frozenset({2})
    ids = loaded.encode_prompt("What is 2+3?")
    assert ids[0] == 1 and loaded.tokenizer.decode(ids, skip_special_tokens=True).rstrip().endswith(
        "USER: What is 2+3? ASSISTANT:")
    engine = make_engine(ModelConfig(model=str(model_dir), dtype="fp32", device="cpu"),
                    DecodingConfig(policy="ar", max_new_tokens=8))
    row = engine.run("r", "What is 2+3?")
    assert row["error"] is None and row["num_output_tokens"] > 0
