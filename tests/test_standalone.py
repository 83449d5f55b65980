"""The repository stands alone: a copy of its tracked files, with nothing beside it, runs the demo's job on
the embedded model with its own package, heads and bank. (Our machines keep a data folder beside the checkout; a
user's clone has none, so nothing may read one: the rest of the suite runs under helpers/alone.py's guard, which
refuses every read beside the checkout in the test process.)"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.dataset as pads
import pytest

from helpers import raytools

ROOT = Path(__file__).resolve().parent.parent  # tests/ is at the top

pytestmark = pytest.mark.slow


def copy_of_the_repository(target: Path) -> Path:
    """The files git tracks (what a clone has), copied to `target`."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in filter(None, files.decode().split("\0")):
        if (ROOT / name).is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, target / name)
    return target


def test_a_copy_with_nothing_beside_it_runs_the_demo_job(tmp_path):
    alone = tmp_path / "alone"
    repo = copy_of_the_repository(alone / "entmtp-ray")
    assert sorted(p.name for p in alone.iterdir()) == ["entmtp-ray"]
    with raytools.own_ray_dir() as ray_dir:
        # the copy's own package, in the driver and in every Ray worker it starts
        env = raytools.ray_env(ray_dir, PYTHONPATH=str(repo))
        demo = subprocess.run(  # `make demo`'s job, on fewer rows and tokens
            [sys.executable, "jobs/generate.py", "--task", "humaneval", "--limit", "2", "--max-new-tokens", "16",
             "--max-actors", "2", "--output", "runs/demo-humaneval"],
            cwd=repo, env=env, capture_output=True, text=True, timeout=600)
        assert demo.returncode == 0, demo.stderr[-3000:]
    summary = json.loads(demo.stdout.strip().splitlines()[-1])
    assert summary["rows"] == 2 and summary["errors"] == 0
    rows = pads.dataset(str(repo / "runs" / "demo-humaneval"), format="parquet").to_table().to_pylist()
    assert all(r["heads"].startswith(str(repo)) for r in rows), "the copy must use its own shipped heads"
    shown = subprocess.run([sys.executable, "jobs/show.py", "runs/demo-humaneval"], cwd=repo, env=env,
                           capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0 and "HumanEval/" in shown.stdout, shown.stderr[-2000:]
