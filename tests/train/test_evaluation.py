"""Measuring heads: eval-heads' report on the tiny local model, and the self-distillation data job."""

from __future__ import annotations

import pyarrow as pa
import pytest

from entmtp_ray.config import ModelConfig
from entmtp_ray.train.evaluation import eval_heads, format_report
from entmtp_ray.model.loading import load_model
from entmtp_ray.train.trainer import distill, distilled_ids, generated_conversations
from helpers.jobs import run_main


def test_eval_heads_report_pools_steps_per_task_and_temperature(tiny_model_dirs):
    model_dir, heads_dir = tiny_model_dirs
    cfg = ModelConfig(model=str(model_dir), heads=str(heads_dir), dtype="fp32", device="cpu")
    report = eval_heads(cfg, ["humaneval"], limit=3, tree="hydra", temperatures=[0.0, 0.7], max_new_tokens=12,
                        heldout=3)
    assert [(r["task"], r["temperature"], r["acceptance"]) for r in report["tau"]] == [
        ("humaneval", 0.0, "greedy"), ("humaneval", 0.7, "typical")]
    for r in report["tau"]:
        assert r["prompts"] == 3 and not r["errors"]
        assert r["steps"] > 0 and 1.0 <= r["tau"] <= 5.0
        position = r["accepted_per_position"]
        assert len(position) == 4 and all(a >= b for a, b in zip(position, position[1:]))
        # tau is 1 (the bonus token) plus the expected number of accepted drafts
        assert r["tau"] == pytest.approx(1 + sum(position))
    top1 = report["heldout"]["top1"]
    assert report["heldout"]["conversations"] == 3 and len(top1) == 4
    assert all(0.0 <= a <= 1.0 for a in top1)
    assert "humaneval" in format_report(report)


@pytest.mark.slow
def test_eval_heads_cli_refuses_unknown_task():
    from entmtp_ray.cli import main

    done = run_main(main, ["eval-heads", "--tasks", "mmlu"])
    assert done.returncode == 2 and "unknown task(s) ['mmlu']" in done.stderr


def test_distill_writes_replies_and_resumes(tiny_model_dirs, tmp_path):
    loaded = load_model(str(tiny_model_dirs[0]), dtype="fp32", device="cpu")
    prompts = pa.table({"id": ["a", "b", "c"], "prompt": ["Hi.", "Name a colour.", "Count to three."]})
    assert distill(loaded, prompts, tmp_path, batch_size=2, max_new_tokens=5, progress=False, task="gsm8k") == 3
    assert distill(loaded, prompts, tmp_path, batch_size=2, max_new_tokens=5, progress=False) == 0  # resumed
    assert distilled_ids([str(tmp_path)]) == {"gsm8k": {"a", "b", "c"}}  # what heads trained on them list
    chats = list(generated_conversations([str(tmp_path)]))
    assert sorted(c[0]["content"] for c in chats) == ["Count to three.", "Hi.", "Name a colour."]
    assert all(c[1]["role"] == "assistant" for c in chats)
    # every reply is what greedy generation at batch size 1 gives (left padding changes nothing)
    import torch

    row = next(c for c in chats if c[0]["content"] == "Hi.")
    ids = loaded.encode_prompt("Hi.")
    out = loaded.model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=5)[0, len(ids):].tolist()
    cut = next((k for k, t in enumerate(out) if t in loaded.eos_token_ids), len(out))
    assert row[1]["content"] == loaded.tokenizer.decode(out[:cut], skip_special_tokens=True)
