"""Dataset files on any filesystem, read as a stream of Arrow tables. Knows nothing about Ray or models.

A `--dataset` is a file, a folder (every .parquet/.jsonl/.json/.csv file under it, optionally .gz; names
starting with `_` or `.` skipped, as Ray and pyarrow skip them) or a glob (`data/part-*.parquet`), given as a
local path or a URI of any filesystem pyarrow knows (`file://`, `s3://`, `gs://`, `hdfs://`, `abfs://`) or
fsspec knows (`hf://datasets/...`, `memory://`, ...; fsspec's filesystems come wrapped for pyarrow). Only
the listing happens here on the caller; the records are read by whoever iterates `read_file`, one file at a
time, CHUNK_ROWS records per table.

Every table from `read_file` carries POS, the record's position in its file (0-based: a Parquet or CSV
row, a non-blank JSON line), from which a row without an id of its own gets one (tasks.position_ids).
A JSON line that cannot be read (not JSON, not an object, not valid Unicode) is a record with LINE_ERROR
saying why and LINE_ID, `<file>:line-<n>`, so that it becomes an error row instead of stopping a job.
"""

from __future__ import annotations

import csv
import fnmatch
import json
import posixpath
from dataclasses import dataclass
from typing import Iterator

import pyarrow as pa
import pyarrow.csv
import pyarrow.fs as pafs
import pyarrow.parquet as pq

CHUNK_ROWS = 4096  # records per table
CSV_BLOCK_BYTES = 4 << 20
POS = "_pos"
LINE_ERROR = "_line_error"
LINE_ID = "_line_id"
READER_COLUMNS = (POS, LINE_ERROR, LINE_ID)
FORMATS = {".parquet": "parquet", ".jsonl": "jsonl", ".json": "jsonl", ".csv": "csv"}
GLOB_CHARS = "*?["


def file_format(path: str) -> str | None:
    """'parquet', 'jsonl' or 'csv' from a file name (a .gz after .jsonl/.json/.csv is decompressed), else None."""
    name = path.lower()
    if name.endswith(".gz"):
        name = name[:-3]
        if name.endswith(".parquet"):
            return None
    return FORMATS.get(posixpath.splitext(name)[1])


def resolve_filesystem(uri: str) -> tuple[pafs.FileSystem, str]:
    """(filesystem, path inside it) for a local path or a URI pyarrow or fsspec understands."""
    try:
        return pafs.FileSystem.from_uri(uri)
    except (pa.ArrowInvalid, ValueError) as arrow_error:
        if "://" not in uri:  # a relative local path: from_uri wants absolute ones
            return pafs.LocalFileSystem(), posixpath.abspath(uri) if not uri.startswith("~") else uri
        try:
            import fsspec
            from fsspec.core import url_to_fs

            fs, path = url_to_fs(uri)
        except (ImportError, ValueError) as exc:
            raise ValueError(f"{uri}: no filesystem for this URI ({arrow_error}; fsspec: {exc}); install the "
                             "fsspec package of its scheme (s3fs, gcsfs, huggingface_hub, ...)") from exc
        assert isinstance(fs, fsspec.AbstractFileSystem)
        return pafs.PyFileSystem(pafs.FSSpecHandler(fs)), path


def _hidden(relative: str) -> bool:
    return any(part.startswith(("_", ".")) for part in relative.split("/"))


@dataclass(frozen=True)
class Source:
    """A dataset resolved to its filesystem and files (listing only: nothing is read)."""

    uri: str
    filesystem: pafs.FileSystem
    files: tuple[str, ...]  # paths inside `filesystem`, sorted
    base: str | None  # the folder (or a glob's fixed prefix) file labels are relative to; None: one file given

    def label(self, file: str) -> str:
        return file_label(self.base, file)


def file_label(base: str | None, file: str) -> str:
    """How ids name `file`: its path relative to `base` (the folder or glob given), or '' when one file was
    given (base None)."""
    if base is None:
        return ""
    return posixpath.relpath(file, base) if base else file


def list_source(uri: str) -> Source:
    """The files of a dataset: a file, a folder (recursively) or a glob; ValueError naming the fix if none."""
    glob_at = min((uri.index(c) for c in GLOB_CHARS if c in uri), default=None)
    if glob_at is None:
        fs, path = resolve_filesystem(uri)
    else:  # URI parsers refuse glob characters: resolve the fixed part, then put the pattern back
        fs, path = resolve_filesystem(uri[:glob_at])
        fixed = uri[:glob_at]
        path = path.rstrip("/") + ("/" if not fixed or fixed.endswith("/") else "") + uri[glob_at:]
    if glob_at is not None:
        fixed = path[:min(path.index(c) for c in GLOB_CHARS if c in path)]
        base = fixed.rsplit("/", 1)[0] if "/" in fixed else ""
        selector = pafs.FileSelector(base or "/", recursive=True, allow_not_found=True)
        infos = fs.get_file_info(selector)
        files = [i.path for i in infos if i.type == pafs.FileType.File and fnmatch.fnmatchcase(i.path, path)
                 and file_format(i.path) and not _hidden(posixpath.relpath(i.path, base or "/"))]
        if not files:
            raise ValueError(f"--dataset {uri}: the pattern matches no file")
        return _one_kind(Source(uri, fs, tuple(sorted(files)), base))
    info = fs.get_file_info(path)
    if info.type == pafs.FileType.NotFound:
        raise ValueError(f"--dataset {uri}: no such file or directory")
    if info.type == pafs.FileType.File:
        if file_format(path) is None:
            raise ValueError(f"--dataset {uri}: unknown file type; use .parquet, .jsonl/.json or .csv (.gz allowed "
                             "for JSON lines and CSV)")
        return Source(uri, fs, (path,), None)
    infos = fs.get_file_info(pafs.FileSelector(path, recursive=True))
    files = [i.path for i in infos if i.type == pafs.FileType.File and file_format(i.path)
             and not _hidden(posixpath.relpath(i.path, path))]
    if not files:
        raise ValueError(f"--dataset {uri}: the folder holds no .parquet, .jsonl/.json or .csv file")
    return _one_kind(Source(uri, fs, tuple(sorted(files)), path))


def _one_kind(source: Source) -> Source:
    """Refuse Parquet beside JSON lines or CSV: Parquet keeps its column types, the text formats give text,
    and one column of both kinds would stop the job where Ray joins their blocks."""
    kinds = {file_format(f) == "parquet" for f in source.files}
    if len(kinds) > 1:
        raise ValueError(f"--dataset {source.uri} holds both Parquet and JSON lines/CSV files; pass one kind "
                         "(a glob such as 'folder/*.parquet')")
    return source


def open_file(fs: pafs.FileSystem, path: str):
    """The file opened as `read_file` wants it: random access for Parquet, a (decompressed) stream otherwise."""
    if file_format(path) == "parquet":
        return fs.open_input_file(path)
    return fs.open_input_stream(path, compression="gzip" if path.lower().endswith(".gz") else None)


def read_file(f, path: str, label: str | None = None, text_columns: tuple[str, ...] = (),
              types: dict[str, str] | None = None, scan: "ColumnScan | None" = None) -> Iterator[pa.Table]:
    """The records of one opened file (`open_file`), CHUNK_ROWS at a time, each table with POS (and for
    JSON lines LINE_ERROR/LINE_ID). `label` names the file in the ids of unreadable lines (empty or None: its
    base name). In JSON lines, a value of a `text_columns` column that is not a string is read as null, and
    its record's LINE_ERROR says what it was. JSON lines and CSV columns take the KINDS in `types` (a scan of
    every file, `ColumnScan`, so that every chunk of every file agrees), else those of each chunk's own values;
    `scan`, when given, sees every chunk's values first."""
    fmt = file_format(path)
    if fmt == "parquet":
        start = 0
        for batch in pq.ParquetFile(f).iter_batches(batch_size=CHUNK_ROWS):
            table = pa.Table.from_batches([batch])
            yield table.append_column(POS, pa.array(range(start, start + table.num_rows), pa.int64()))
            start += table.num_rows
    elif fmt == "csv":
        yield from _read_csv(f, path, label or posixpath.basename(path), text_columns, types, scan)
    elif fmt == "jsonl":
        yield from _read_jsonl(f, label or posixpath.basename(path), text_columns, types, scan)
    else:
        raise ValueError(f"{path}: unknown file type; use .parquet, .jsonl/.json or .csv")


class _Prefixed:
    """A file-like object that reads `head` first, then the rest of stream `f` (the header was peeked)."""

    def __init__(self, head: bytes, f):
        self._head, self._f = head, f
        self.closed = False

    def read(self, n: int = -1) -> bytes:
        if self._head:
            out, self._head = (self._head, b"") if n is None or n < 0 or n >= len(self._head) else \
                (self._head[:n], self._head[n:])
            return out
        return self._f.read() if n is None or n < 0 else self._f.read(n)

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        self.closed = True


def _read_csv(f, path: str, label: str, text_columns: tuple[str, ...], types: dict[str, str] | None,
              scan: "ColumnScan | None") -> Iterator[pa.Table]:
    """CSV rows: every field read as text, then each column converted to its kind (`read_file`; an empty field of
    a number or boolean column is null)."""
    head = b""
    while b"\n" not in head:
        chunk = f.read(1 << 16)
        if not chunk:
            break
        head += chunk
    if not head.strip():
        return
    names = next(csv.reader([head.split(b"\n", 1)[0].decode("utf-8-sig", errors="replace")]))
    convert = pyarrow.csv.ConvertOptions(column_types={name: pa.string() for name in names})
    start = 0
    try:
        reader = pyarrow.csv.open_csv(_Prefixed(head, f), read_options=pyarrow.csv.ReadOptions(block_size=CSV_BLOCK_BYTES),
                                      convert_options=convert)
        for batch in reader:
            for offset in range(0, batch.num_rows, CHUNK_ROWS):
                table = pa.Table.from_batches([batch.slice(offset, CHUNK_ROWS)])
                columns = {name: table.column(name).to_pylist() for name in table.column_names}
                lines = [f"row {start + i + 1}" for i in range(table.num_rows)] if scan is not None else []
                kinds = _chunk_kinds(columns, csv_kind, text_columns, types, scan, label, lines)
                table = pa.table({name: _csv_array(values, kinds[name]) for name, values in columns.items()})
                yield table.append_column(POS, pa.array(range(start, start + table.num_rows), pa.int64()))
                start += table.num_rows
    except pa.ArrowInvalid as exc:  # Arrow's CSV reader has no per-row recovery
        raise ValueError(f"{path}: unreadable CSV after row {start} ({exc}); CSV input must be UTF-8 with the "
                         "same number of fields on every line: convert it to JSON lines, whose bad lines become "
                         "error rows, or to Parquet") from exc


def _lines(f) -> Iterator[bytes]:
    pending = b""
    while True:
        chunk = f.read(1 << 20)
        if not chunk:
            break
        pending += chunk
        *complete, pending = pending.split(b"\n")
        yield from complete
    if pending:
        yield pending


def _read_jsonl(f, label: str, text_columns: tuple[str, ...], types: dict[str, str] | None,
                scan: "ColumnScan | None") -> Iterator[pa.Table]:
    rows: list[dict] = []
    lines: list[str] = []
    position = 0
    for number, raw in enumerate(_lines(f), start=1):
        if not raw.strip():
            continue
        row = parse_json_line(raw, number, label)
        for column in text_columns:
            value = row.get(column)
            if value is not None and not isinstance(value, str):
                row[column] = None
                row.setdefault(LINE_ERROR, f"{column} must be a string, got {type(value).__name__}")
        rows.append(row | {POS: position})
        if scan is not None:  # where a scan's warning points
            lines.append(f"line {number}")
        position += 1
        if len(rows) == CHUNK_ROWS:
            yield _table_from_rows(rows, text_columns, types, scan, label, lines)
            rows, lines = [], []
    if rows:
        yield _table_from_rows(rows, text_columns, types, scan, label, lines)


def parse_json_line(raw: bytes, number: int, label: str) -> dict:
    """One JSON line -> its object, or {LINE_ERROR, LINE_ID} when it is not JSON, not an object, or holds
    text that is not valid Unicode (bytes that are not UTF-8, an escaped lone surrogate)."""
    problem = None
    try:
        row = json.loads(raw.decode("utf-8"))
        json.dumps(row, ensure_ascii=False).encode("utf-8")  # what Arrow will need
    except json.JSONDecodeError as exc:
        problem = f"not valid JSON ({exc})"
    except UnicodeError as exc:
        problem = f"text that is not valid Unicode ({exc.reason})"
    if problem is None and not isinstance(row, dict):
        problem = "not a JSON object"
    if problem:
        return {LINE_ERROR: f"line {number} of {label} is {problem}", LINE_ID: f"{label}:line-{number}"}
    return row


def _table_from_rows(rows: list[dict], text_columns: tuple[str, ...], types: dict[str, str] | None,
                     scan: "ColumnScan | None", label: str, lines: list[str]) -> pa.Table:
    """Arrow table of JSON objects (columns: the union of their keys), each column of its kind (`read_file`):
    numbers, booleans and strings as themselves, a text column's other values and nested lists and objects as
    their JSON text, null as null."""
    keys = list(dict.fromkeys(k for r in rows for k in r if k != POS))
    columns = {key: [r.get(key) for r in rows] for key in keys}
    kinds = _chunk_kinds(columns, json_kind, text_columns, types, scan, label, lines)
    table = {key: _json_array(values, kinds[key]) for key, values in columns.items()}
    if rows and POS in rows[0]:
        table[POS] = pa.array([r[POS] for r in rows], pa.int64())
    return pa.table(table)


def _text(value) -> str | None:
    return value if value is None or isinstance(value, str) else json.dumps(value, ensure_ascii=False)


# ---- column kinds ------------------------------------------------------------------------------------
# A column of JSON lines or CSV takes the kind (null, bool, int, float, string, nested, text) of its values over
# every file (the job's scan, `ColumnScan`):
# null gives way to any other kind and int to float, as pyarrow's permissive schema unification promotes;
# values of kinds that do not merge (a number in one place, a string in another) make the column text. A
# stream of chunks typed each from its own values would clash wherever Ray joins blocks or a reader opens the
# output's files together. Nested lists and objects are kept as JSON text. Parquet inputs keep their types.
_ARROW = {"bool": pa.bool_(), "int": pa.int64(), "float": pa.float64()}  # every other kind is a string column
_INT64 = (-(1 << 63), (1 << 63) - 1)
_CSV_BOOLS = {"true": True, "false": False}


def json_kind(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int" if _INT64[0] <= value <= _INT64[1] else "text"
    if isinstance(value, float):
        return "float"
    return "string" if isinstance(value, str) else "nested"


def csv_kind(value: str | None) -> str:
    """The kind of a CSV field, as pyarrow's CSV reader would infer it: empty is null, then int, float, bool."""
    if value is None or value == "":
        return "null"
    try:
        return "int" if _INT64[0] <= int(value) <= _INT64[1] else "text"
    except ValueError:
        pass
    try:
        float(value)
        return "float"
    except ValueError:
        return "bool" if value.lower() in _CSV_BOOLS else "string"


def merge_kinds(a: str, b: str) -> str:
    """The kind of a column holding values of kinds a and b."""
    if a == b or b == "null":
        return a
    if a == "null":
        return b
    return "float" if {a, b} == {"int", "float"} else "text"


def _chunk_kinds(columns: dict[str, list], kind_of, text_columns: tuple[str, ...], types: dict[str, str] | None,
                 scan: "ColumnScan | None", label: str, lines: list[str]) -> dict[str, str]:
    """Each column's kind for this chunk: the job's scan's (`types`); while scanning (`scan`), the scan's so far,
    which hold this chunk's values; else the chunk's own values'."""
    if scan is not None:
        scan.add(columns, kind_of, text_columns, label, lines)
        types = scan.kinds
    kinds = {}
    for name, values in columns.items():
        if name in text_columns:
            kinds[name] = "string"
        elif types is not None and name in types:
            kinds[name] = types[name]
        else:
            kind = "null"
            for value in values:
                kind = merge_kinds(kind, kind_of(value))
            kinds[name] = kind
    return kinds


def _json_array(values: list, kind: str) -> pa.Array:
    if kind == "float":
        return pa.array([None if v is None else float(v) for v in values], pa.float64())
    if kind in _ARROW:
        return pa.array(values, _ARROW[kind])
    return pa.array([_text(v) for v in values], pa.string())


def _csv_array(values: list, kind: str) -> pa.Array:
    if kind == "int":
        return pa.array([int(v) if v else None for v in values], pa.int64())
    if kind == "float":
        return pa.array([float(v) if v else None for v in values], pa.float64())
    if kind == "bool":
        return pa.array([_CSV_BOOLS[v.lower()] if v else None for v in values], pa.bool_())
    return pa.array(values, pa.string())


class ColumnScan:
    """The kinds of a dataset's columns over every chunk it sees (`read_file(scan=...)`), and where each column
    that became text first met a value of another kind."""

    def __init__(self):
        self.kinds: dict[str, str] = {}
        self.changed: dict[str, str] = {}  # column -> "a number, then a string at <file> line <n>"

    def add(self, columns: dict[str, list], kind_of, text_columns: tuple[str, ...], label: str,
            lines: list[str]) -> None:
        for name, values in columns.items():
            if name in text_columns or self.kinds.get(name) == "text":
                continue
            kind = self.kinds.get(name, "null")
            for value, line in zip(values, lines):
                value_kind = kind_of(value)
                merged = merge_kinds(kind, value_kind)
                if merged == "text" and kind != "text":
                    self.changed[name] = f"{kind} values, then {value_kind} at {label} {line}"
                    kind = merged
                    break
                kind = merged
            self.kinds[name] = kind

    def merge(self, other: "ColumnScan") -> None:
        """Add a later file's scan (files scanned apart, in order)."""
        for name, kind in other.kinds.items():
            mine = self.kinds.get(name, "null")
            merged = merge_kinds(mine, kind)
            if merged == "text" and mine != "text" and name not in self.changed:
                self.changed[name] = other.changed.get(name) or f"{mine} values, then {kind} in a later file"
            self.kinds[name] = merged

    def warnings(self) -> dict[str, str]:
        """Per column that became text, the warning that says so and where."""
        return {name: f"column {name!r} holds {how}: its values are written as text"
                for name, how in self.changed.items()}


def scan_source(source: "Source", text_columns: tuple[str, ...]) -> ColumnScan:
    """The column kinds over every file of a source, read here one file after another (the Ray job scans its
    files in parallel tasks instead, streams.read_prompts)."""
    scan = ColumnScan()
    for file in source.files:
        scan.merge(scan_file(source.filesystem, file, source.label(file), text_columns))
    return scan


def scan_file(fs: pafs.FileSystem, path: str, label: str, text_columns: tuple[str, ...]) -> ColumnScan:
    """The column kinds of one file (Parquet files carry their own: an empty scan)."""
    scan = ColumnScan()
    if file_format(path) != "parquet":
        with open_file(fs, path) as f:
            for _ in read_file(f, path, label, text_columns, scan=scan):
                pass
    return scan


def peek_columns(source: Source) -> list[str]:
    """The column names of the source's first file's first chunk (reads one chunk: for early checks)."""
    with open_file(source.filesystem, source.files[0]) as f:
        for table in read_file(f, source.files[0]):
            return [c for c in table.column_names if c not in READER_COLUMNS]
    return []


@dataclass(frozen=True)
class Location:
    """A folder on any filesystem (the output of a job): the few operations the job, its summary, --resume
    and the manifest need, so that a local path and an `s3://` URI behave alike."""

    uri: str
    filesystem: pafs.FileSystem
    path: str

    @classmethod
    def of(cls, uri: "str | Location") -> "Location":
        if isinstance(uri, Location):
            return uri
        fs, path = resolve_filesystem(uri)
        return cls(uri, fs, path.rstrip("/") or path)

    @property
    def is_local(self) -> bool:
        return isinstance(self.filesystem, pafs.LocalFileSystem)

    def sub(self, name: str) -> "Location":
        """The folder `name` inside this one, on the same filesystem."""
        return Location(f"{self.uri.rstrip('/')}/{name}", self.filesystem, self.child(name))

    def child(self, name: str) -> str:
        return f"{self.path}/{name}"

    def exists(self, name: str | None = None) -> bool:
        return self.filesystem.get_file_info(self.child(name) if name else self.path).type != pafs.FileType.NotFound

    def make(self) -> None:
        self.filesystem.create_dir(self.path, recursive=True)

    def read_text(self, name: str) -> str:
        with self.filesystem.open_input_stream(self.child(name)) as f:
            return f.read().decode("utf-8")

    def write_text(self, name: str, text: str) -> None:
        """Write a file whole: locally through a temporary name and a rename; on object stores a put is
        atomic already."""
        target = self.child(name)
        tmp = target + ".tmp" if self.is_local else target
        with self.filesystem.open_output_stream(tmp) as f:
            f.write(text.encode("utf-8"))
        if tmp != target:
            self.filesystem.move(tmp, target)

    def delete(self, name: str) -> None:
        self.filesystem.delete_file(self.child(name))

    def parquet_files(self) -> list[str]:
        """The Parquet files directly in the folder (not in `_`/`.` subfolders), sorted."""
        if self.filesystem.get_file_info(self.path).type != pafs.FileType.Directory:
            return []
        infos = self.filesystem.get_file_info(pafs.FileSelector(self.path, recursive=False))
        return sorted(i.path for i in infos if i.type == pafs.FileType.File and i.base_name.endswith(".parquet")
                      and not i.base_name.startswith(("_", ".")))

    def set_aside(self, file: str, folder: str = ".unreadable") -> str:
        """Move `file` (a path inside the folder) into a subfolder that readers skip; returns where it went."""
        aside = self.child(folder)
        self.filesystem.create_dir(aside, recursive=True)
        target = f"{aside}/{posixpath.basename(file)}"
        self.filesystem.move(file, target)
        return target
