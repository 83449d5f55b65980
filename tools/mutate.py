"""Mutation testing of the algorithm modules, our own runner (no mutmut).

Owns: generating small AST-located mutants (each one textual replacement of one node's source
segment; the rest of the file stays byte-identical); picking the tests that cover each mutant's
statement (one coverage run with a context per test, which is also the baseline check); running
each mutant in a forked child that imports the mutated module from memory (a sys.meta_path hook,
files on disk are never written); the results cache (runs/mutation/results.json, keyed by mutant
id and module source hash) and the report (runs/mutation/report.md).

    .venv/bin/python tools/mutate.py [-j 2] [--module entmtp_ray/decode/tree.py ...] [--list]

Tests that run the module in another process (subprocess CLIs, Ray workers) never see a mutant.
"""

from __future__ import annotations

import argparse, ast, bisect, contextlib, hashlib, importlib, importlib.abc, importlib.util, json, os, re, shlex
import signal, sys, time, traceback
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODULES = ["entmtp_ray/decode/acceptance.py", "entmtp_ray/decode/tree.py",
                   "entmtp_ray/model/kv_cache.py", "entmtp_ray/decode/drafting.py", "entmtp_ray/decode/verify.py",
                   "entmtp_ray/decode/policy.py", "entmtp_ray/decode/loop.py"]
DEFAULT_TESTS = 'tests -m "not slow"'
PRELOAD = ("numpy", "torch", "pyarrow", "pydantic", "safetensors.torch", "pytest", "transformers",
           "transformers.models.llama.modeling_llama")  # imported once by the parent; never entmtp_ray
PYTEST_FLAGS = ["-q", "-p", "no:cacheprovider", "-p", "no:randomly"]
PRAGMA = "# pragma: no mutate"
TEST_SLACK_S = 30.0  # seconds a test may run past 10x its baseline time under a mutant (test_deadline)
CMP = {ast.Lt: ("<", "<="), ast.LtE: ("<=", "<"), ast.Gt: (">", ">="), ast.GtE: (">=", ">"),
       ast.Eq: ("==", "!="), ast.NotEq: ("!=", "=="), ast.Is: ("is", "is not"),
       ast.IsNot: ("is not", "is"), ast.In: ("in", "not in"), ast.NotIn: ("not in", "in")}
ARITH = {ast.Add: ("+", "-"), ast.Sub: ("-", "+"), ast.Mult: ("*", "/"), ast.Div: ("/", "*"),
         ast.FloorDiv: ("//", "*"), ast.Mod: ("%", "*")}
CALLS = {"min": "max", "max": "min", "amin": "amax", "amax": "amin", "any": "all", "all": "any"}
# node fields never mutated: raise arguments, f-strings, imports, decorators, annotations, assert messages
SKIP = {ast.Raise: ("exc", "cause"), ast.JoinedStr: ("values",), ast.Import: ("names",),
        ast.ImportFrom: ("names",), ast.FunctionDef: ("decorator_list", "returns"),
        ast.AsyncFunctionDef: ("decorator_list", "returns"), ast.ClassDef: ("decorator_list",),
        ast.arg: ("annotation",), ast.AnnAssign: ("annotation",), ast.Assert: ("msg",)}
DECIDED = ("killed", "timeout", "survived", "not covered")


@dataclass
class Mutant:
    id: str             # <relpath>:<line>:<col>:<operator>:<replacement>; col is ast's (a byte offset)
    rel: str
    line: int
    operator: str
    start: int          # the byte span [start, end) of the file that `replacement` replaces
    end: int
    original: str
    replacement: str
    stmt_lines: tuple   # the enclosing statement's first and last line (the header of a compound one)
    line_text: str
    mutated_line: str

    @property
    def description(self) -> str:
        return f"line {self.line}: {self.original!r} -> {self.replacement!r}    {self.line_text.strip()}"

    def apply(self, source: bytes) -> bytes:
        return source[:self.start] + self.replacement.encode() + source[self.end:]


def generate_mutants(path: Path, rel: str, source: bytes | None = None) -> list[Mutant]:
    """Every mutant of the module at `path`, in file order (`rel` names it in the ids)."""
    src = path.read_bytes() if source is None else source
    lines, starts = src.splitlines(keepends=True), [0]
    for line in lines:
        starts.append(starts[-1] + len(line))

    def span(n):
        return starts[n.lineno - 1] + n.col_offset, starts[n.end_lineno - 1] + n.end_col_offset

    def token(a, b, text):  # the operator `text` in the gap between nodes a and b (no strings there)
        lo, hi = span(a)[1], span(b)[0]
        gap = re.sub(rb"#[^\r\n]*", lambda m: b" " * len(m.group()), src[lo:hi])
        pattern = re.escape(text.encode()).replace(rb"\ ", rb"\s+")
        m = re.search(rb"\b" + pattern + rb"\b" if text[0].isalpha() else pattern, gap)
        return lo + m.start(), lo + m.end()

    def sites(node) -> list[tuple]:  # (start, end, operator, replacement)
        if isinstance(node, ast.Compare):
            pairs = zip([node.left, *node.comparators], node.comparators)
            return [(*token(a, b, CMP[type(op)][0]), "cmp", CMP[type(op)][1]) for op, (a, b) in zip(node.ops, pairs)]
        if isinstance(node, (ast.BinOp, ast.AugAssign)) and type(node.op) in ARITH:
            (text, alt), aug = ARITH[type(node.op)], "=" if isinstance(node, ast.AugAssign) else ""
            a, b = (node.target, node.value) if aug else (node.left, node.right)
            return [(*token(a, b, text + aug), "augassign" if aug else "binop", alt + aug)]
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.Not)):
            s, neg = span(node)[0], isinstance(node.op, ast.USub)
            m = re.compile(rb"-\s*" if neg else rb"not\b\s*").match(src, s)
            return [(s, m.end(), "drop-neg" if neg else "drop-not", "")]
        if isinstance(node, ast.BoolOp):
            text, alt = ("and", "or") if isinstance(node.op, ast.And) else ("or", "and")
            return [(*token(a, b, text), "bool", alt) for a, b in zip(node.values, node.values[1:])]
        if isinstance(node, ast.Constant) and type(node.value) in (bool, int, float):
            v = node.value
            if isinstance(v, bool):
                return [(*span(node), "const", str(not v))]
            if isinstance(v, int):
                return [(*span(node), "number", str(n)) for n in ({v + 1, 0} if v == 1 else {v + 1})]
            return [(*span(node), "number", repr(v + 1.0))] if v + 1.0 != v else []
        if isinstance(node, ast.Slice):
            bounds = [span(b) for b in (node.lower, node.upper) if b is not None]
            return [(s, e, "slice", f"({src[s:e].decode()}) {d} 1") for s, e in bounds for d in "+-"]
        if isinstance(node, ast.Subscript):
            k, sign = node.slice, 1
            if isinstance(k, ast.UnaryOp) and isinstance(k.op, ast.USub):
                k, sign = k.operand, -1
            if isinstance(k, ast.Constant) and type(k.value) is int:
                return [(*span(node.slice), "index", str(sign * k.value + 1))]
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name) and f.id in CALLS:
                return [(*span(f), "call", CALLS[f.id])]
            if isinstance(f, ast.Attribute) and f.attr in CALLS:
                return [(span(f)[1] - len(f.attr), span(f)[1], "call", CALLS[f.attr])]
        if isinstance(node, (ast.Break, ast.Continue)):
            return [(*span(node), "stmt", "continue" if isinstance(node, ast.Break) else "break")]
        return []

    found = []

    def visit(node, stmt_lines):
        if isinstance(node, ast.stmt):  # a compound statement counts its header lines only
            body = getattr(node, "body", None)
            stmt_lines = (node.lineno, max(node.lineno, body[0].lineno - 1) if isinstance(body, list) and body
                          else node.end_lineno)
        found.extend((*site, stmt_lines) for site in sites(node))
        for field, value in ast.iter_fields(node):
            if field not in SKIP.get(type(node), ()):
                for child in value if isinstance(value, list) else [value]:
                    if isinstance(child, ast.AST):
                        visit(child, stmt_lines)

    visit(ast.parse(src), (1, 1))
    mutants, seen = [], set()
    for start, end, op, rep, stmt_lines in sorted(found, key=lambda f: f[:4]):
        first, last = bisect.bisect_right(starts, start), bisect.bisect_right(starts, max(start, end - 1))
        texts = [lines[i - 1].decode().rstrip("\r\n") for i in range(first, last + 1)]
        original, col = src[start:end].decode(), start - starts[first - 1]
        if (start, end, rep) in seen or rep == original or any(t.rstrip().endswith(PRAGMA) for t in texts):
            continue
        seen.add((start, end, rep))
        mutated = ((lines[first - 1][:col] + rep.encode() + src[end:]).splitlines() or [b""])[0].decode()
        mutants.append(Mutant(f"{rel}:{first}:{col}:{op}:{rep}", rel, first, op, start, end, original, rep,
                              stmt_lines, texts[0], mutated))
    return mutants


class MutantFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves the module `name` from the in-memory `source`, compiled as if it were the file `path`."""

    def __init__(self, name: str, path: Path, source: bytes):
        self.name, self.path, self.source = name, path, source

    def find_spec(self, fullname, path=None, target=None):
        if fullname == self.name:
            pkg = [str(self.path.parent)] if self.path.name == "__init__.py" else None
            return importlib.util.spec_from_file_location(fullname, self.path, loader=self,
                                                          submodule_search_locations=pkg)

    def exec_module(self, module):
        exec(compile(self.source, str(self.path), "exec", dont_inherit=True), module.__dict__)


def module_name(rel: str) -> str:
    parts = Path(rel).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _fork(root: Path, log_path: Path, fn) -> int:
    """Run fn() in a child (own process group, output to log_path, in root); fn() is its exit code."""
    pid = os.fork()
    if pid:
        with contextlib.suppress(OSError):  # unless the child did it first
            os.setpgid(pid, pid)
        return pid
    code = 3
    try:
        os.setpgid(0, 0)
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1), os.dup2(fd, 2), os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        sys.stdout, sys.stderr = open(1, "w", buffering=1, closefd=False), open(2, "w", buffering=1, closefd=False)
        os.chdir(root)
        sys.path.insert(0, str(root))
        code = int(fn())
    except BaseException:
        traceback.print_exc()
    with contextlib.suppress(BaseException):
        sys.stdout.flush(), sys.stderr.flush()
    os._exit(code)


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    os.waitpid(pid, 0)


def baseline(root: Path, rels: list[str], test_args: list[str], out: Path) -> tuple[dict, dict]:
    """Run the pool once under coverage with a context per test, in a child: returns ({rel: {line:
    {nodeid}}}, {nodeid: seconds}); raises RuntimeError naming the failed tests when the pool fails."""
    data_file, timing_file, log = out / "coverage.sqlite", out / "baseline.json", out / "logs" / "baseline.log"
    import coverage, pytest
    for f in (data_file, timing_file):
        f.unlink(missing_ok=True)

    def child():
        cov = coverage.Coverage(data_file=str(data_file), config_file=False, include=[str(root / r) for r in rels])
        tests = {}

        class Contexts:
            @pytest.hookimpl(hookwrapper=True)
            def pytest_runtest_protocol(self, item, nextitem):
                cov.switch_context(item.nodeid)
                yield
                cov.switch_context("")

            def pytest_runtest_logreport(self, report):
                t = tests.setdefault(report.nodeid, {"seconds": 0.0, "failed": False})
                t["seconds"] += report.duration
                t["failed"] |= report.failed

        cov.start()
        try:
            code = pytest.main([*test_args, *PYTEST_FLAGS], plugins=[Contexts()])
        finally:
            cov.stop()
            cov.save()
        timing_file.write_text(json.dumps({"exit": int(code), "tests": tests}))
        return 0

    pid = _fork(root, log, child)
    try:
        os.waitpid(pid, 0)
    except BaseException:
        _kill(pid)
        raise
    result = json.loads(timing_file.read_text()) if timing_file.exists() else {"exit": "none", "tests": {}}
    failed = [n for n, t in result["tests"].items() if t["failed"]]
    if result["exit"] != 0 or failed:
        raise RuntimeError(f"baseline: the test pool does not pass on the unmutated code (pytest exit "
                           f"{result['exit']}; failed: {failed or 'none listed'}); see {log}")
    data = coverage.CoverageData(basename=str(data_file))
    data.read()
    measured, covered = {os.path.realpath(f): f for f in data.measured_files()}, {}
    for rel in rels:
        f = measured.get(os.path.realpath(root / rel))
        covered[rel] = {line: set(c) for line, c in (data.contexts_by_lineno(f) if f else {}).items()}
    return covered, {n: t["seconds"] for n, t in result["tests"].items()}


def select_tests(m: Mutant, covered: dict, seconds: dict) -> list[str]:
    """The tests that execute m's statement, fastest first. A statement run at import time (empty
    context: module level, def lines, class bodies) selects every test that touches the module."""
    lines = covered.get(m.rel, {})
    tests = set().union(*(lines.get(n, ()) for n in range(m.stmt_lines[0], m.stmt_lines[1] + 1)))
    if "" in tests:
        tests |= set().union(*lines.values())
    return sorted(tests - {""}, key=lambda n: (seconds.get(n, 0.0), n))


def test_deadline(baseline_s: float, slack_s: float) -> float:
    """Seconds one test may run under a mutant before the mutant counts as timed out (a hang). Generous: a child runs
    on its share of the cores (one of two at -j 2) beside another, where the baseline had them all, and 3x + 10 s
    timed out mutants that pass (an equivalent `child > 0` -> `child >= 1` among them); a hang is caught all the same."""
    return 10 * baseline_s + slack_s


def _mutant_child(root: Path, m: Mutant, source: bytes, tests: list[str], threads: int | None,
                  seconds: dict, slack_s: float) -> int:
    name = module_name(m.rel)
    top = name.split(".")[0]
    for mod in [k for k in sys.modules if k == top or k.startswith(top + ".")]:
        del sys.modules[mod]
    sys.meta_path.insert(0, MutantFinder(name, root / m.rel, m.apply(source)))
    if threads and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(threads)
    import pytest

    class Deadline:  # SIGALRM's default action ends the child even inside a C call; the parent reads it
        @pytest.hookimpl(hookwrapper=True)
        def pytest_runtest_protocol(self, item, nextitem):
            signal.setitimer(signal.ITIMER_REAL, test_deadline(seconds.get(item.nodeid, 0.0), slack_s))
            yield
            signal.setitimer(signal.ITIMER_REAL, 0)

    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    return pytest.main([*tests, "-x", *PYTEST_FLAGS], plugins=[Deadline()])


def run(root, modules=DEFAULT_MODULES, test_args=None, jobs=1, out_dir="runs/mutation", rerun=(),
        limit=None, pattern=None, preload=PRELOAD, log=print, slack_s=TEST_SLACK_S) -> dict:
    """Decide the mutants of `modules` (paths relative to `root`) not yet decided for the same source.
    A mutant times out when one of its tests runs over test_deadline(its baseline seconds, slack_s),
    or all of them together over three times their baseline plus 20 s (collection hangs included).
    `rerun`: statuses decided before to decide again. Returns {"results": the store, "report": markdown, "rate":
    overall kill %, "ran": mutants tried}."""
    root, test_args = Path(root).resolve(), shlex.split(DEFAULT_TESTS) if test_args is None else list(test_args)
    out, store_path = root / out_dir, root / out_dir / "results.json"
    (out / "logs").mkdir(parents=True, exist_ok=True)
    for name in preload:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    store = json.loads(store_path.read_text()) if store_path.exists() else {"modules": {}}
    sources, todo = {}, []
    for rel in modules:
        sources[rel] = src = (root / rel).read_bytes()
        digest, mutants = hashlib.sha256(src).hexdigest()[:16], generate_mutants(root / rel, rel, src)
        entry = store["modules"].get(rel)
        if not entry or entry["hash"] != digest:
            entry = store["modules"][rel] = {"hash": digest, "mutants": {}}
        entry["total"], old = len(mutants), entry["mutants"]
        entry["mutants"] = {m.id: old[m.id] for m in mutants if m.id in old}  # drops ids of an older generator
        for m in mutants:
            status = entry["mutants"].get(m.id, {}).get("status")
            again = status in rerun if rerun else status not in DECIDED
            if again and (not pattern or re.search(pattern, m.id)):
                todo.append(m)
    todo = todo[:limit]
    progress = iter(range(1, len(todo) + 1))

    def record(m, tests, started, status, detail):
        took = time.monotonic() - started
        store["modules"][m.rel]["mutants"][m.id] = {
            "status": status, "detail": detail, "seconds": round(took, 2), "tests": len(tests), "line": m.line,
            "operator": m.operator, "line_text": m.line_text, "mutated_line": m.mutated_line}
        store_path.with_suffix(".tmp").write_text(json.dumps(store, indent=1, sort_keys=True))
        store_path.with_suffix(".tmp").replace(store_path)
        log(f"[{next(progress)}/{len(todo)}] {status:<11} {m.id}  ({took:.1f}s, {len(tests)} tests)")

    if todo:
        log(f"baseline: the test pool under coverage ({shlex.join(test_args)}) ...")
        t0 = time.monotonic()
        covered, seconds = baseline(root, list(modules), test_args, out)
        log(f"baseline passed: {len(seconds)} tests in {time.monotonic() - t0:.0f}s; {len(todo)} mutants to run")
        threads = max(1, len(os.sched_getaffinity(0)) // jobs) if jobs > 1 else None
        queue, running, log_paths = list(todo), {}, {}  # running: pid -> (mutant, tests, started, timeout)
        try:
            while queue or running:
                while queue and len(running) < jobs:
                    m = queue.pop(0)
                    tests = select_tests(m, covered, seconds)
                    if not tests:
                        record(m, tests, time.monotonic(), "not covered", "no test executes this line")
                        continue
                    name = re.sub(r"[^\w.-]+", "_", m.id) + "-" + hashlib.sha1(m.id.encode()).hexdigest()[:6]
                    log_paths[m.id] = out / "logs" / f"{name}.log"
                    pid = _fork(root, log_paths[m.id],
                                lambda: _mutant_child(root, m, sources[m.rel], tests, threads, seconds, slack_s))
                    running[pid] = (m, tests, time.monotonic(), 3 * sum(seconds.get(t, 0) for t in tests) + 20)
                for pid, (m, tests, started, timeout) in list(running.items()):
                    finished, status = os.waitpid(pid, os.WNOHANG)
                    if not finished and time.monotonic() - started <= timeout:
                        continue
                    del running[pid]
                    log_path = log_paths.pop(m.id)
                    if not finished:
                        _kill(pid)
                        record(m, tests, started, "timeout", f"over {timeout:.0f}s")
                    elif os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGALRM:
                        record(m, tests, started, "timeout", f"a test ran over 10x its baseline + {slack_s:g}s")
                    elif os.WIFSIGNALED(status):
                        record(m, tests, started, "killed", f"crashed (signal {os.WTERMSIG(status)})")
                    else:
                        code = os.WEXITSTATUS(status)
                        verdict = {0: "survived", 1: "killed", 2: "killed"}.get(code, "error")
                        if code == 4 and broke_collection(log_path, m):
                            verdict = "killed"
                        record(m, tests, started, verdict, f"pytest exit {code}")
                time.sleep(0.02)
        finally:
            for pid in running:
                _kill(pid)
    report, rate = render(store, list(modules))
    (out / "report.md").write_text(report)
    log(report)
    return {"results": store, "report": report, "rate": rate, "ran": len(todo)}


def broke_collection(log_path: Path, m: Mutant) -> bool:
    """Whether pytest's usage error (exit 4) came from the mutant: collection (a conftest or a test
    module importing it) raised in the mutated file. The baseline collected the same tests, so the
    mutant is what a real run would trip over; any other exit 4 stays the tool's own trouble."""
    text = log_path.read_text(errors="replace") if log_path.exists() else ""
    return Path(m.rel).as_posix() in text.replace("\\", "/")  # a traceback line through the mutated file


def render(store: dict, modules: list[str]) -> tuple[str, float]:
    """The Markdown report: a row per module and one for all, the overall kill rate, survivors, errors."""
    cols = ["mutants", "killed", "timeout", "survived", "not covered", "error", "pending"]
    rows, survivors, errors = {}, [], []
    for rel in modules:
        entry = store["modules"].get(rel, {"mutants": {}, "total": 0})
        recs = entry["mutants"]
        rows[rel] = {c: sum(r["status"] == c for r in recs.values()) for c in cols}
        rows[rel].update(mutants=entry["total"], pending=entry["total"] - len(recs))
        for mid, r in recs.items():
            if r["status"] in ("survived", "not covered"):
                tag = "  (not covered)" if r["status"] == "not covered" else ""
                survivors.append((rel, r["line"], f"{rel}:{r['line']}  {r['operator']}  "
                                  f"{r['line_text'].strip()} -> {r['mutated_line'].strip()}{tag}"))
            elif r["status"] == "error":
                errors.append(f"{mid}: {r['detail']}")
    rows["**all**"] = {c: sum(row[c] for row in rows.values()) for c in cols}
    shown = cols if rows["**all**"]["pending"] else cols[:-1]
    header = " | ".join(shown).replace("error", "errors")
    table = [f"| module | {header} | kill rate |", "|---" * (len(shown) + 2) + "|"]
    for name, row in rows.items():
        decided = sum(row[c] for c in DECIDED)
        rate = 100.0 * (row["killed"] + row["timeout"]) / decided if decided else 0.0
        table.append(f"| {name} | " + " | ".join(str(row[c]) for c in shown) + f" | {rate:.1f}% |")
    lines = table + ["", f"Overall kill rate: {rate:.1f}%", "", f"## Survivors ({len(survivors)})", ""]
    lines += ["```", *(s[-1] for s in sorted(survivors)), "```"] if survivors else ["none"]
    if errors:
        lines += ["", f"## Errors ({len(errors)}; logs in logs/ beside report.md)", "", *errors]
    return "\n".join(lines) + "\n", rate  # `rate` is the **all** row's: it comes last


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-j", "--jobs", type=int, default=1, help="parallel mutant children (default 1)")
    p.add_argument("--module", nargs="+", action="extend", help=f"module paths (default: {' '.join(DEFAULT_MODULES)})")
    p.add_argument("--tests", default=DEFAULT_TESTS, help="pytest args of the test pool (default: %(default)s)")
    p.add_argument("--list", action="store_true", help="print the mutants, run nothing")
    p.add_argument("--limit", type=int, help="run at most N mutants")
    p.add_argument("--filter", help="only mutant ids matching this regex")
    p.add_argument("--rerun-survivors", action="store_true", help="re-test only the previous survivors")
    p.add_argument("--rerun-timeouts", action="store_true",
                   help="re-test only the previous timeouts (a run beside other load may time out passing mutants)")
    p.add_argument("--preload", default=",".join(PRELOAD), help="modules the parent imports once (comma list)")
    p.add_argument("--root", default=str(Path(__file__).resolve().parents[1]), help="project root")
    p.add_argument("--out", default="runs/mutation", help="results folder, relative to the root")
    p.add_argument("--fail-under", type=float, metavar="PCT", help="exit 1 when the overall kill rate is below")
    a = p.parse_args(argv)
    modules = a.module or DEFAULT_MODULES
    if a.list:
        ms = [m for rel in modules for m in generate_mutants(Path(a.root) / rel, rel)
              if not a.filter or re.search(a.filter, m.id)][:a.limit]
        print("\n".join(f"{m.id}\n    {m.description}" for m in ms) + f"\n{len(ms)} mutants")
        return 0
    try:
        rerun = (("survived", "not covered") if a.rerun_survivors else ()) + (("timeout",) if a.rerun_timeouts else ())
        result = run(a.root, modules, shlex.split(a.tests), a.jobs, a.out, rerun, a.limit,
                     a.filter, [x for x in a.preload.split(",") if x], lambda s: print(s, flush=True))
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 1
    return 1 if a.fail_under is not None and result["rate"] < a.fail_under else 0


if __name__ == "__main__":
    sys.exit(main())
