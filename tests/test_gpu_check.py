"""jobs/gpu_check.py on the CPU: every stage's plumbing on scaled-down shapes, inside the budget, each stage's file
written as it finishes. The CUDA graphs, sync counts and the figures themselves come only from a GPU run
(docs/measurements.md, "The first GPU run")."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SIZES = ["1", "2", "4", "8", "16", "32", "64"]  # JSON keys of the tree ladder


def run_check(out: Path, *extra: str, timeout: float = 400) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    done = subprocess.run([sys.executable, "jobs/gpu_check.py", "--device", "cpu", "--output", str(out), *extra],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    return done, time.monotonic() - started


@pytest.mark.slow
def test_every_stage_runs_on_cpu_within_the_budget_and_reports_its_figures(tmp_path):
    done, seconds = run_check(tmp_path, "--budget-s", "290", "--prompts", "1")
    log = (tmp_path / "log.txt").read_text() if (tmp_path / "log.txt").is_file() else ""
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:] + log[-4000:]
    assert seconds < 300  # the 5 minutes here, the script's own start included
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary == json.loads((tmp_path / "summary.json").read_text()) and summary["ok"]
    # a device call brings back at most 8 files
    assert sorted(p.name for p in tmp_path.iterdir()) == ["decode.json", "log.txt", "parting.json", "peer.json",
                                                          "quantized.json", "shapes.json", "summary.json"]
    stages = summary["stages"]
    assert list(stages) == ["shapes", "peer", "decode", "quantized", "parting"]
    assert all(s["status"] == 0 and s["seconds"] <= s["limit_s"] for s in stages.values())

    shapes = stages["shapes"]["result"]
    assert shapes["scaled_down"] and shapes["model"]["shape"]["hidden_size"] == 256
    assert shapes["model"]["heads"]["shared_lm_head"] is False  # Hydra++'s layout: a vocabulary projection per head
    assert set(shapes["paths"]) == {"dynamic", "static"}  # no graphs without CUDA
    for path in shapes["paths"].values():
        assert list(path["verify_ms"]) == SIZES and all(ms > 0 for ms in path["verify_ms"].values())
        assert list(path["draft_ms"]) == SIZES and path["ar_ms_per_token"] > 0
        assert set(path["sdpa"]) == {"1-node", "64-node"} and all(path["sdpa"].values())  # SDPA operators run
    assert set(shapes["greedy_vs_dynamic_ar"].values()) == {"equal"}  # fp32: bit for bit
    assert shapes["static_capacity"] < shapes["model"]["shape"]["max_position_embeddings"]  # sized from the job
    assert list(shapes["lanes"]["ms_per_step"]) == ["1", "2", "4"]

    peer = stages["peer"]["result"]
    assert peer["floor"]["copy_gb_per_s"] > 0 and peer["floor"]["one_token_floor_ms"] > 0
    assert {"entmtp-ray ar (dynamic)", "transformers generate (default cache)",
            "transformers generate (static cache)"} <= set(peer["rows"])
    assert all(row["floor_share"] > 0 for row in peer["rows"].values())

    decode = stages["decode"]["result"]
    assert set(decode["policies"]) == {"ar", "hydra", "entmtp-tau"}
    for policy in decode["policies"].values():
        assert set(policy) == {"dynamic", "static"}
        assert all(mode["greedy_vs_ar"] == ["equal"] and mode["tokens_per_s"] > 0 for mode in policy.values())

    parting = stages["parting"]["result"]["dtypes"]["float32"]  # Hydra's tree, 4 positions x its chain of 5
    assert parting["rows"] == 20 and parting["rows_bitwise"] + parting["rows_parted_on_equal_inputs"] <= 20
    assert parting["first"] is None or parting["first"]["parting"]["inputs_equal"]

    quantized = stages["quantized"]["result"]
    assert set(quantized["schemes"]) == {"none", "int8", "int4"}
    assert all(list(s["verify_ms"]) == ["1", "16", "64"] and s["probe_ms"] > 0 and s["job_refuses"] is None
               for s in quantized["schemes"].values())


@pytest.mark.slow
def test_a_stage_stopped_by_the_budget_keeps_what_it_measured_and_the_summary_is_written(tmp_path):
    done, seconds = run_check(tmp_path, "--budget-s", "25", "--stages", "shapes", timeout=120)
    assert seconds < 40
    summary = json.loads((tmp_path / "summary.json").read_text())
    shapes = summary["stages"]["shapes"]
    assert shapes["limit_s"] <= 20
    assert shapes["result"]["model"]["shape"]["hidden_size"] == 256  # written before the stage ran out
    if shapes["status"] == 0:  # it stopped itself in time: what it left out says so
        assert "skipped" in json.dumps(shapes["result"])


def test_without_pydantic_or_carried_wheels_the_check_says_how_to_get_them(tmp_path, monkeypatch):
    from entmtp_ray.jobs import gpu_check

    monkeypatch.setattr(gpu_check.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(gpu_check, "WHEELS", tmp_path)
    with pytest.raises(SystemExit, match="make gpu-wheels"):
        gpu_check.ensure_pydantic({})
