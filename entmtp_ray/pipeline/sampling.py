"""Per-row sampling settings and several samples per prompt. Knows nothing about Ray or models.

A row may carry a `sampling_params` column (as `ray.data.llm`'s processors take it): an object (a Parquet
struct, a dict in a user's Dataset, or its JSON text in JSON lines and CSV) with any of SAMPLING_KEYS, the fields
of config.SamplingParams. Its values override the job's sampling settings for that row; a missing or null key
keeps the job's. The merged settings are checked as one SamplingParams (the engine's settings are the job's and
need no check); one that is not valid makes the row an error row that says why, and the job goes on.

`expand` turns each prompt row into `n` rows (the job's --n, or the row's own), one per sample, numbered by
SAMPLE_INDEX; a sample's key (`sample_key`) is its row id with `#<index>` after the first, and seeds its
generator, so every sample differs and each reproduces alone. --resume skips the (id, sample index) pairs
already written, so each sample is generated exactly once.
"""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.compute as pc
from pydantic import ValidationError

from entmtp_ray.config import DecodingConfig, SamplingParams
from entmtp_ray.pipeline.tasks import INTERNAL_COLUMNS

SAMPLING_COLUMN = "sampling_params"
SAMPLE_INDEX = "_sample_index"
SAMPLING = "_sampling"  # the row's overrides as JSON text, checked (null: the job's settings)
ROW_COLUMNS = (*INTERNAL_COLUMNS, SAMPLE_INDEX, SAMPLING)  # what an actor reads of an expanded row; not passed through
# the settings a row may set: a request's own (SamplingParams); vLLM's `max_tokens` is read as max_new_tokens
SAMPLING_KEYS = tuple(SamplingParams.model_fields)
ALIASES = {"max_tokens": "max_new_tokens"}
KEY_SEPARATOR = "#"


def sample_key(row_id: str | None, index: int) -> str | None:
    """The key a sample is seeded by: the row id for the first sample (as with --n 1), `<id>#<index>` after."""
    if row_id is None or index == 0:
        return row_id
    return f"{row_id}{KEY_SEPARATOR}{index}"


def output_keys(ids: pa.Array | pa.ChunkedArray, indices: pa.Array | pa.ChunkedArray | None) -> pa.Array:
    """`<id>#<sample index>` for output rows (an output without the column is all index 0): unique per sample,
    since the index after the last `#` is digits only."""
    if indices is None:
        indices = pa.array([0] * len(ids), pa.int64())
    return pc.binary_join_element_wise(ids, pc.cast(indices, pa.string()), KEY_SEPARATOR)


def parse_overrides(value) -> tuple[dict, str | None]:
    """A row's sampling_params value -> (the settings it sets, with null keys dropped and aliases resolved;
    the reason it is unusable, or None)."""
    if value is None:
        return {}, None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            return {}, f"{SAMPLING_COLUMN} is not valid JSON ({exc})"
    if value is None:
        return {}, None
    if not isinstance(value, dict):
        return {}, f"{SAMPLING_COLUMN} must be an object of settings, got {type(value).__name__}"
    overrides = {}
    for key, setting in value.items():
        if setting is None:
            continue
        name = ALIASES.get(key, key)
        if name not in SAMPLING_KEYS:
            return {}, (f"{SAMPLING_COLUMN}: unsupported setting '{key}'; a row may set "
                        f"{', '.join(SAMPLING_KEYS)} (or max_tokens)")
        if name in overrides:
            return {}, f"{SAMPLING_COLUMN}: both max_tokens and max_new_tokens given; give one"
        overrides[name] = setting
    if overrides.get("top_k") == -1:  # vLLM's "all tokens"
        overrides["top_k"] = 0
    return overrides, None


def row_decoding(job: DecodingConfig, overrides: dict) -> DecodingConfig:
    """The job's settings with a row's sampling overrides, checked as one SamplingParams (ValidationError says
    what is wrong). Acceptance follows the row's temperature where the job's cannot serve it: greedy acceptance
    with a row temperature above 0 becomes exact (the distribution-preserving default for sampling), unless the
    row names its acceptance."""
    if not overrides:
        return job
    merged = job.sampling().model_dump() | overrides
    if "acceptance" not in overrides and merged["acceptance"] == "greedy" and _positive(merged["temperature"]):
        merged["acceptance"] = None  # -> exact, by SamplingParams' rule
    return job.model_copy(update=SamplingParams(**merged).model_dump())


def _positive(value) -> bool:
    try:
        return float(value) > 0
    except (TypeError, ValueError):
        return False  # DecodingConfig says what is wrong with it


def explain(exc: ValidationError) -> str:
    """A pydantic error as one line a user can act on: `setting: problem; ...`."""
    parts = []
    for error in exc.errors():
        where = ".".join(str(p) for p in error["loc"])
        message = error["msg"].removeprefix("Value error, ")
        parts.append(f"{where}: {message}" if where else message)
    return f"{SAMPLING_COLUMN}: " + "; ".join(parts)


def check_row(job: DecodingConfig, value) -> tuple[dict, int, str | None]:
    """A row's sampling_params -> (its overrides, its number of samples, the reason it is an error row)."""
    overrides, problem = parse_overrides(value)
    if problem:
        return {}, 1, problem
    try:
        decoding = row_decoding(job, overrides)
    except ValidationError as exc:
        return {}, 1, explain(exc)
    return overrides, decoding.n, None


def expand(batch: pa.Table, job: DecodingConfig) -> pa.Table:
    """Prompt rows -> one row per sample, with SAMPLE_INDEX and SAMPLING added; a row whose sampling_params
    are unusable becomes one row whose `_input_error` says why (rows that already have an error stay one row)."""
    values = batch.column(SAMPLING_COLUMN).to_pylist() if SAMPLING_COLUMN in batch.column_names else \
        [None] * batch.num_rows
    errors = batch.column("_input_error").to_pylist()
    take, indices, sampling, new_errors = [], [], [], []
    for row, (value, error) in enumerate(zip(values, errors)):
        overrides, n, problem = check_row(job, value) if error is None else ({}, 1, None)
        for index in range(n):
            take.append(row)
            indices.append(index)
            sampling.append(json.dumps(overrides) if overrides else None)
            new_errors.append(error or problem)
    out = batch.take(pa.array(take, pa.int64())) if take != list(range(batch.num_rows)) else batch
    out = out.set_column(out.column_names.index("_input_error"), "_input_error", pa.array(new_errors, pa.string()))
    return out.append_column(SAMPLE_INDEX, pa.array(indices, pa.int64())).append_column(
        SAMPLING, pa.array(sampling, pa.string()))
