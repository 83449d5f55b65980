"""The generation job's Ray Data plane: prompts streamed from any filesystem -> (--limit) -> one row per
sample (--n) -> (--resume) -> the processor's actor pool -> Parquet on any filesystem -> the run's summary.

The driver lists files and plans; it never holds the dataset. Read tasks parse files (sources.read_file)
and turn records into prompt rows (tasks.standardize) on the workers. --limit keeps the rows whose ids hash
lowest with the seed (each block keeps its own lowest first, so only a few rows meet in the sort). --resume
drops the samples already written (an anti-join against the `<id>#<sample_index>` keys that a task on the
driver's node reads from the output, into the object store). The summary is computed the same way, from the output's files.

Exactly-once rests on Ray Data's defaults (restarted actors, retried tasks, no dropped blocks) and on the
manifest and the anti-join for a job run again with --resume.

Before any of that, `connect` joins (or starts) the cluster and checks what only the cluster can tell
(pipeline/placement.py): the actors' GPUs and device, a GPU that torch can use where they will run, and an
--output that every node writing to it sees.
"""

from __future__ import annotations

import logging
import os
import time
import uuid

import pyarrow as pa
import pyarrow.parquet as pq
import ray
from ray.data import SaveMode

from entmtp_ray.config import JobConfig, PoolConfig
from entmtp_ray.model.loading import cuda_problem
from entmtp_ray.pipeline.placement import ActorPlacement, output_problem, read_mounts, spans_nodes
from entmtp_ray.pipeline.autobank import calibration_problem, calibration_rows, data_identity
from entmtp_ray.pipeline.processor import PROBE_PATIENCE_S, Processor
from entmtp_ray.pipeline.sources import Location, Source
from entmtp_ray.pipeline.streams import (JobLedger, TablePrompts, counted, drop_finished, on_this_node,
                                         finished_keys_task, read_here, read_prompts, sample, sample_here, scan_files,
                                         small_local, summarize_task)
from entmtp_ray.pipeline.tasks import PromptSpec, open_source

log = logging.getLogger(__name__)


# ---- the job -------------------------------------------------------------------------------------

def init_ray(job: JobConfig, pool: PoolConfig) -> None:
    if ray.is_initialized():
        return
    address = job.address or os.environ.get("RAY_ADDRESS")  # set for us under `ray job submit`
    if address:
        ray.init(address=address, log_to_driver=True)
        return
    # Ray Data's own read/split/write tasks need CPUs beside the actors; on a 2-core machine the
    # checkpointing and scheduling deadlocked without headroom (docs/design.md §4).
    actors_cpus = pool.max_actors * pool.cpus_per_actor
    ray.init(num_cpus=max(8, int(actors_cpus) + 4), include_dashboard=False)


@ray.remote(num_cpus=0)
def _gpu_probe() -> tuple[str, list, str | None]:
    """Run where an actor with the pool's GPUs would: its node, the GPUs Ray assigned, and why torch cannot
    use them (None: it can)."""
    return ray.util.get_node_ip_address(), ray.get_gpu_ids(), cuda_problem()


def _check_gpu_where_actors_run(gpus: float) -> None:
    """Fail, before any row, when a task that reserves an actor's GPUs finds no CUDA there (the actors would
    fail the same way, one by one). On an autoscaling cluster this waits for the first GPU node."""
    probe = _gpu_probe.options(num_gpus=gpus).remote()
    while not ray.wait([probe], timeout=PROBE_PATIENCE_S)[0]:
        log.warning("waiting for a node with %g free GPU to check CUDA on (the autoscaler may be starting one; "
                    "a cluster without GPU nodes never has one: stop the job and pass --gpus-per-actor 0)", gpus)
    node, gpu_ids, problem = ray.get(probe)
    if problem:
        raise ValueError(f"a task given GPU {gpu_ids} on node {node}, as an actor would be: {problem}")


def connect(job: JobConfig, processor: Processor, location: Location | None = None,
            timeline: dict[str, float] | None = None) -> ActorPlacement:
    """Join job.address (or RAY_ADDRESS), else start a local Ray; decide the actors' GPUs and device (once per
    processor) and check that `location` is seen by every node that writes to it and, last (they may wait for
    the autoscaler), that torch can use a GPU where the actors will run and, with --dtype auto on CPU actors, which
    dtype they compute in (Processor.ask_actors): the facts the plan is resolved for, once, on its first use.
    ValueError names the fix (the job exits 2). `timeline`: unix times of the phases, added by name (ray_up, checks,
    dtype)."""
    timeline = {} if timeline is None else timeline
    fresh = processor.placement is None or not ray.is_initialized()
    placement, started_here = _place(job, processor) if fresh else (processor.placement, False)
    timeline.setdefault("ray_up", time.time())
    if location is not None:
        pool = processor.config.pool
        nodes = [n for n in ray.nodes() if n["Alive"]]
        here = ray.get_runtime_context().get_node_id()
        driver_resources = next((n["Resources"] for n in nodes if n["NodeID"] == here), {})
        spans = spans_nodes(len(nodes), driver_resources, pool.cpus_per_actor, placement.gpus)
        problem = output_problem(location, spans, read_mounts(), job.output_shared)
        if problem:
            raise ValueError(problem)
    if fresh and placement.device == "cuda" and not started_here:  # a local Ray's GPUs are the driver's, checked
        _check_gpu_where_actors_run(placement.gpus)
    processor.placement = placement
    timeline.setdefault("checks", time.time())
    processor.ask_actors(local=started_here)  # last too: it may wait for a node
    timeline.setdefault("dtype", time.time())
    return placement


def _place(job: JobConfig, processor: Processor) -> tuple[ActorPlacement, bool]:
    """(the actors' placement, whether this call started a local Ray), after joining or starting Ray."""
    model, pool = processor.config.model, processor.config.pool
    started_here = not ray.is_initialized() and not (job.address or os.environ.get("RAY_ADDRESS"))
    problem = cuda_problem() if started_here and model.device.startswith("cuda") else None
    if problem:  # the local Ray's GPUs would be this machine's
        raise ValueError(f"--device {model.device}: {problem}; or use --device cpu")
    init_ray(job, pool)
    processor.placement = None  # decided afresh on the cluster just joined, by the processor's one rule
    placement = processor.place()
    cluster_gpus = ray.cluster_resources().get("GPU", 0.0)
    if started_here and placement.gpus > cluster_gpus:
        raise ValueError(f"--gpus-per-actor {placement.gpus:g}: this machine has {cluster_gpus:g} GPUs for the "
                         "local Ray the job started, so no actor could start; pass --gpus-per-actor 0 (and --device "
                         "cpu or auto), or --address of a cluster with GPU nodes")
    if placement.auto and placement.gpus == 0 and not started_here:
        log.warning("the Ray cluster has no GPU now, so the actors reserve none and run on CPU; on an autoscaling "
                    "cluster whose GPU nodes are not up yet, pass --gpus-per-actor 1")
    return placement, started_here


def joined() -> bool:
    """Whether this process has joined a Ray cluster (started one, or connected to one)."""
    return ray.is_initialized()


def shutdown() -> None:
    """Disconnect from Ray (stopping a local one), so no late driver log follows the summary line."""
    if ray.is_initialized():
        ray.shutdown()


def _job_rows(prompts: PromptSpec | pa.Table, processor: Processor, limit: int | None, seed: int,
              source: Source | None, ledger=None) -> "ray.data.Dataset":
    """The job's rows: read, (--limit), one per sample; counted into a JobLedger (`read`, `samples`) when given.
    A small local dataset is read and sampled here (streams.read_here), the rest by Ray tasks."""
    if isinstance(prompts, PromptSpec) and prompts.kind == "files" and prompts.types is not None \
            and small_local(source := source or open_source(prompts)):
        table = read_here(prompts, source)
        if ledger and table.num_rows:  # not waited for: the ledger's process may still be starting; its later
            ids = table.column("id")   # calls from this driver run after this one
            ledger.count.remote("read", f"{ids[0]}|{ids[-1]}|{table.num_rows}", table.num_rows)
        ds = ray.data.read_datasource(TablePrompts(sample_here(table, limit, seed) if limit is not None else table),
                                      override_num_blocks=1)
    else:
        ds = ray.data.from_arrow(prompts) if isinstance(prompts, pa.Table) else read_prompts(prompts, source)
        if ledger:
            ds = ds.map_batches(counted(ledger, "read"), batch_format="pyarrow", batch_size=None)
        if limit is not None:
            ds = sample(ds, limit, seed)
    ds = processor.expand(ds)
    if ledger:
        ds = ds.map_batches(counted(ledger, "samples"), batch_format="pyarrow", batch_size=None)
    return ds


def data_of(prompts: PromptSpec | pa.Table, source: Source | None) -> tuple[str, str] | None:
    """(label, fingerprint) of the job's input for an auto bank's key: the task, a dataset's files (names and
    sizes), a hub dataset's id and split; None (the sampled prompts decide) for rows handed over in memory."""
    if isinstance(prompts, pa.Table):
        return None
    if prompts.task:
        return data_identity(prompts.task)
    if source is not None:
        infos = source.filesystem.get_file_info(list(source.files))
        return data_identity(None, [(source.label(i.path), i.size) for i in infos], prompts.uri)
    return data_identity(None, dataset=f"{prompts.uri}@{prompts.hub_config or ''}:{prompts.split}")


def _write_calibration_rows(location: Location, table: pa.Table) -> None:
    """The calibration's rollouts as one Parquet file of the output, whole or not at all (a local file appears
    by a rename from a name readers skip; an object store's put is atomic)."""
    name = f"calibration-{uuid.uuid4().hex[:16]}.parquet"
    target = location.child(name)
    tmp = location.child(f".{name}.tmp") if location.is_local else target
    location.make()
    pq.write_table(table, tmp, filesystem=location.filesystem)
    if tmp != target:
        location.filesystem.move(tmp, target)


def run_job(prompts: PromptSpec | pa.Table, job: JobConfig, processor: Processor, limit: int | None = None,
            seed: int = 123, started: float | None = None, source: Source | None = None,
            timeline: dict[str, float] | None = None) -> dict:
    """Generate for every prompt row (a spec's, streamed; or a small table's) not yet in job.output, write
    them there, and return the run's summary. `started` (unix seconds) is when the job began, for the wall
    time and the time to first row. An auto bank is calibrated first (Processor.calibrate); a greedy job's
    calibration rollouts are written as its rows for those prompts, and the pool decodes the rest. The summary's
    `ok` is false when the calibration failed and its fallback was not accepted (--allow-bank-fallback). Its
    `startup` is the job's start-up timeline (seconds since `started`): the driver's phases (`timeline`, the unix
    times of those that came before, added to) and each actor's (start_up_timeline)."""
    start = started or time.time()
    timeline = {} if timeline is None else timeline
    location = Location.of(job.output)
    connect(job, processor, location, timeline)
    if isinstance(prompts, PromptSpec) and prompts.kind == "files" and prompts.types is None:
        source = source or open_source(prompts)
        prompts = scan_files(prompts, source)  # once: the calibration's reading and the job's type alike
    ledger = JobLedger.options(**on_this_node()).remote()  # the head outlives workers
    ds = _job_rows(prompts, processor, limit, seed, source, ledger)
    calibration, finished = None, None
    if job.resume:
        finished = finished_keys_task.options(**on_this_node()).remote(location)
        log.warning("resume: %d rows already in %s are skipped", ray.get(finished[1]), location.uri)
    if processor.plan.calibrate:
        plain = _job_rows(prompts, processor, limit, seed, source)  # uncounted: the sample reads a few blocks
        if finished:
            plain = plain.map_batches(drop_finished(finished[0]), batch_format="pyarrow", batch_size=None)
        auto = processor.calibrate(plain, job.output, data_of(prompts, source))
        calibration, rows = auto.report, calibration_rows(auto)
        if rows is not None:
            _write_calibration_rows(location, rows)
            calibration["rows_reused"] = rows.num_rows
            finished = finished_keys_task.options(**on_this_node()).remote(location)  # now with those rows
    if finished:
        ds = ds.map_batches(drop_finished(finished[0]), batch_format="pyarrow", batch_size=None)
    processor.ledger = ledger
    timeline["planned"] = time.time()
    processor.decode(ds).write_parquet(location.path, filesystem=location.filesystem,
                                       min_rows_per_file=job.rows_per_file, mode=SaveMode.APPEND)
    read = ray.get(ledger.total.remote("read"))
    input_rows = min(read, limit) if limit is not None else read
    expected = ray.get(ledger.total.remote("samples"))
    summary = ray.get(summarize_task.options(**on_this_node()).remote(location, start, input_rows, expected))
    if calibration is not None:
        summary["calibration"] = calibration
    summary["ok"] = calibration_problem(calibration) is None
    summary["startup"] = start_up_timeline(start, timeline, ray.get(ledger.startup.remote()),
                                           summary.get("first_row_s"), ray.get(ledger.noted.remote()))
    return summary


def start_up_timeline(started: float, driver: dict[str, float], actors: dict[str, dict[str, float]],
                      first_row_s: float | None, notes: dict[str, dict[str, str]] | None = None) -> dict:
    """The job's start-up as seconds since `started`: the driver's phases (Ray up, the job's checks, the actors'
    dtype asked, the dataset planned), then each actor's in the order it started (process up, imports, bank,
    weights, decoder, kernels, warm-up, ready, its first request) with what it noted of its load (`notes`: where
    its step costs came from), and when the first row was written."""
    def since(marks: dict[str, float]) -> dict[str, float]:
        return {phase: round(at - started, 2) for phase, at in sorted(marks.items(), key=lambda kv: kv[1])}

    ordered = sorted(actors.items(), key=lambda kv: kv[1].get("process_up", 0.0))
    notes = notes or {}
    return {"driver": since(driver), "actors": [{"actor": actor[:12], **since(marks), **notes.get(actor, {})}
                                                for actor, marks in ordered],
            "first_row_s": first_row_s}
