"""`ray job submit` against a real local head, running the embedded model end to end."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pyarrow.dataset as pads
import pytest

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ray_job_submit_humaneval(tmp_path):
    port, dashboard = free_port(), free_port()
    temp_dir = tempfile.mkdtemp(prefix="rjs-", dir="/tmp")  # Ray's socket paths must stay short
    # RAY_AUTH_MODE=disabled: an earlier local ray.init leaves ~/.ray/auth_token, which would turn on
    # token auth for this head and refuse clients that are not handed the token.
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    ray = str(BIN / "ray")
    start = subprocess.run([ray, "start", "--head", f"--port={port}", f"--dashboard-port={dashboard}",
                            "--dashboard-host=127.0.0.1", "--num-cpus=4", f"--temp-dir={temp_dir}",
                            "--disable-usage-stats"], capture_output=True, text=True, env=env, timeout=120)
    assert start.returncode == 0, start.stderr[-3000:]
    output = tmp_path / "out"
    try:
        submit = subprocess.run(
            [ray, "job", "submit", f"--address=http://127.0.0.1:{dashboard}", "--working-dir", str(ROOT), "--",
             "python", "jobs/generate.py", "--task", "humaneval", "--limit", "4",
             "--max-new-tokens", "16", "--address", "auto", "--output", str(output)],
            capture_output=True, text=True, env=env, timeout=900, cwd=ROOT)
        assert submit.returncode == 0, (submit.stdout + submit.stderr)[-4000:]
        assert "succeeded" in submit.stdout
        summary = next(json.loads(line) for line in reversed(submit.stdout.splitlines()) if line.startswith('{"rows"'))
        assert summary["rows"] == 4 and summary["errors"] == 0 and summary["duplicates"] == 0
    finally:
        subprocess.run([ray, "stop", "--force"], capture_output=True, env=env, timeout=120)
    rows = pads.dataset(str(output), format="parquet").to_table().to_pylist()
    assert len(rows) == 4 and len({r["id"] for r in rows}) == 4
    assert all(r["id"].startswith("HumanEval/") and r["error"] is None and r["num_output_tokens"] > 0 for r in rows)
    assert all(r["model"] == "smollm2-135m-instruct" and r["canonical_solution"] for r in rows)
