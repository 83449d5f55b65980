"""tools/mutate.py: mutant generation, and one real forked run on a throwaway package."""

from __future__ import annotations

import ast
import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def mutate():
    spec = importlib.util.spec_from_file_location("entmtp_mutate_tool", ROOT / "tools" / "mutate.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


SOURCE = '''\
"""Module docstring: a < b, 1 + 2, x and y."""
import os

LIMIT = 10


def f(xs: Annotated[list, 41], n: int = 3) -> Annotated[int, 42]:
    """Doc: x < 1 or y > 2."""
    label = "a < b + 1"
    msg = f"{n + 43} items"
    if n < len(xs) and xs:
        raise ValueError(f"bad {n + 44}", n - 45)
    assert n >= 0, n + 46
    y: Annotated[int, 47] = n * 2
    z = xs[:-1]
    w = n - 48  # pragma: no mutate
    for x in xs:
        if x is None or not x:
            break
    return y + z[0] + min(w, -n) + (n // 5) + (n % 6)
'''


def test_generated_mutants(mutate, tmp_path):
    path = tmp_path / "sample.py"
    path.write_text(SOURCE)
    mutants = mutate.generate_mutants(path, "pkg/sample.py")
    by_line = {}
    for m in mutants:
        by_line.setdefault(m.line, set()).add((m.operator, m.original, m.replacement))
    # expected mutants, one per site and alternative
    assert ("number", "10", "11") in by_line[4]
    assert {("cmp", "<", "<="), ("bool", "and", "or")} <= by_line[11]
    assert ("number", "3", "4") in by_line[7]  # a default argument
    assert {("cmp", ">=", ">"), ("number", "0", "1")} == by_line[13]  # not the message `n + 46`
    assert {("binop", "*", "/"), ("number", "2", "3")} == by_line[14]
    assert {("slice", "-1", "(-1) + 1"), ("slice", "-1", "(-1) - 1"), ("drop-neg", "-", ""),
            ("number", "1", "2"), ("number", "1", "0")} == by_line[15]
    assert {("cmp", "is", "is not"), ("bool", "or", "and"), ("drop-not", "not ", "")} == by_line[18]
    assert by_line[19] == {("stmt", "break", "continue")}
    assert {("binop", "+", "-"), ("index", "0", "1"), ("call", "min", "max"), ("drop-neg", "-", ""),
            ("binop", "//", "*"), ("binop", "%", "*")} <= by_line[20]
    # nothing in docstrings, strings, f-strings, raise arguments, annotations, imports or pragma lines
    assert not set(by_line) & {1, 2, 8, 9, 10, 12, 16}
    assert not any(m.original in {"41", "42", "43", "44", "45", "46", "47", "48"} for m in mutants)
    assert all(m.line != 7 or m.original == "3" for m in mutants)
    # ids are unique; each mutant compiles and changes exactly its own span
    src = path.read_bytes()
    assert len({m.id for m in mutants}) == len(mutants)
    for m in mutants:
        assert m.id.startswith(f"pkg/sample.py:{m.line}:")
        mutated = m.apply(src)
        compile(mutated, "sample.py", "exec", dont_inherit=True)
        assert mutated[:m.start] == src[:m.start] and mutated[m.start + len(m.replacement.encode()):] == src[m.end:]
        assert ast.dump(ast.parse(mutated)) != ast.dump(ast.parse(src))
        assert src[m.start:m.end].decode() == m.original


def test_comparison_chains_and_multiline_operators(mutate, tmp_path):
    path = tmp_path / "chain.py"
    path.write_text("ok = (0 <= a < b  # a < comment\n      not in c) or (d is not e)\n")
    reps = {(m.original, m.replacement) for m in mutate.generate_mutants(path, "chain.py")}
    assert {("<=", "<"), ("<", "<="), ("not in", "in"), ("is not", "is"), ("or", "and")} <= reps


TINY_MODULE = '''\
def clamp_add(a, b, hi):
    total = a + b
    if total > hi:
        return hi
    return total


def unused(x):
    return x * 2
'''

TINY_TEST = '''\
from tinypkg_mut.calc import clamp_add


def test_adds():
    assert clamp_add(1, 2, 10) == 3


def test_clamps():
    assert clamp_add(5, 6, 10) == 10
'''


def test_forked_run_kills_and_keeps_files(mutate, tmp_path):
    pytest.importorskip("coverage")  # not a project dependency: `.venv/bin/pip install coverage`
    (tmp_path / "tinypkg_mut").mkdir()
    (tmp_path / "tinypkg_mut" / "__init__.py").write_text("")
    target = tmp_path / "tinypkg_mut" / "calc.py"
    target.write_text(TINY_MODULE)
    (tmp_path / "tests_tiny").mkdir()
    (tmp_path / "tests_tiny" / "test_tiny_calc.py").write_text(TINY_TEST)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    before = target.read_bytes()
    logs = []
    kwargs = dict(modules=["tinypkg_mut/calc.py"], test_args=["tests_tiny"], out_dir="out",
                  pattern=r":(binop|cmp):", preload=(), log=logs.append)
    result = mutate.run(tmp_path, **kwargs)
    assert target.read_bytes() == before
    assert "tinypkg_mut" not in sys.modules  # the parent never imports the target
    recs = result["results"]["modules"]["tinypkg_mut/calc.py"]["mutants"]
    status = {mid.split(":", 1)[1]: r["status"] for mid, r in recs.items()}
    assert status == {"2:14:binop:-": "killed",        # a - b: caught, so the child ran the mutated code
                      "3:13:cmp:>=": "survived",       # equivalent: total == hi returns hi either way
                      "9:13:binop:/": "not covered"}   # no test calls unused()
    assert recs["tinypkg_mut/calc.py:2:14:binop:-"]["tests"] == 2
    assert result["ran"] == 3 and result["rate"] == pytest.approx(100 / 3)
    report = (tmp_path / "out" / "report.md").read_text()
    assert "| tinypkg_mut/calc.py | 4 | 1 | 0 | 1 | 1 | 0 | 1 | 33.3% |" in report
    assert "tinypkg_mut/calc.py:3  cmp  if total > hi: -> if total >= hi:" in report
    assert json.loads((tmp_path / "out" / "results.json").read_text())["modules"]["tinypkg_mut/calc.py"]["total"] == 4
    # a rerun on unchanged source runs nothing; --rerun-survivors re-tests the survivor (and the uncovered one)
    assert mutate.run(tmp_path, **kwargs)["ran"] == 0
    again = mutate.run(tmp_path, **kwargs, rerun=("survived", "not covered"))
    assert again["ran"] == 2 and target.read_bytes() == before


HANG_MODULE = '''\
SIZE = 4
assert SIZE == 4


def countdown(n):
    while n > 0:
        n -= 1
    return n
'''


def test_hangs_time_out_and_broken_imports_count_as_killed(mutate, tmp_path):
    pytest.importorskip("coverage")
    (tmp_path / "tinypkg_hang").mkdir()
    (tmp_path / "tinypkg_hang" / "__init__.py").write_text("")
    (tmp_path / "tinypkg_hang" / "hang.py").write_text(HANG_MODULE)
    (tmp_path / "tests_hang").mkdir()
    # a conftest importing the module: a mutant raising at import fails collection (pytest exit 4)
    (tmp_path / "tests_hang" / "conftest.py").write_text("from tinypkg_hang.hang import countdown  # noqa: F401\n")
    (tmp_path / "tests_hang" / "test_hang.py").write_text(
        "from tinypkg_hang.hang import countdown\n\n\ndef test_counts_down():\n    assert countdown(3) == 0\n")
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    result = mutate.run(tmp_path, modules=["tinypkg_hang/hang.py"], test_args=["tests_hang"], out_dir="out",
                        pattern=r":(augassign|cmp):", preload=(), log=print, slack_s=1.0)
    recs = result["results"]["modules"]["tinypkg_hang/hang.py"]["mutants"]
    status = {mid.split(":", 1)[1]: (r["status"], r["detail"]) for mid, r in recs.items()}
    assert status["2:12:cmp:!="] == ("killed", "pytest exit 4")       # the conftest's import raised
    assert status["6:12:cmp:>="][0] == "killed"                       # countdown(3) == -1
    assert status["7:10:augassign:+="][0] == "timeout"                 # n grows for ever: one test's deadline
    assert status["7:10:augassign:+="][1].startswith("a test ran over")
    assert recs["tinypkg_hang/hang.py:7:10:augassign:+="]["seconds"] < 15
    # --rerun-timeouts runs the timeout alone again
    again = mutate.run(tmp_path, modules=["tinypkg_hang/hang.py"], test_args=["tests_hang"], out_dir="out",
                       pattern=r":(augassign|cmp):", preload=(), log=print, slack_s=1.0, rerun=("timeout",))
    assert again["ran"] == 1
