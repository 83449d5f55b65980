"""The output row contract: a pinned Parquet schema, finish_reason for every way a row ends, the
prompt checks at their boundaries, chat turns as input, and the run summary's figures."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from entmtp_ray.config import DecodingConfig, ModelConfig
from entmtp_ray.pipeline.records import OUTPUT_SCHEMA, output_table

# The contract with users' readers, written out here on purpose: a change to records.py that
# renames, drops, reorders or retypes a column must fail this test and be made deliberately.
PINNED_SCHEMA = [
    ("id", pa.string()),
    ("sample_index", pa.int64()),
    ("task", pa.string()),
    ("prompt", pa.string()),
    ("output_text", pa.string()),
    ("output_token_ids", pa.list_(pa.int64())),
    ("num_prompt_tokens", pa.int64()),
    ("num_output_tokens", pa.int64()),
    ("finish_reason", pa.string()),
    ("policy", pa.string()),
    ("temperature", pa.float64()),
    ("acceptance", pa.string()),
    ("model", pa.string()),
    ("heads", pa.string()),
    ("bank", pa.string()),
    ("steps", pa.int64()),
    ("verified_nodes", pa.int64()),
    ("mean_accepted_length", pa.float64()),
    ("num_draft_tokens", pa.int64()),
    ("num_accepted_tokens", pa.int64()),
    ("accepted_per_position", pa.list_(pa.float64())),
    ("tree_usage", pa.map_(pa.string(), pa.int64())),
    ("tree_switches", pa.int64()),
    ("step_accepted_lengths", pa.list_(pa.int64())),
    ("step_signals", pa.list_(pa.float64())),
    ("prefill_s", pa.float64()),
    ("decode_s", pa.float64()),
    ("schedule_s", pa.float64()),
    ("total_s", pa.float64()),
    ("tokens_per_s", pa.float64()),
    ("started_at", pa.float64()),
    ("actor_id", pa.string()),
    ("error", pa.string()),
]
PROMPT = "Write a poem."


@pytest.fixture(scope="module")
def engine(tiny_model_dirs):
    from helpers.engines import make_engine

    model_dir, heads_dir = tiny_model_dirs
    return make_engine(ModelConfig(model=str(model_dir), heads=str(heads_dir), dtype="fp32", device="cpu"),
                  DecodingConfig(policy="hydra", max_new_tokens=6))


@pytest.fixture
def fresh_engine(engine, monkeypatch):
    """The module's engine with settings a test may change for itself (restored after)."""
    monkeypatch.setattr(engine, "decoding", engine.decoding)
    monkeypatch.setattr(engine.loaded, "eos_token_ids", engine.loaded.eos_token_ids)
    return engine


def test_rows_are_written_and_read_back_in_the_pinned_schema(engine, tmp_path):
    assert [(f.name, f.type) for f in OUTPUT_SCHEMA] == PINNED_SCHEMA
    rows = [engine.run("good", PROMPT), engine.run("bad", "")]
    passthrough = pa.table({"label": [1, 2], "id_src": ["a", "b"]})
    pq.write_table(output_table(passthrough, rows), tmp_path / "part.parquet")
    back = pq.read_table(tmp_path / "part.parquet")
    assert [(f.name, f.type) for f in back.schema] == PINNED_SCHEMA + [("label", pa.int64()), ("id_src", pa.string())]
    good, bad = back.to_pylist()
    assert good["error"] is None and bad["error"] == "empty prompt: nothing to generate from"
    assert good["num_output_tokens"] == len(good["output_token_ids"]) == 6 and good["label"] == 1
    assert dict(good["tree_usage"]) == {"hydra": good["steps"]} and len(good["accepted_per_position"]) == 4
    assert good["total_s"] == pytest.approx(good["prefill_s"] + good["decode_s"])
    assert good["tokens_per_s"] == pytest.approx(6 / good["total_s"])
    assert good["verified_nodes"] == 64 * good["steps"]
    # vLLM's counters: 63 drafts per Hydra step; the 6 tokens less the prefill's first, less one bonus per step
    assert good["num_draft_tokens"] == 63 * good["steps"]
    assert good["num_accepted_tokens"] == sum(a - 1 for a in good["step_accepted_lengths"]) == 5 - good["steps"]
    assert bad["num_draft_tokens"] == bad["num_accepted_tokens"] == 0


def test_finish_reason_of_every_way_a_row_ends(fresh_engine, monkeypatch):
    engine = fresh_engine
    length = engine.run("r", PROMPT)
    assert (length["finish_reason"], length["num_output_tokens"], length["error"]) == ("length", 6, None)

    engine.loaded.eos_token_ids = frozenset({length["output_token_ids"][2]})
    stop = engine.run("r", PROMPT)
    assert stop["finish_reason"] == "stop" and stop["output_token_ids"] == length["output_token_ids"][:3]

    engine.loaded.eos_token_ids = frozenset()
    ids = engine.encode(PROMPT)
    monkeypatch.setattr(engine.loaded.model.config, "max_position_embeddings", len(ids) + 3)
    context = engine.run("r", PROMPT)
    assert context["finish_reason"] == "context" and context["error"] is None
    assert context["output_token_ids"] == length["output_token_ids"][:4]  # 3 committed + the token after them

    error = engine.run("r", 7)
    assert error["finish_reason"] == "error" and error["error"] == "prompt must be a string, got int"
    assert error["num_output_tokens"] == 0 and error["output_token_ids"] is None and error["steps"] == 0


def test_a_prompt_of_exactly_max_input_tokens_runs_and_one_more_is_an_error_row(fresh_engine):
    engine = fresh_engine
    n = len(engine.encode(PROMPT))
    engine.decoding = engine.decoding.model_copy(update={"max_input_tokens": n})
    row = engine.run("r", PROMPT)
    assert row["error"] is None and row["num_prompt_tokens"] == n
    engine.decoding = engine.decoding.model_copy(update={"max_input_tokens": n - 1})
    row = engine.run("r", PROMPT)
    assert row["finish_reason"] == "error"
    assert row["error"] == (f"prompt has {n} tokens, over --max-input-tokens {n - 1}; shorten it or raise "
                            "--max-input-tokens")


def test_chat_turns_are_the_prompt_when_given(engine):
    single = engine.run("r", PROMPT, [{"role": "user", "content": PROMPT}])
    assert single["output_token_ids"] == engine.run("r", PROMPT)["output_token_ids"]
    turns = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello!"},
             {"role": "user", "content": PROMPT}]
    chat = engine.run("r", "shown prompt", turns)
    assert chat["error"] is None and chat["prompt"] == "shown prompt"
    assert chat["num_prompt_tokens"] == len(engine.loaded.encode_prompt(turns)) > single["num_prompt_tokens"]
    for bad in ([{"role": "user", "content": 3}], [{"role": "user"}]):
        row = engine.run("r", "p", bad)
        assert row["error"] == "messages must be a non-empty list of {role, content} turns"


def test_summary_figures_from_what_was_written(tmp_path):
    from entmtp_ray.pipeline.outputs import summarize

    def row(id, tokens, steps, started, total, error=None, nodes_per_step=5):
        return {"id": id, "num_output_tokens": tokens, "steps": steps, "verified_nodes": nodes_per_step * steps,
                "error": error, "started_at": started, "total_s": total}

    schema = pa.schema([f for f in OUTPUT_SCHEMA if f.name in row("", 0, 0, 0.0, 0.0)])
    pq.write_table(pa.Table.from_pylist([row("a", 10, 4, 100.0, 2.0), row("b", 21, 5, 101.0, 3.0)], schema),
                   tmp_path / "part-1.parquet")
    pq.write_table(pa.Table.from_pylist([row("c", 0, 0, 99.0, None, "bad"), row("a", 10, 4, 104.0, 1.0)], schema),
                   tmp_path / "part-2.parquet")
    summary = summarize(str(tmp_path), started=100.5, input_rows=3)
    assert summary["rows"] == 4 and summary["input_rows"] == 3
    assert summary["duplicates"] == 1 and summary["errors"] == 1
    assert summary["output_tokens"] == 41
    assert summary["decode_span_s"] == pytest.approx(105.0 - 100.0)  # first good start to last good end
    assert summary["aggregate_tokens_per_s"] == pytest.approx(41 / 5.0)
    assert summary["mean_accepted_length"] == pytest.approx((41 - 3) / 13)  # a row's first token is no step's
    # 4 drafts per 5-node step; kept: tokens less each row's first, less each step's bonus
    assert (summary["num_draft_tokens"], summary["num_accepted_tokens"]) == (4 * 13, 41 - 3 - 13)
    assert summary["acceptance_rate"] == pytest.approx(25 / 52)
    assert summary["first_row_s"] == pytest.approx(104.0 - 100.5)  # rows that started after the job did
    assert summary["output"] == str(tmp_path.resolve()) and summary["wall_s"] > 0
    json.dumps(summary)  # the last stdout line is this object
    # rows that count their accepted drafts (a step cut before its bonus kept only drafts) are summed as written
    counted = tmp_path / "counted"
    counted.mkdir()
    # and the tree mix is each tree's steps over the good rows, most first
    rows = [row("a", 10, 4, 100.0, 2.0) | {"num_accepted_tokens": 6, "sample_index": 0, "tree_usage": {"t2": 3, "t1": 1}},
            row("a", 9, 4, 100.0, 2.0) | {"num_accepted_tokens": 5, "sample_index": 1, "tree_usage": [("t1", 4)]},
            row("b", 0, 0, 100.0, None, "bad") | {"num_accepted_tokens": 0, "sample_index": 0, "tree_usage": None}]
    pq.write_table(pa.Table.from_pylist(rows, pa.schema([f for f in OUTPUT_SCHEMA if f.name in rows[0]])),
                   counted / "part-0.parquet")
    two = summarize(str(counted), started=100.5, input_rows=2, expected_rows=3)
    assert (two["num_accepted_tokens"], two["duplicates"], two["expected_rows"]) == (11, 0, 3)
    assert two["tree_usage"] == {"t1": 5, "t2": 3} and list(two["tree_usage"]) == ["t1", "t2"]
    assert summary["tree_usage"] == {}  # an output written before the column
    from entmtp_ray.pipeline.outputs import tree_steps

    maps = pa.array([[("t1", 1)], [("t2", 2), ("t1", 3)], None, [("t3", 4)]], pa.map_(pa.string(), pa.int64()))
    assert tree_steps(maps.slice(1, 2)).to_pylist() == [{"tree": "t2", "steps": 2}, {"tree": "t1", "steps": 3}]
    empty = summarize(str(tmp_path / "none"), started=0.0, input_rows=0)
    assert (empty["rows"], empty["output_tokens"], empty["mean_accepted_length"]) == (0, 0, None)
    assert empty["acceptance_rate"] is None


def test_an_ar_row_drafts_nothing_so_reports_no_positions_and_no_heads(tiny_model_dirs):
    from helpers.engines import make_engine

    model_dir, heads_dir = tiny_model_dirs
    engine = make_engine(ModelConfig(model=str(model_dir), heads=str(heads_dir), dtype="fp32", device="cpu"),
                    DecodingConfig(policy="ar", max_new_tokens=4))
    row = engine.run("r", PROMPT)
    assert row["accepted_per_position"] == [] and row["heads"] is None and row["mean_accepted_length"] == 1.0
    assert dict(row["tree_usage"]) == {"ar": 3} and row["verified_nodes"] == 3 and row["tree_switches"] == 0


@pytest.mark.parametrize("failure, broken", [
    (KeyError("role"), False),  # e.g. a user's chat turns without the key the template reads
    (TypeError("unsupported operand"), False),
    (RuntimeError("shape mismatch in this row"), False),
    (MemoryError(), True),
    (torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"), True),
    (RuntimeError("CUDA error: an illegal memory access was encountered"), True),
])
def test_a_row_failure_is_its_error_and_a_broken_process_raises(fresh_engine, monkeypatch, failure, broken):
    from entmtp_ray.pipeline.engine import EngineBroken

    def fail(*args, **kwargs):
        raise failure

    monkeypatch.setattr(fresh_engine.decoder, "generate", fail)
    if broken:
        with pytest.raises(EngineBroken, match="row r1"):
            fresh_engine.run("r1", "Say hi.")
        return
    row = fresh_engine.run("r1", "Say hi.")
    assert row["finish_reason"] == "error" and row["error"] == f"{type(failure).__name__}: {failure}"
    assert row["id"] == "r1" and row["prompt"] == "Say hi."
