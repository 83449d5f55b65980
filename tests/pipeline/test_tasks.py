"""Prompt sources: named tasks, user datasets in every format, ids, chat rows and sampling."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.csv
import pyarrow.parquet as pq
import pytest

from entmtp_ray.pipeline.tasks import iter_sharegpt, load_prompts

GSM8K = Path(__file__).resolve().parents[1] / "fixtures" / "gsm8k_train_200.jsonl"  # GSM8K train's first 200 lines


@pytest.fixture
def gsm8k_path():
    return str(GSM8K)


def test_gsm8k_from_local_copy(gsm8k_path):
    table = load_prompts("gsm8k", gsm8k_path)
    assert table.num_rows == 200
    first = table.slice(0, 1).to_pylist()[0]
    assert first["id"] == "row-0000000" and first["prompt"].startswith("Natalia sold clips")
    assert first["answer"].endswith("#### 72") and "question" not in table.column_names


def test_the_prompt_column_a_user_names_is_the_question_a_task_formats(tmp_path):
    """--task gsm8k --dataset F --prompt-column text: the named column is the question (the task still chooses the
    formatting and the bank); without it the error names both ways out."""
    records = [json.loads(line) for line in GSM8K.read_text().splitlines()[:3]]
    path = tmp_path / "mine.jsonl"
    path.write_text("".join(json.dumps({"uid": f"q{i}", "text": r["question"], "keep_me": i}) + "\n"
                            for i, r in enumerate(records)))
    table = load_prompts("gsm8k", str(path), prompt_column="text", id_column="uid")
    assert table.column("id").to_pylist() == ["q0", "q1", "q2"]
    assert table.column("prompt").to_pylist() == load_prompts("gsm8k", str(GSM8K)).column("prompt").to_pylist()[:3]
    assert "text" not in table.column_names and "keep_me" in table.column_names
    with pytest.raises(ValueError, match=r"no column 'question'.*--prompt-column NAME.*a GSM8K file with a 'question'"):
        load_prompts("gsm8k", str(path))
    with pytest.raises(ValueError, match=r"no column 'texts'.*--prompt-column NAME"):
        load_prompts("gsm8k", str(path), prompt_column="texts")


def test_limit_sample_is_deterministic_and_seeded(gsm8k_path):
    a = load_prompts("gsm8k", gsm8k_path, limit=20, seed=123).column("id").to_pylist()
    b = load_prompts("gsm8k", gsm8k_path, limit=20, seed=123).column("id").to_pylist()
    c = load_prompts("gsm8k", gsm8k_path, limit=20, seed=7).column("id").to_pylist()
    assert a == b and a != c and len(set(a)) == 20 and a == sorted(a)


def test_humaneval_problems():
    table = load_prompts("humaneval", None)
    rows = table.to_pylist()
    assert len(rows) == 164 and rows[0]["id"] == "HumanEval/0"
    assert rows[0]["input_prompt"] in rows[0]["prompt"] and "```python" in rows[0]["prompt"]
    assert {"canonical_solution", "test", "entry_point"} <= set(table.column_names)


def test_sharegpt_recovers_complete_conversations_before_the_cut():
    assert sum(1 for _ in iter_sharegpt()) == 17671
    table = load_prompts("sharegpt", None)
    ids = table.column("id").to_pylist()
    assert len(ids) == len(set(ids)) > 17000
    assert all(p.strip() for p in table.column("prompt").to_pylist())


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "csv"])
def test_user_dataset_formats_keep_columns(tmp_path, fmt):
    rows = [{"key": f"k{i}", "question": f"What is {i}+{i}?", "meta": i} for i in range(5)]
    path = tmp_path / f"data.{fmt}"
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif fmt == "parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        pyarrow.csv.write_csv(pa.Table.from_pylist(rows), path)
    table = load_prompts(None, str(path), prompt_column="question", id_column="key")
    out = table.to_pylist()
    assert [r["id"] for r in out] == [f"k{i}" for i in range(5)]
    # every format keeps its types (JSON lines and CSV: one scan of every value first)
    assert out[3]["prompt"] == "What is 3+3?" and out[3]["meta"] == 3
    assert "question" not in table.column_names and "key" not in table.column_names


def test_generated_ids_and_bad_prompts_become_input_errors(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [{"prompt": "ok"}, {"prompt": 5}, {"prompt": None}, {}]) + "\n")
    rows = load_prompts(None, str(path)).to_pylist()
    assert [r["id"] for r in rows] == ["row-0000000", "row-0000001", "row-0000002", "row-0000003"]
    assert rows[0]["_input_error"] is None
    assert "must be a string, got int" in rows[1]["_input_error"]
    assert "missing" in rows[2]["_input_error"] and "missing" in rows[3]["_input_error"]


def test_messages_column(tmp_path):
    path = tmp_path / "chats.jsonl"
    chats = [
        {"conv": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"},
                  {"from": "human", "value": "Tell me a joke."}, {"from": "gpt", "value": "..."}]},
        {"conv": [{"role": "user", "content": "Only turn"}]},
        {"conv": []},
    ]
    path.write_text("".join(json.dumps(c) + "\n" for c in chats))
    rows = load_prompts(None, str(path), messages_column="conv").to_pylist()
    assert rows[0]["prompt"] == "Tell me a joke." and len(json.loads(rows[0]["_messages"])) == 3
    assert json.loads(rows[1]["_messages"]) == [{"role": "user", "content": "Only turn"}]
    assert "non-empty list" in rows[2]["_input_error"]


@pytest.mark.parametrize("kwargs, message", [
    ({"task": "nope", "dataset": None}, "unknown task 'nope'"),
    ({"task": None, "dataset": None}, "pass --task NAME or --dataset"),
    ({"task": None, "dataset": "/no/such/file.jsonl"}, "no such file"),
    ({"task": None, "dataset": "no-such-org/no-such-dataset"}, "pass a local Parquet/JSONL/CSV path"),
])
def test_bad_sources_name_the_fix(kwargs, message):
    with pytest.raises(ValueError, match=message):
        load_prompts(**kwargs)


def test_missing_prompt_column_and_duplicate_ids(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"q": "a", "k": 1}\n{"q": "b", "k": 1}\n')
    with pytest.raises(ValueError, match="no column 'prompt'.*--prompt-column"):
        load_prompts(None, str(path))
    with pytest.raises(ValueError, match="ids are not unique"):
        load_prompts(None, str(path), prompt_column="q", id_column="k")


def test_malformed_jsonl_lines_become_error_rows(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "fine"}\n{broken\n[1, 2]\n{"prompt": "also fine"}\n')
    rows = load_prompts(None, str(path)).to_pylist()
    assert [r["prompt"] for r in rows] == ["fine", None, None, "also fine"]
    assert "line 2" in rows[1]["_input_error"] and "not valid JSON" in rows[1]["_input_error"]
    assert "not a JSON object" in rows[2]["_input_error"]
    assert rows[0]["_input_error"] is None and "_line_error" not in rows[0]


def test_tune_and_eval_subsets_partition_every_task(gsm8k_path):
    from entmtp_ray.pipeline.tasks import humaneval_tune_ids

    for task, dataset in [("gsm8k", gsm8k_path), ("humaneval", None)]:
        every = set(load_prompts(task, dataset).column("id").to_pylist())
        tune = set(load_prompts(task, dataset, subset="tune").column("id").to_pylist())
        held = set(load_prompts(task, dataset, subset="eval").column("id").to_pylist())
        assert tune | held == every and not tune & held
    assert held == every - humaneval_tune_ids() and len(held) == 80
    gsm_held = load_prompts("gsm8k", gsm8k_path, subset="eval").num_rows
    assert 0.07 < gsm_held / 200 < 0.13  # one row in ten, by hash
    # a sample of the eval subset never leaves it, whatever the limit
    sampled = set(load_prompts("gsm8k", gsm8k_path, subset="eval", limit=20).column("id").to_pylist())
    assert len(sampled) == 20 and sampled <= set(load_prompts("gsm8k", gsm8k_path, subset="eval").column("id").to_pylist())
    with pytest.raises(ValueError, match="unknown subset"):
        load_prompts("humaneval", None, subset="test")


def test_a_task_with_a_dataset_reads_the_dataset_formatted_as_the_task(tmp_path):
    """--task T --dataset D: D's rows (never the task's own prompts), formatted as T formats its own."""
    from entmtp_ray.pipeline.tasks import HUMANEVAL_INSTRUCTION

    data = tmp_path / "mine.jsonl"
    data.write_text("".join(json.dumps({"uid": f"u{i}", "text": f"def f{i}():"}) + "\n" for i in range(3)))
    chat = load_prompts("sharegpt", str(data), prompt_column="text", id_column="uid")
    assert chat.column("id").to_pylist() == ["u0", "u1", "u2"]
    assert chat.column("prompt").to_pylist() == ["def f0():", "def f1():", "def f2():"]
    code = load_prompts("humaneval", str(data), prompt_column="text", id_column="uid")
    assert code.column("prompt").to_pylist()[1] == HUMANEVAL_INSTRUCTION.format(prompt="def f1():")
    assert code.num_rows == 3 and "HumanEval/0" not in code.column("id").to_pylist()


def test_unreadable_lines_become_error_rows_with_unique_stable_ids(tmp_path):
    data = tmp_path / "messy.jsonl"
    lines = [json.dumps({"uid": "a", "text": "fine"}), "{not json", json.dumps({"uid": "b", "text": "fine too"}),
             "[1, 2]", '{"uid": "c", "text": "lone \\ud800 surrogate"}']
    data.write_bytes(("\n".join(lines) + "\n").encode() + b'{"uid": "d", "text": "\xff bytes"}\n')
    table = load_prompts(None, str(data), prompt_column="text", id_column="uid")
    rows = {r["id"]: r for r in table.select(["id", "prompt", "_input_error"]).to_pylist()}
    assert sorted(rows) == ["a", "b", "messy.jsonl:line-2", "messy.jsonl:line-4", "messy.jsonl:line-5",
                            "messy.jsonl:line-6"]
    assert rows["a"]["_input_error"] is None and rows["b"]["prompt"] == "fine too"
    assert "line 2 of" in rows["messy.jsonl:line-2"]["_input_error"] and "not valid JSON" in \
        rows["messy.jsonl:line-2"]["_input_error"]
    assert "not a JSON object" in rows["messy.jsonl:line-4"]["_input_error"]
    assert "not valid Unicode" in rows["messy.jsonl:line-5"]["_input_error"]
    assert "not valid Unicode" in rows["messy.jsonl:line-6"]["_input_error"]
    again = load_prompts(None, str(data), prompt_column="text", id_column="uid")
    assert again.column("id").to_pylist() == table.column("id").to_pylist()  # stable across runs


def test_any_fsspec_filesystem_reads_through_the_same_path():
    """A URI pyarrow does not know goes through fsspec (here its in-memory filesystem, in this process: Ray
    workers would not share it; tests/pipeline/test_s3.py covers a filesystem the workers reach)."""
    import fsspec

    memory = fsspec.filesystem("memory")
    memory.pipe("/entmtp-test/part-0.jsonl", b'{"prompt": "a"}\n{"prompt": "b"}\n')
    memory.pipe("/entmtp-test/part-1.jsonl", b'{"prompt": "c"}\n')
    memory.pipe("/entmtp-test/other.csv", b"prompt\nd\n")
    try:
        table = load_prompts(None, "memory://entmtp-test/part-*.jsonl")
        assert table.column("id").to_pylist() == ["part-0.jsonl:row-0000000", "part-0.jsonl:row-0000001",
                                                 "part-1.jsonl:row-0000000"]
        assert table.column("prompt").to_pylist() == ["a", "b", "c"]
        assert load_prompts(None, "memory://entmtp-test/").num_rows == 4
    finally:
        memory.rm("/entmtp-test", recursive=True)


def _typed_columns(tmp_path):
    """A JSON lines file, and a CSV file, of CHUNK_ROWS + 1,000 records whose columns are int, float, bool,
    null-then-int, nested, and an int for 5,000 lines then a string: their paths and the records."""
    from entmtp_ray.pipeline.sources import CHUNK_ROWS

    n = CHUNK_ROWS + 1000
    rows = [{"prompt": "p", "count": i, "score": i / 4, "flag": i % 2 == 0, "late": None if i < 10 else i,
             "meta": {"n": i}, "turns": i if i < 5000 else "five thousand"} for i in range(n)]
    jsonl = tmp_path / "typed.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    csv_path = tmp_path / "typed.csv"
    csv_path.write_text("prompt,count,score,flag,late,turns\n" + "".join(
        f"p,{r['count']},{r['score']},{str(r['flag']).lower()},{'' if r['late'] is None else r['late']},{r['turns']}\n"
        for r in rows))
    return jsonl, csv_path, rows


def test_json_and_csv_columns_keep_their_types_across_chunks_and_a_conflict_becomes_text(tmp_path, caplog):
    """Types as Ray Data's readers give them, promoted over every chunk (null -> int, int -> float); a column
    that is an int for 5,000 lines and then a string (another chunk) is text, with one warning naming it and the
    line, and the rows go on."""
    jsonl, csv_path, rows = _typed_columns(tmp_path)
    table = load_prompts(None, str(jsonl))
    types = {name: table.schema.field(name).type for name in ("count", "score", "flag", "late", "meta", "turns")}
    assert types == {"count": pa.int64(), "score": pa.float64(), "flag": pa.bool_(), "late": pa.int64(),
                     "meta": pa.string(), "turns": pa.string()}
    assert table.column("count").to_pylist() == [r["count"] for r in rows]
    assert table.column("late").to_pylist()[8:12] == [None, None, 10, 11]
    assert table.column("meta").to_pylist()[3] == '{"n": 3}'  # nested: its JSON text
    assert table.column("turns").to_pylist()[4999:5001] == ["4999", "five thousand"]
    assert [r.getMessage() for r in caplog.records if "turns" in r.getMessage()] == [
        "column 'turns' holds int values, then string at typed.jsonl line 5001: its values are written as text"]
    caplog.clear()
    table = load_prompts(None, str(csv_path))
    assert {name: table.schema.field(name).type for name in ("count", "score", "flag", "late", "turns")} == {
        "count": pa.int64(), "score": pa.float64(), "flag": pa.bool_(), "late": pa.int64(), "turns": pa.string()}
    assert table.column("flag").to_pylist()[:3] == [True, False, True]
    assert table.column("late").to_pylist()[9:11] == [None, 10]
    assert table.column("turns").to_pylist()[5000] == "five thousand"
    assert any("'turns' holds int values, then string at typed.csv row 5001" in r.getMessage() for r in caplog.records)


def test_files_whose_columns_differ_in_type_are_typed_alike(tmp_path):
    """int in one file, float in the next: float in both; int then string: text in both (one scan over every
    file); a CSV id keeps its leading zeros."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.jsonl").write_text("".join(json.dumps({"prompt": "p", "x": 1, "y": 2}) + "\n" for _ in range(3)))
    (data / "b.jsonl").write_text(json.dumps({"prompt": "p", "x": 1.5, "y": "two"}) + "\n")
    table = load_prompts(None, str(data))
    assert table.schema.field("x").type == pa.float64() and table.column("x").to_pylist() == [1.0, 1.0, 1.0, 1.5]
    assert table.column("y").to_pylist() == ["2", "2", "2", "two"]
    ids = tmp_path / "ids.csv"
    ids.write_text("uid,prompt\n007,p\n8,q\n")
    assert load_prompts(None, str(ids), id_column="uid").column("id").to_pylist() == ["007", "8"]
