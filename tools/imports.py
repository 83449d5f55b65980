"""The package's import graph: modules, import levels (longest chain of internal imports), circles,
and lines of code. Counts every import of the package, also those inside functions.

    .venv/bin/python tools/imports.py [PACKAGE_DIR]      # default: entmtp_ray
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def internal_imports(path: Path, name: str, package: str, modules: set[str]) -> set[str]:
    """The package's modules `path` imports (a `from pkg import sub` counts as importing pkg.sub)."""
    is_init = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_init else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target.startswith(package) and target != name and target != package:
                out.add(target)
    return out


def graph(root: Path) -> dict[str, set[str]]:
    files = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    modules = set(files)
    return {name: internal_imports(path, name, root.name, modules) for name, path in files.items()}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for v in edges:
        if v not in index:
            visit(v)
    return out


def levels(edges: dict[str, set[str]]) -> dict[str, int]:
    """Level of each module: 1 + the highest level it imports (0 for a leaf); a circle counts as one."""
    component_of = {m: tuple(c) for c in circles(edges) for m in c}
    memo: dict[str, int] = {}

    def level(v, seen=()):
        if v in memo:
            return memo[v]
        own = component_of.get(v, (v,))
        below = {w for m in own for w in edges[m] if w not in own}
        memo[v] = 1 + max((level(w) for w in below), default=-1)
        return memo[v]

    return {v: level(v) for v in edges}


def report(root: Path) -> dict:
    edges = graph(root)
    lv = levels(edges)
    code = {name: len(path.read_text().splitlines()) for name, path in
            ((module_name(p, root), p) for p in root.rglob("*.py"))}
    return {"modules": len([m for m in edges if code[m] > 0]), "lines": sum(code.values()),
            "import_levels": max(lv.values()) + 1, "circles": circles(edges),
            "level_of": dict(sorted(lv.items(), key=lambda kv: (kv[1], kv[0])))}


if __name__ == "__main__":
    target = Path(sys.argv[1] if len(sys.argv) > 1 else "entmtp_ray").resolve()
    print(json.dumps(report(target), indent=1))
