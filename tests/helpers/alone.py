"""Nothing the suite runs may read a folder beside the checkout: a user's clone has none (our machines keep a data
folder there). An audit hook, installed for the whole session by conftest.py, refuses every open() of a path in
one of the checkout's neighbours, so the read fails inside the test that made it, and records it for the session's
end. Neighbours are the folders beside the checkout when the session starts, except those that hold the temp dir,
the home folder or this Python (which may lie beside it); a checkout directly in the temp dir or in / has no
neighbours this can tell apart, and is not checked (tests/test_standalone.py runs the demo's job in a copy that
has nothing beside it, on any host)."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
READ: list[str] = []  # neighbouring paths something tried to open


def neighbours(root: Path = ROOT) -> tuple[str, ...]:
    parent = root.parent
    keep = [Path(p).resolve() for p in (tempfile.gettempdir(), Path.home(), sys.prefix, sys.base_prefix)]
    if parent in keep or parent == Path(parent.anchor):
        return ()
    found = []
    for path in parent.iterdir():
        path = path.resolve()
        if path != root and path.is_dir() and not any(k == path or path in k.parents for k in keep):
            found.append(str(path) + os.sep)
    return tuple(found)


def install(root: Path = ROOT) -> tuple[str, ...]:
    """Refuse opening anything in the checkout's neighbours from now on, in this process; returns them."""
    near = neighbours(root)
    if not near:
        return near

    def hook(event: str, args: tuple) -> None:
        if event != "open" or not args or not isinstance(args[0], (str, os.PathLike)):
            return
        path = os.path.abspath(os.fspath(args[0])) + os.sep
        if path.startswith(near):
            READ.append(path.rstrip(os.sep))
            raise PermissionError(f"{path.rstrip(os.sep)} lies beside the checkout: a user's clone has nothing "
                                  "there, so nothing the product or its tests run may read it (ship the file in "
                                  "the repository, e.g. tests/fixtures/)")

    sys.addaudithook(hook)
    return near
