"""What a job wrote, read through the output's own filesystem (sources.Location): the ids already done, the
run's summary, and the checks before a run starts. No Ray here: the job runs these in tasks on the driver's
node (pipeline/dataplane.py), tests and tools call them directly."""

from __future__ import annotations

import logging
import os
import time
import uuid

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
import pyarrow.parquet as pq

from entmtp_ray.pipeline.sampling import output_keys
from entmtp_ray.pipeline.sources import Location

log = logging.getLogger(__name__)

SUMMARY_COLUMNS = ["id", "num_output_tokens", "steps", "verified_nodes", "error", "started_at", "total_s"]


def readable_files(location: Location) -> list[str]:
    """The output's Parquet files; a file a stopped job left cut short is moved aside into `.unreadable/`
    (its rows are generated again)."""
    files = []
    for file in location.parquet_files():
        try:
            with location.filesystem.open_input_file(file) as f:
                pq.read_metadata(f)
            files.append(file)
        except (pa.ArrowInvalid, OSError) as exc:
            target = location.set_aside(file)
            log.warning("moved unreadable %s aside to %s (%s); its rows will be regenerated", file, target, exc)
    return files


def finished_keys(output: str | Location) -> pa.Array:
    """The distinct samples already written to the output, as `<id>#<sample index>` (sampling.output_keys;
    readable files only)."""
    location = Location.of(output)
    files = readable_files(location)
    if not files:
        return pa.array([], pa.string())
    dataset = pads.dataset(files, filesystem=location.filesystem, format="parquet")
    has_index = "sample_index" in dataset.schema.names
    return pc.unique(_keys(dataset.to_table(columns=["id", "sample_index"] if has_index else ["id"]), has_index))


def _keys(batch: pa.Table | pa.RecordBatch, has_index: bool) -> pa.Array:
    """The sample keys of `batch`; an output written before --n has no sample_index."""
    return output_keys(batch.column("id"), batch.column("sample_index") if has_index else None)


def summarize(output: str | Location, started: float, input_rows: int, expected_rows: int | None = None) -> dict:
    """The run's JSON summary, from everything written to the output, scanned batch by batch. `expected_rows`:
    the output rows the input asks for (its rows times their samples; default input_rows)."""
    location = Location.of(output)
    files = readable_files(location)
    rows = errors = tokens = steps = nodes = accepted = 0
    first_start, last_end, first_row_end = None, None, None
    keys, usage = [], []
    if files:
        dataset = pads.dataset(files, filesystem=location.filesystem, format="parquet")
        # columns an older release did not write: no samples, accepted drafts derived from the step counts
        columns = SUMMARY_COLUMNS + [c for c in ("sample_index", "num_accepted_tokens", "tree_usage")
                                     if c in dataset.schema.names]
        for batch in dataset.to_batches(columns=columns):
            rows += batch.num_rows
            keys.append(_keys(batch, "sample_index" in columns))
            ok = batch.filter(pc.is_null(batch.column("error")))
            errors += batch.num_rows - ok.num_rows
            if not ok.num_rows:
                continue
            batch_tokens = pc.sum(ok.column("num_output_tokens")).as_py() or 0
            batch_steps = pc.sum(ok.column("steps")).as_py() or 0
            tokens, steps = tokens + batch_tokens, steps + batch_steps
            nodes += pc.sum(ok.column("verified_nodes")).as_py() or 0
            if "tree_usage" in columns:
                usage.append(tree_steps(ok.column("tree_usage")))
            if "num_accepted_tokens" in columns:
                accepted += pc.sum(ok.column("num_accepted_tokens")).as_py() or 0
            else:  # each step's tokens but its bonus, each row's but its prefill's
                accepted += batch_tokens - ok.num_rows - batch_steps
            ends = pc.add(ok.column("started_at"), ok.column("total_s"))
            first_start = _min(first_start, pc.min(ok.column("started_at")).as_py())
            last_end = _max(last_end, pc.max(ends).as_py())
            this_run = pc.filter(ends, pc.greater_equal(ok.column("started_at"), started))
            if len(this_run):
                first_row_end = _min(first_row_end, pc.min(this_run).as_py())
    distinct = pc.count_distinct(pa.chunked_array(keys, pa.string())).as_py() if keys else 0
    done = rows - errors
    span = (last_end - first_start) if done else 0.0
    return {
        "rows": rows,
        "input_rows": input_rows,
        "expected_rows": input_rows if expected_rows is None else expected_rows,  # input rows x their samples
        "duplicates": rows - distinct,  # rows beyond one per (id, sample_index)
        "errors": errors,
        "output_tokens": tokens,
        "aggregate_tokens_per_s": tokens / span if span > 0 else 0.0,
        # each row's first token comes from its prefill, not from a step
        "mean_accepted_length": (tokens - done) / steps if steps else None,
        # the rows' num_draft_tokens and num_accepted_tokens, added up
        "num_draft_tokens": nodes - steps,
        "num_accepted_tokens": accepted,
        "acceptance_rate": accepted / (nodes - steps) if nodes > steps else None,
        "tree_usage": _tree_usage(usage),  # the tree mix: steps each tree ran, over every row, most first
        "decode_span_s": span,
        "wall_s": time.time() - started,
        "first_row_s": first_row_end - started if first_row_end is not None else None,  # job start -> first row
        "output": location.uri if not location.is_local else os.path.abspath(location.path),
    }


def tree_steps(usage: pa.Array) -> pa.Table:
    """The (tree, steps) entries of rows' tree_usage maps, as a table; through a list of structs, since a map
    array's `keys` and `items` are its whole buffers, also where the array is a slice of them."""
    entries = usage.cast(pa.list_(pa.struct([usage.type.key_field, usage.type.item_field]))).flatten()
    return pa.table({"tree": entries.field(0), "steps": entries.field(1)})


def _tree_usage(parts: list[pa.Table]) -> dict[str, int]:
    if not parts:
        return {}
    steps = pa.concat_tables(parts).group_by("tree").aggregate([("steps", "sum")]).to_pylist()
    return {row["tree"]: row["steps_sum"] for row in sorted(steps, key=lambda row: (-row["steps_sum"], row["tree"]))}


def _min(a, b):
    return b if a is None else min(a, b)


def _max(a, b):
    return b if a is None else max(a, b)


def check_output(location: Location, resume: bool) -> None:
    """Fail before any work if the output cannot be written, or would mix two runs."""
    try:
        location.make()
        probe = f".probe-{uuid.uuid4().hex}"
        location.write_text(probe, "")
        location.delete(probe)
    except OSError as exc:
        raise ValueError(f"--output {location.uri}: not writable ({exc}); pass a folder (or URI) you can write "
                         "to") from exc
    if not resume and location.parquet_files():
        raise ValueError(f"--output {location.uri} already holds Parquet files; pass --resume to complete that run, "
                         "or choose an empty --output")
