"""The Ray Data pipeline: prompt table -> actor pool (one Engine per actor) -> Parquet.

The only module that imports ray. Nothing algorithmic: the actor wraps engine.Engine.
Exactly-once rests on Ray Data's defaults (restarted actors, retried tasks, no dropped blocks);
resume is an anti-join of the prompt ids against the ids already written.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
import ray
from ray.data import ActorPoolStrategy, DataContext, SaveMode

from entmtp_ray.config import DecodingConfig, JobConfig, ModelConfig
from entmtp_ray.pipeline.engine import EngineBroken
from entmtp_ray.pipeline.records import output_table
from entmtp_ray.pipeline.tasks import INTERNAL_COLUMNS

log = logging.getLogger(__name__)

# Fault injection for the exactly-once tests: the actor that meets this row id fails, once (the
# marker file records that it happened): it exits abruptly (kind `exit`), or its engine reports
# itself broken (kind `broken`, as an out-of-memory error would).
FAULT_ROW_ENV = "ENTMTP_FAULT_EXIT_ON_ROW"
FAULT_MARKER_ENV = "ENTMTP_FAULT_MARKER"
FAULT_KIND_ENV = "ENTMTP_FAULT_KIND"


class GenerateActor:
    """Callable class for map_batches: loads model, heads and policy once, then decodes row by row."""

    def __init__(self, model_cfg: dict, decoding: dict, threads: int):
        import torch

        from entmtp_ray.pipeline.engine import Engine

        torch.set_num_threads(max(1, threads))
        self.engine = Engine(ModelConfig(**model_cfg), DecodingConfig(**decoding))
        self.engine.actor_id = ray.get_runtime_context().get_actor_id()
        self.engine.warm_up()

    def __call__(self, batch: pa.Table) -> pa.Table:
        rows = []
        for row in batch.select(["id", "prompt", "_messages", "_input_error"]).to_pylist():
            if row["_input_error"]:
                rows.append(self.engine.error_row(row["id"], row["prompt"], row["_input_error"]))
                continue
            messages = json.loads(row["_messages"]) if row["_messages"] else None
            try:
                _maybe_fault(row["id"])
                rows.append(self.engine.run(row["id"], row["prompt"], messages))
            except EngineBroken:
                # this actor is unusable: end it, and Ray Data restarts it and retries the block
                log.exception("actor %s is broken; exiting so that Ray retries its rows", self.engine.actor_id)
                os._exit(1)
        passthrough = batch.drop_columns([c for c in INTERNAL_COLUMNS if c in batch.column_names])
        return output_table(passthrough, rows)


def _maybe_fault(row_id: str) -> None:
    target, marker = os.environ.get(FAULT_ROW_ENV), os.environ.get(FAULT_MARKER_ENV)
    if target and marker and row_id == target and not os.path.exists(marker):
        Path(marker).write_text(str(os.getpid()))
        if os.environ.get(FAULT_KIND_ENV, "exit") == "broken":
            raise EngineBroken(f"row {row_id}: injected fault")
        os._exit(1)


def finished_ids(output: str) -> set[str]:
    """Ids already written under `output` (readable Parquet files only)."""
    path = Path(output)
    if not path.is_dir():
        return set()
    done: set[str] = set()
    for file in sorted(path.glob("*.parquet")):
        try:
            done.update(pads.dataset(file, format="parquet").to_table(columns=["id"]).column("id").to_pylist())
        except (pa.ArrowInvalid, OSError) as exc:
            aside = path / ".unreadable"
            aside.mkdir(exist_ok=True)
            file.rename(aside / file.name)
            log.warning("moved unreadable %s aside to %s (%s); its rows will be regenerated", file, aside, exc)
    return done


def init_ray(job: JobConfig) -> None:
    if ray.is_initialized():
        return
    address = job.address or os.environ.get("RAY_ADDRESS")  # set for us under `ray job submit`
    if address:
        ray.init(address=address, log_to_driver=True)
        return
    # Ray Data's own read/split/write tasks need CPUs beside the actors; on a 2-core machine the
    # checkpointing and scheduling deadlocked without headroom (docs/design.md §4).
    actors_cpus = job.max_actors * job.cpus_per_actor
    ray.init(num_cpus=max(8, int(actors_cpus) + 4), include_dashboard=False)


def shutdown() -> None:
    """Disconnect from Ray (stopping a local one), so no late driver log follows the summary line."""
    if ray.is_initialized():
        ray.shutdown()


def run_pipeline(table: pa.Table, job: JobConfig, model_cfg: ModelConfig, decoding: DecodingConfig,
                 started: float | None = None) -> dict:
    """Generate for every row of `table` not yet in job.output; returns the run summary.

    `started` (unix seconds) is when the job began, for the wall time and time to first row.
    """
    start = started or time.time()
    total_rows = table.num_rows
    if job.resume:
        done = finished_ids(job.output)
        if done:
            keep = pa.array([i not in done for i in table.column("id").to_pylist()])
            table = table.filter(keep)
            log.warning("resume: %d of %d rows already in %s; %d to go", total_rows - table.num_rows,
                        total_rows, job.output, table.num_rows)
    if table.num_rows:
        init_ray(job)
        ctx = DataContext.get_current()
        ctx.max_errored_blocks = 0  # never drop a failed block silently
        blocks = min(table.num_rows, job.max_blocks)
        ds = ray.data.from_arrow(table).repartition(blocks)
        ds = ds.map_batches(
            GenerateActor,
            fn_constructor_kwargs={"model_cfg": model_cfg.model_dump(), "decoding": decoding.model_dump(),
                                   "threads": max(1, int(job.cpus_per_actor))},
            batch_size=1,
            batch_format="pyarrow",
            compute=ActorPoolStrategy(min_size=job.min_actors, max_size=job.max_actors),
            num_cpus=job.cpus_per_actor,
            num_gpus=job.gpus_per_actor,
        )
        ds.write_parquet(job.output, mode=SaveMode.APPEND)  # file names carry a per-write uuid
    return summarize(job.output, start, total_rows)


def summarize(output: str, started: float, input_rows: int) -> dict:
    """The run's JSON summary, computed (vectorised) from everything written under `output`."""
    wall_s = time.time() - started
    path = Path(output)
    files = sorted(path.glob("*.parquet")) if path.is_dir() else []
    columns = ["id", "num_output_tokens", "steps", "error", "started_at", "total_s"]
    table = pads.dataset(files, format="parquet").to_table(columns=columns) if files else None
    rows = table.num_rows if table is not None else 0
    ok = table.filter(pc.is_null(table["error"])) if rows else None
    done = ok.num_rows if ok is not None else 0
    tokens = pc.sum(ok["num_output_tokens"]).as_py() if done else 0
    steps = pc.sum(ok["steps"]).as_py() if done else 0
    span, first_row_s = 0.0, None
    if done:
        ends = pc.add(ok["started_at"], ok["total_s"])
        span = pc.max(ends).as_py() - pc.min(ok["started_at"]).as_py()
        this_run = pc.filter(ends, pc.greater_equal(ok["started_at"], started))
        first_row_s = pc.min(this_run).as_py() - started if len(this_run) else None
    return {
        "rows": rows,
        "input_rows": input_rows,
        "duplicates": rows - (pc.count_distinct(table["id"]).as_py() if rows else 0),
        "errors": rows - done,
        "output_tokens": tokens,
        "aggregate_tokens_per_s": tokens / span if span > 0 else 0.0,
        # each row's first token comes from its prefill, not from a step
        "mean_accepted_length": (tokens - done) / steps if steps else None,
        "decode_span_s": span,
        "wall_s": wall_s,
        "first_row_s": first_row_s,  # job start -> first row of this run decoded
        "output": str(path.resolve()),
    }


def check_output(output: str, resume: bool) -> None:
    """Fail before any work if the output cannot be written, or would mix two runs."""
    path = Path(output)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".probe-{uuid.uuid4().hex}"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise ValueError(f"--output {output}: not writable ({exc}); pass a directory you can write to") from exc
    if not resume and any(path.glob("*.parquet")):
        raise ValueError(f"--output {output} already holds Parquet files; pass --resume to complete that run, "
                         "or choose an empty --output")
