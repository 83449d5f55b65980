"""Installable anywhere: the built wheel, installed into an empty folder, generates from a directory
outside the checkout with the heads and bank it ships, and its one console script starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, dict]:
    """(site folder, environment) of the wheel built from this checkout and installed with --target."""
    tmp = tmp_path_factory.mktemp("install")
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(tmp / "dist"), str(ROOT)], capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-3000:]
    wheel = next((tmp / "dist").glob("entmtp_ray-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "entmtp_ray/assets/heads/smollm2-135m-instruct/heads.safetensors" in names
    assert "entmtp_ray/assets/banks/smollm2-135m-instruct/gsm8k.json" in names
    site = tmp / "site"
    install = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site),
                              str(wheel)], capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stderr[-3000:]
    # the installed copy first; the checkout is not on the path (cwd is elsewhere)
    env = {**os.environ, "PYTHONPATH": str(site), "PYTHONSAFEPATH": "1"}
    return site, env


def test_the_installed_wheel_generates_outside_the_checkout_with_its_shipped_heads_and_bank(installed, tmp_path):
    site, env = installed
    where = subprocess.run([sys.executable, "-c", "import entmtp_ray; print(entmtp_ray.__file__)"], cwd=tmp_path,
                           env=env, capture_output=True, text=True, timeout=120)
    assert where.stdout.strip().startswith(str(site)), where.stdout + where.stderr
    out = subprocess.run([sys.executable, "-m", "entmtp_ray", "generate", "--prompt", "Add 2 and 3.",
                          "--policy", "entmtp-tau", "--task", "gsm8k", "--max-new-tokens", "12", "--threads", "1"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    row = json.loads(out.stdout.strip().splitlines()[-1])
    assert row["error"] is None and row["num_output_tokens"] > 0
    assert row["heads"].startswith(str(site)) and row["bank"].startswith(str(site))


def test_one_console_script_is_installed_and_runs_the_commands_a_user_runs(installed, tmp_path):
    """`entmtp` alone (no developer tool is a console script): its help lists the commands, and a command's own
    help comes from that command's module, from the installed copy."""
    site, env = installed
    assert sorted(p.name for p in (site / "bin").iterdir()) == ["entmtp"]
    listed = subprocess.run([str(site / "bin" / "entmtp"), "--help"], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=120)
    assert listed.returncode == 0, listed.stderr[-2000:]
    assert all(name in listed.stdout for name in ("batch", "generate", "show", "report", "bench", "build-bank",
                                                  "train-heads", "signal-power"))
    batch = subprocess.run([str(site / "bin" / "entmtp"), "batch", "--help"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=900)
    assert batch.returncode == 0 and batch.stdout.startswith("usage: entmtp batch"), batch.stderr[-2000:]
