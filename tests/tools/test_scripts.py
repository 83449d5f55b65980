"""Every developer tool runs as the script the docs show (`python tools/X.py ...`), not only as `main()` from a test."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(p for p in (ROOT / "tools").glob("*.py") if "def main(" in p.read_text())


@pytest.mark.slow  # each imports torch in a process of its own
def test_every_tool_with_a_main_runs_as_a_script_and_answers_help():
    running = {p.name: subprocess.Popen([sys.executable, str(p), "--help"], cwd=ROOT, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True) for p in SCRIPTS}
    answers = {name: (proc.wait(timeout=300), proc.stdout.read()) for name, proc in running.items()}
    assert {"bench_engine.py", "first_parting.py", "bench_products.py"} <= set(answers)
    silent = {name: out[-300:] for name, (code, out) in answers.items() if code != 0 or "usage" not in out.lower()}
    assert not silent, silent
