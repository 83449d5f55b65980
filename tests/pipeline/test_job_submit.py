"""`ray job submit` against a real local head, running the embedded model end to end."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pyarrow.dataset as pads
import pytest

from helpers import raytools

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def test_ray_job_submit_humaneval(tmp_path):
    # RAY_AUTH_MODE=disabled: an earlier local ray.init leaves ~/.ray/auth_token, which would turn on
    # token auth for this head and refuse clients that are not handed the token.
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    output = tmp_path / "out"
    # a head of its own (own --temp-dir); on leaving, exactly its processes are stopped, the
    # job's driver (a child of its JobSupervisor actor) included
    with raytools.ray_head("--dashboard-host=127.0.0.1", "--num-cpus=4", env=env, prefix="rjs-") as head:
        submit = subprocess.run(
            [str(raytools.BIN / "ray"), "job", "submit", f"--address=http://127.0.0.1:{head.dashboard_port}",
             "--working-dir", str(ROOT), "--",
             "python", "jobs/generate.py", "--task", "humaneval", "--limit", "2",
             "--max-new-tokens", "8", "--address", "auto", "--output", str(output)],
            capture_output=True, text=True, env=head.env, timeout=900, cwd=ROOT)
        assert submit.returncode == 0, (submit.stdout + submit.stderr)[-4000:]
        assert "succeeded" in submit.stdout
        summary = next(json.loads(line) for line in reversed(submit.stdout.splitlines()) if line.startswith('{"rows"'))
        assert summary["rows"] == 2 and summary["errors"] == 0 and summary["duplicates"] == 0
        # the adapting default says where its step costs came from, and the tree mix the rows ran
        actor, = summary["startup"]["actors"]
        assert actor["step_costs"].startswith("step costs ") and " ms" in actor["step_costs"]
        assert sum(summary["tree_usage"].values()) >= 2 and all(t.startswith("humaneval-") for t in summary["tree_usage"])
    rows = pads.dataset(str(output), format="parquet").to_table().to_pylist()
    assert len(rows) == 2 and len({r["id"] for r in rows}) == 2
    assert all(r["id"].startswith("HumanEval/") and r["error"] is None and r["num_output_tokens"] > 0 for r in rows)
    assert all(r["model"] == "smollm2-135m-instruct" and r["canonical_solution"] for r in rows)
