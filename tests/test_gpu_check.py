"""jobs/gpu_check.py's plumbing on the CPU: the decode stage (its only in-process stage) with the dynamic and
static verify, the child process and the JSON summary. The CUDA graphs, sync counts and the GPU stages run only
where a GPU is (docs/design.md §8)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_the_decode_stage_runs_and_reports_every_policy_and_mode(tmp_path):
    done = subprocess.run([sys.executable, "jobs/gpu_check.py", "--device", "cpu", "--stages", "decode",
                           "--prompts", "1", "--max-new-tokens", "8", "--output", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + (tmp_path / "decode.log").read_text()[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary == json.loads((tmp_path / "summary.json").read_text()) and summary["ok"]
    decode = summary["stages"]["decode"]["result"]
    assert set(decode["policies"]) == {"ar", "hydra", "entmtp-tau"}
    for policy in decode["policies"].values():
        assert set(policy) == {"dynamic", "static"}  # no graphs without CUDA
        for mode in policy.values():
            assert mode["greedy_vs_ar"] == ["equal"] and mode["tokens_per_s"] > 0
    assert decode["policies"]["hydra"]["static"]["x_ar"] > 0
