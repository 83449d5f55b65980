"""Start and stop only a test's own Ray: never `ray stop`, `pkill` or anything else that picks
processes by name, which would stop every Ray on the machine (another user's job, a parallel run).

Every Ray a test starts gets its own short directory under /tmp, named as `--temp-dir` of a head
or as RAY_TMPDIR for a local ray.init() (its session then lies under <dir>/ray, and it cannot
find another cluster's /tmp/ray/ray_current_cluster to join), and the same directory in the
environment variable MARKER_ENV of everything started for it. The processes of that Ray are

  - those of this user that name the directory in their command line (gcs_server, raylet,
    dashboard, monitors: all take the session dir or the temp dir as an argument) or carry it in
    MARKER_ENV of their environment (the ray client server, whose arguments name only the GCS
    address, the driver, processes of fake nodes; given the head's GCS address, an argument
    `...=<address>` counts too),
  - and every descendant of those: workers retitle themselves `ray::...`, which overwrites their
    command line (and may overwrite the environment), but they are children of their raylet.

The test process itself and its ancestors are never among them.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import psutil

BIN = Path(sys.executable).parent
MARKER_ENV = "ENTMTP_TEST_RAY"
GONE = (psutil.NoSuchProcess, psutil.ZombieProcess)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def short_temp_dir(prefix: str = "rt-") -> str:
    """A new directory /tmp/<prefix>XXXXXXXX: Ray's socket paths below it must stay under 107 bytes."""
    return tempfile.mkdtemp(prefix=prefix, dir="/tmp")


def ray_env(temp_dir: str, base: dict | None = None, **extra: str) -> dict:
    """Environment for processes of the Ray under `temp_dir`: its marker, RAY_TMPDIR, this
    virtualenv's `ray` first on PATH, and no inherited RAY_ADDRESS (which would send the work to
    whatever cluster it names)."""
    base = dict(os.environ if base is None else base)
    env = {**base, "PATH": f"{BIN}{os.pathsep}{base.get('PATH', '')}", MARKER_ENV: temp_dir,
           "RAY_TMPDIR": temp_dir, **extra}
    env.pop("RAY_ADDRESS", None)
    return env


def _protected() -> set[int]:
    """This process and its ancestors: never stopped, whatever they carry."""
    pids = {os.getpid()}
    with contextlib.suppress(psutil.Error):
        pids.update(p.pid for p in psutil.Process().parents())
    return pids


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _names_ray(cmdline: Iterable[str], temp_dir: str, address: str | None) -> bool:
    needle = temp_dir.rstrip(os.sep) + os.sep  # /tmp/rt-ab12 must not match /tmp/rt-ab123
    return any(needle in arg + os.sep or (address and arg.endswith(f"={address}")) for arg in cmdline)


def processes_of(temp_dir: str, address: str | None = None) -> list[psutil.Process]:
    """Live processes of the Ray under `temp_dir` (with GCS at `address`, if given; see the module
    docstring), descendants included."""
    uid, protected = os.getuid(), _protected()
    roots = []
    for proc in psutil.process_iter(["uids", "cmdline"]):
        try:
            if proc.pid in protected or proc.info["uids"] is None or proc.info["uids"].real != uid:
                continue
            if _names_ray(proc.info["cmdline"] or (), temp_dir, address):
                roots.append(proc)
                continue
            with contextlib.suppress(psutil.AccessDenied):
                if proc.environ().get(MARKER_ENV) == temp_dir:
                    roots.append(proc)
        except GONE:
            pass
    return _with_descendants(roots, protected)


def _with_descendants(roots: Iterable[psutil.Process], protected: set[int]) -> list[psutil.Process]:
    found: dict[int, psutil.Process] = {}
    for root in roots:
        try:
            tree = [root, *root.children(recursive=True)]
        except GONE:
            tree = [root]
        for proc in tree:
            if proc.pid not in protected and _alive(proc):
                found.setdefault(proc.pid, proc)
    return list(found.values())


def _describe(procs: Iterable[psutil.Process]) -> list[str]:
    out = []
    for proc in procs:
        try:
            out.append(f"{proc.pid} {' '.join(proc.cmdline())[:160]}")
        except psutil.Error:
            out.append(f"{proc.pid} (gone)")
    return out


def _kill_all(find, timeout: float) -> list[str]:
    """SIGSTOP what `find()` returns until it finds nothing new (a stopped process starts no
    others and its children keep their parent), then SIGKILL them all and wait until they are
    gone. Returns what was killed, described; raises if any of it outlives `timeout`."""
    stopped: dict[int, psutil.Process] = {}
    described: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        new = {p.pid: p for p in find() if p.pid not in stopped}
        if not new:
            break
        for proc in new.values():
            with contextlib.suppress(psutil.Error):
                proc.send_signal(signal.SIGSTOP)
            stopped[proc.pid] = proc
            described += _describe([proc])
    for proc in stopped.values():
        with contextlib.suppress(psutil.Error):
            proc.send_signal(signal.SIGKILL)
    while time.monotonic() < deadline and any(_alive(p) for p in stopped.values()):
        time.sleep(0.05)
    left = [p for p in stopped.values() if _alive(p)]
    if left:
        raise AssertionError(f"still alive {timeout:.0f} s after SIGKILL: {_describe(left)}")
    return described


def kill_tree(pid: int, temp_dir: str | None = None, timeout: float = 30) -> list[str]:
    """SIGKILL process `pid` with all its descendants, and (given `temp_dir`) every process of the
    Ray under it, e.g. a killed local driver's raylet, GCS and workers. The descendants are found
    while their parent still lives: once it is killed they are reparented and no longer its."""
    protected = _protected()
    try:
        root = psutil.Process(pid)
        tree = [root, *root.children(recursive=True)]
    except GONE:
        tree = []

    def find():
        return _with_descendants(tree, protected) + (processes_of(temp_dir) if temp_dir else [])

    killed = _kill_all(find, timeout)
    if temp_dir:
        assert_none_left(temp_dir)
    return killed


def stop_ray(temp_dir: str, address: str | None = None, grace: float = 0.0, timeout: float = 30) -> list[str]:
    """Stop every process of the Ray under `temp_dir` (GCS at `address`), after letting them end
    on their own for up to `grace` seconds (a driver's ray.shutdown() leaves workers that exit a
    moment later). Returns those that had to be killed; raises if any survives."""
    deadline = time.monotonic() + grace
    while processes_of(temp_dir, address) and time.monotonic() < deadline:
        time.sleep(0.2)
    killed = _kill_all(lambda: processes_of(temp_dir, address), timeout)
    assert_none_left(temp_dir, address)
    return killed


def assert_none_left(temp_dir: str, address: str | None = None) -> None:
    left = processes_of(temp_dir, address)
    assert not left, f"processes of the Ray under {temp_dir} remain: {_describe(left)}"


@contextlib.contextmanager
def own_ray_dir(prefix: str = "rt-", grace: float = 10.0) -> Iterator[str]:
    """A fresh directory for the Ray(s) a test starts; on exit every process of them is stopped,
    checked gone, and the directory removed. Processes that had not ended on their own within
    `grace` seconds are named in a warning."""
    temp_dir = short_temp_dir(prefix)
    try:
        yield temp_dir
    finally:
        try:
            killed = stop_ray(temp_dir, grace=grace)
            if killed:
                warnings.warn(f"killed {len(killed)} leftover processes of the test's Ray: {killed[:8]}",
                              stacklevel=1)
        finally:
            shutil.rmtree(temp_dir, ignore_errors=True)


@contextlib.contextmanager
def own_ray_env(monkeypatch, prefix: str = "rt-") -> Iterator[str]:
    """own_ray_dir, named in the test's environment (inherited by the in-process Cluster and every job the test
    runs): a local Ray started by a job puts its session under it; RAY_ADDRESS is cleared."""
    with own_ray_dir(prefix) as temp_dir:
        monkeypatch.setenv(MARKER_ENV, temp_dir)
        monkeypatch.setenv("RAY_TMPDIR", temp_dir)
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
        yield temp_dir


@dataclass
class RayHead:
    address: str  # host:port of its GCS
    dashboard_port: int
    temp_dir: str
    env: dict  # the environment it was started with, for its clients


# ports `ray start --head` takes by default whether or not they are free (8265, 10001, 52365): a head
# given none of them cannot come up whole beside another one (its dashboard agent fails to bind,
# and `ray job submit` answers "No available agent to submit job")
FIXED_DEFAULT_PORTS = ("--dashboard-port", "--ray-client-server-port", "--dashboard-agent-listen-port")


@contextlib.contextmanager
def ray_head(*args: str, port: int | None = None, env: dict | None = None, prefix: str = "rh-",
             timeout: float = 120) -> Iterator[RayHead]:
    """A head from `ray start --head --port=<port> --temp-dir=<own dir> *args`, with `env` (plus
    ray_env's marker) and free ports for FIXED_DEFAULT_PORTS that `args` do not set; on exit
    exactly its processes are stopped, checked gone, and its directory removed: fake nodes its
    autoscaler started and workers included, no other Ray touched."""
    from ray._private.services import get_node_ip_address

    port = port or free_port()
    ports = {flag: free_port() for flag in FIXED_DEFAULT_PORTS}
    for arg in args:
        flag, _, value = arg.partition("=")
        if flag in ports:
            ports[flag] = int(value)
    args = (*args, *(f"{flag}={value}" for flag, value in ports.items() if f"{flag}={value}" not in args))
    address = f"{get_node_ip_address()}:{port}"
    temp_dir = short_temp_dir(prefix)
    env = ray_env(temp_dir, env)
    try:
        start = subprocess.run(
            [str(BIN / "ray"), "start", "--head", f"--port={port}", f"--temp-dir={temp_dir}",
             "--disable-usage-stats", *args], capture_output=True, text=True, env=env, timeout=timeout)
        assert start.returncode == 0, start.stderr[-3000:]
        yield RayHead(address, ports["--dashboard-port"], temp_dir, env)
    finally:
        try:
            stop_ray(temp_dir, address)
        finally:
            shutil.rmtree(temp_dir, ignore_errors=True)
