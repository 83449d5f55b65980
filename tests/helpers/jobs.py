"""jobs/generate.py as the tests run it, on the tiny local model directory (conftest.py's tiny_model_dirs), over a
prompt file a test writes, its Parquet output read back: in this process on the session's shared Ray (run_here,
with conftest.py's `ray_cluster`; `environment` gives its workers variables, as for a fault injected or an S3
endpoint), or in a subprocess with a Ray of its own (run_job) where the process itself is what a test checks (a
driver killed, a copy of the checkout, `ray job submit`)."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as pads

ROOT = Path(__file__).resolve().parents[2]
JOB = [sys.executable, str(ROOT / "jobs" / "generate.py")]


def write_prompts(path: Path, n: int, bad: bool = False) -> Path:
    rows = [{"uid": f"q{i}", "text": f"Write item number {i} of a list.", "label": i} for i in range(n)]
    if bad:
        rows += [{"uid": "empty", "text": "", "label": -1}, {"uid": "number", "text": 7, "label": -2},
                 {"uid": "long", "text": "many words " * 800, "label": -3}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def job_args(dirs, dataset, output, *extra):
    model_dir, heads_dir = dirs
    return [*JOB, "--dataset", str(dataset), "--prompt-column", "text", "--id-column", "uid",
            "--model", str(model_dir), "--heads", str(heads_dir), "--max-new-tokens", "12",
            "--output", str(output), *extra]


def run_job(args, env=None, timeout=900):  # a hang guard: under `make test` two tests run at once
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})
    return proc


def read_output(output) -> list[dict]:
    return pads.dataset(str(output), format="parquet").to_table().to_pylist()


def readable_rows(output) -> list[dict]:
    """Rows of the Parquet files a running job has finished; one it is still writing fails to open."""
    rows = []
    for file in Path(output).glob("*.parquet"):
        try:
            rows += pads.dataset(str(file), format="parquet").to_table().to_pylist()
        except (pa.ArrowInvalid, OSError):
            pass
    return rows


@dataclass
class Finished:
    """What a job run in this process left: its exit status, stdout (the summary last) and stderr (its error lines
    and the warnings its driver logged), as a subprocess.CompletedProcess would hold them."""

    returncode: int
    stdout: str
    stderr: str


@contextlib.contextmanager
def environment(head, env: dict[str, str]):
    """This process joined to the shared Ray `head` (conftest's `ray_cluster`) as a driver whose every task and
    actor has `env` in its environment (Ray's runtime_env: fresh workers, as a job started with `env` would have);
    joined again without it on the way out, for the rest of the test."""
    import ray

    ray.shutdown()
    ray.init(address=head.address, runtime_env={"env_vars": env}, log_to_driver=True)
    try:
        yield
    finally:
        ray.shutdown()
        ray.init(address=head.address, log_to_driver=True)


def run_here(args: list[str], actor: type | None = None) -> Finished:
    """The job of `args` (job_args' list, or the flags alone) run by jobs/generate.py's main in this process, on the
    Ray this process has joined (conftest's `ray_cluster`), or with none joined (a job that must fail before it
    joins one). Only where the subprocess itself is what a test checks does it run the job as one (run_job).
    `actor`: the pool's actor class (helpers/faults.py's, to inject a fault)."""
    from entmtp_ray.jobs.generate import main

    return run_main(lambda argv: main(argv, actor), list(args[len(JOB):] if args[:len(JOB)] == JOB else args))


def run_main(main, argv: list[str]) -> Finished:
    """A command's `main(argv)` run in this process as its launcher would run it: stdout, stderr and the warnings it
    logs captured, its exit status (argparse's usage errors included); torch's thread count, which a command may
    set for its work, is given back afterwards."""
    out, err = io.StringIO(), io.StringIO()
    handler = logging.StreamHandler(err)
    handler.setLevel(logging.WARNING)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))  # as cli.quiet_logging's
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        with kept_torch_threads(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(argv)
            except SystemExit as exc:  # argparse's usage errors
                code = exc.code if isinstance(exc.code, int) else 1
    finally:
        root.removeHandler(handler)
    return Finished(code, out.getvalue(), err.getvalue())


@contextlib.contextmanager
def kept_torch_threads():
    """torch's thread count as it was before the block, whatever the block set."""
    import torch

    threads = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads(threads)
