"""Per-row sampling settings (`sampling_params`) and several samples per prompt (--n): the checks and the
expansion (pipeline/sampling.py), an engine decoding a row with its own settings, and the Ray job writing
every sample once, under an actor fault and on --resume."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError

from entmtp_ray.config import DecodingConfig, ModelConfig
from entmtp_ray.pipeline.sampling import (SAMPLE_INDEX, SAMPLING, check_row, expand, output_keys, parse_overrides,
                                          row_decoding, sample_key)

from helpers.faults import faulty_actor
from helpers.jobs import job_args, read_output, run_here


# ---- the checks ------------------------------------------------------------------------------------

def test_overrides_come_from_an_object_or_its_json_text_and_null_keys_keep_the_jobs():
    assert parse_overrides(None) == ({}, None)
    assert parse_overrides('{"temperature": 0.7, "top_p": null}') == ({"temperature": 0.7}, None)
    assert parse_overrides({"max_tokens": 5, "top_k": -1}) == ({"max_new_tokens": 5, "top_k": 0}, None)
    assert parse_overrides("null") == ({}, None)


@pytest.mark.parametrize("value, message", [
    ("{temperature: 1}", "not valid JSON"),
    ("[1, 2]", "must be an object of settings, got list"),
    ({"presence_penalty": 1.0}, "unsupported setting 'presence_penalty'; a row may set temperature"),
    ({"policy": "ar"}, "unsupported setting 'policy'"),  # an engine setting: the job's alone
    ({"max_tokens": 4, "max_new_tokens": 5}, "both max_tokens and max_new_tokens"),
])
def test_an_unusable_sampling_params_value_says_why(value, message):
    overrides, problem = parse_overrides(value)
    assert overrides == {} and message in problem


def test_a_row_temperature_on_a_greedy_job_samples_exactly_and_bad_values_are_refused():
    job = DecodingConfig(policy="hydra", max_new_tokens=8)
    assert row_decoding(job, {}) is job
    row = row_decoding(job, {"temperature": 0.7, "n": 2, "seed": 5})
    assert (row.temperature, row.acceptance, row.n, row.seed, row.policy) == (0.7, "exact", 2, 5, "hydra")
    typical = DecodingConfig(policy="hydra", temperature=0.7, acceptance="typical")
    assert row_decoding(typical, {"temperature": 0.0}).acceptance == "typical"  # kept where it is defined
    with pytest.raises(ValidationError, match="typical acceptance has no definition with --top-p"):
        row_decoding(typical, {"top_p": 0.9})
    assert check_row(job, {"temperature": "hot"})[2].startswith("sampling_params: temperature: Input should be a "
                                                                 "valid number")
    assert "greater than or equal to 1" in check_row(job, {"n": 0})[2]
    assert "empty stop string" in check_row(job, {"stop": [""]})[2]
    assert check_row(job, '{"n": 3, "stop": "END"}') == ({"n": 3, "stop": "END"}, 3, None)
    named = row_decoding(job, {"temperature": 0.7, "acceptance": "typical", "typical_alpha": 0.2})
    assert (named.acceptance, named.typical_alpha, named.max_new_tokens) == ("typical", 0.2, 8)  # the row's own
    assert "needs --temperature 0" in check_row(job, {"temperature": 0.7, "acceptance": "greedy"})[2]


def test_a_row_is_checked_as_sampling_params_alone_and_the_engine_settings_stay_the_jobs():
    from entmtp_ray.config import SamplingParams
    from entmtp_ray.pipeline.sampling import SAMPLING_KEYS

    assert set(SAMPLING_KEYS) == set(SamplingParams.model_fields)
    assert not {"policy", "tree", "task", "bank", "signal", "max_input_tokens"} & set(SAMPLING_KEYS)
    job = DecodingConfig(policy="entmtp-tau", task="gsm8k", signal="top1", max_input_tokens=99, max_new_tokens=8)
    assert job.sampling() == SamplingParams(max_new_tokens=8)
    row = row_decoding(job, {"top_k": 5, "temperature": 1.0})
    assert isinstance(row, DecodingConfig) and row.model_dump() == job.model_dump() | {
        "top_k": 5, "temperature": 1.0, "acceptance": "exact"}


def prompt_rows(**columns) -> pa.Table:
    n = len(next(iter(columns.values())))
    base = {"id": [f"r{i}" for i in range(n)], "prompt": ["Hi."] * n, "_messages": [None] * n,
            "_input_error": [None] * n}
    return pa.table(base | columns)


def test_expand_gives_one_row_per_sample_and_one_error_row_for_bad_settings():
    job = DecodingConfig(policy="ar", temperature=0.5, n=2)
    table = prompt_rows(sampling_params=[None, '{"n": 3, "top_k": 4}', '{"top_p": 2}', None],
                        label=["a", "b", "c", "d"])
    table = table.set_column(3, "_input_error", pa.array([None, None, None, "line 4 is not JSON"]))
    out = expand(table, job).to_pylist()
    assert [(r["id"], r[SAMPLE_INDEX]) for r in out] == [("r0", 0), ("r0", 1), ("r1", 0), ("r1", 1), ("r1", 2),
                                                          ("r2", 0), ("r3", 0)]
    assert [r["label"] for r in out] == ["a", "a", "b", "b", "b", "c", "d"]  # the input's columns follow
    assert [json.loads(r[SAMPLING]) if r[SAMPLING] else None for r in out][1:5] == [None] + [{"n": 3, "top_k": 4}] * 3
    assert out[5]["_input_error"].startswith("sampling_params: top_p: Input should be less than or equal to 1")
    assert out[6]["_input_error"] == "line 4 is not JSON"  # a row already in error is not expanded


def test_expand_reads_a_parquet_struct_column_whose_missing_fields_are_null():
    struct = pa.array([{"temperature": 0.9, "n": None}, {"temperature": None, "n": 2}, None],
                      pa.struct([("temperature", pa.float64()), ("n", pa.int64())]))
    out = expand(prompt_rows(sampling_params=struct), DecodingConfig(policy="ar")).to_pylist()
    assert [(r["id"], r[SAMPLE_INDEX], r[SAMPLING]) for r in out] == [
        ("r0", 0, '{"temperature": 0.9}'), ("r1", 0, '{"n": 2}'), ("r1", 1, '{"n": 2}'), ("r2", 0, None)]
    assert all(r["_input_error"] is None for r in out)


def test_sample_keys_are_unique_and_the_first_sample_keeps_the_row_id():
    assert [sample_key("a", 0), sample_key("a", 2), sample_key(None, 1)] == ["a", "a#2", None]
    keys = output_keys(pa.array(["a#1", "a", "a"]), pa.array([0, 10, 1])).to_pylist()
    assert keys == ["a#1#0", "a#10", "a#1"] and len(set(keys)) == 3
    assert output_keys(pa.array(["x"]), None).to_pylist() == ["x#0"]


# ---- one engine ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def engine(tiny_model_dirs):
    from helpers.engines import make_engine

    model_dir, heads_dir = tiny_model_dirs
    return make_engine(ModelConfig(model=str(model_dir), heads=str(heads_dir), dtype="fp32", device="cpu"),
                  DecodingConfig(policy="hydra", max_new_tokens=10))


def test_an_engine_decodes_a_row_with_its_own_settings_and_each_sample_with_its_own_seed(engine):
    prompt = "Write a poem."
    greedy = engine.run("p", prompt)
    assert (greedy["temperature"], greedy["acceptance"], greedy["sample_index"]) == (0.0, "greedy", 0)
    sampled = [engine.run("p", prompt, sample_index=i, overrides={"temperature": 1.0}) for i in range(3)]
    assert [r["acceptance"] for r in sampled] == ["exact"] * 3 and [r["sample_index"] for r in sampled] == [0, 1, 2]
    texts = [tuple(r["output_token_ids"]) for r in sampled]
    assert len(set(texts)) == 3, "samples of one prompt should differ at T=1"
    again = engine.run("p", prompt, sample_index=1, overrides={"temperature": 1.0})
    assert again["output_token_ids"] == sampled[1]["output_token_ids"]  # a sample reproduces alone
    reseeded = engine.run("p", prompt, sample_index=1, overrides={"temperature": 1.0, "seed": 7})
    assert reseeded["output_token_ids"] != sampled[1]["output_token_ids"]
    short = engine.run("p", prompt, overrides={"max_new_tokens": 3})
    assert short["num_output_tokens"] <= 3 and short["output_token_ids"] == greedy["output_token_ids"][:3]
    bad = engine.run("p", prompt, overrides={"top_k": -5})
    assert bad["finish_reason"] == "error" and bad["error"].startswith("sampling_params: top_k:")


# ---- the Ray job -----------------------------------------------------------------------------------

PER_ROW = {"q0": {"n": 3}, "q1": {"temperature": "hot"}, "q2": {"max_tokens": 3}, "q3": {"presence_penalty": 1},
           "q4": {"temperature": 0}}


def write_rows(path: Path) -> Path:
    rows = [{"uid": f"q{i}", "text": f"Write item number {i} of a list."} | (
        {"sampling_params": PER_ROW[f"q{i}"]} if f"q{i}" in PER_ROW else {}) for i in range(6)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.slow
def test_the_job_writes_n_samples_per_row_with_per_row_settings_once_under_a_fault_and_on_resume(
        tiny_model_dirs, tmp_path, ray_cluster):
    data, out = write_rows(tmp_path / "prompts.jsonl"), tmp_path / "out"
    marker = tmp_path / "crashed"
    args = job_args(tiny_model_dirs, data, out, "--policy", "hydra", "--temperature", "0.8", "--n", "2",
                    "--rows-per-file", "1")
    proc = run_here(args, faulty_actor("q5#1", marker))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert marker.exists(), "the fault was not injected"
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (summary["input_rows"], summary["expected_rows"], summary["rows"]) == (6, 11, 11)
    assert (summary["duplicates"], summary["errors"]) == (0, 2)
    rows = {(r["id"], r["sample_index"]): r for r in read_output(out)}
    assert sorted(rows) == sorted([("q0", 0), ("q0", 1), ("q0", 2), ("q1", 0), ("q2", 0), ("q2", 1), ("q3", 0),
                                   ("q4", 0), ("q4", 1), ("q5", 0), ("q5", 1)])
    assert rows["q1", 0]["error"].startswith("sampling_params: temperature:")
    assert "unsupported setting 'presence_penalty'" in rows["q3", 0]["error"]
    assert all(rows["q2", i]["num_output_tokens"] <= 3 for i in (0, 1))
    assert rows["q4", 0]["temperature"] == 0.0 and rows["q4", 0]["output_token_ids"] == rows["q4", 1]["output_token_ids"]
    assert rows["q5", 0]["output_token_ids"] != rows["q5", 1]["output_token_ids"]
    assert json.loads(rows["q0", 0]["sampling_params"]) == {"n": 3}  # the input's column is kept

    # lose two samples' files (one of a row's two, and a row's third): --resume makes exactly those again
    lost = {("q5", 1), ("q0", 2)}
    for file in out.glob("*.parquet"):
        row = pq.read_table(file).to_pylist()[0]
        if (row["id"], row["sample_index"]) in lost:
            file.unlink()
    proc = run_here(args + ["--resume"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    again = {(r["id"], r["sample_index"]): r for r in read_output(out)}
    assert sorted(again) == sorted(rows) and json.loads(proc.stdout.strip().splitlines()[-1])["duplicates"] == 0
    for key, row in again.items():
        assert (row["started_at"] == rows[key]["started_at"]) == (key not in lost), key
        assert row["output_token_ids"] == rows[key]["output_token_ids"]  # seeded by row id and sample index
