"""jobs/generate.py on real local Ray: Parquet out, input columns kept, bad rows as data,
exactly-once under actor death and node loss, resume without regeneration, config errors up front.

The model is a tiny random Llama directory (tests/conftest.py) so that Ray, not decoding,
dominates the time; test_job_submit.py runs the embedded model through `ray job submit`.

Jobs run in this process on the session's shared Ray (tests/conftest.py), a fault injected through the actor
class the test passes to the job (helpers/faults.py). A test that kills the driver or removes a node has a
Ray of its own under its own directory (RAY_TMPDIR, tests/helpers/raytools.py): after the test exactly its
processes are stopped and checked gone; no other Ray on the machine is touched.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from entmtp_ray.config import DecodingConfig, JobConfig, ModelConfig
from entmtp_ray.pipeline.records import OUTPUT_COLUMNS
from helpers import raytools
from helpers.faults import faulty_actor
from helpers.jobs import (job_args, kept_torch_threads, read_output, readable_rows, run_here,
                          write_prompts)



@pytest.mark.slow
def test_job_writes_every_row_once_with_stats_and_input_columns(tiny_model_dirs, tmp_path, ray_cluster):
    data = write_prompts(tmp_path / "prompts.jsonl", 6, bad=True)
    proc = run_here(job_args(tiny_model_dirs, data, tmp_path / "out", "--policy", "hydra", "--max-actors", "2"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    rows = read_output(tmp_path / "out")
    by_id = {r["id"]: r for r in rows}
    assert len(rows) == 9 and len(by_id) == 9
    assert summary["rows"] == 9 and summary["errors"] == 3 and summary["duplicates"] == 0
    assert summary["output_tokens"] == sum(r["num_output_tokens"] for r in rows)
    assert summary["tree_usage"] == {"hydra": sum(r["steps"] for r in rows)}
    assert set(OUTPUT_COLUMNS) <= set(rows[0]) and {"label"} <= set(rows[0])
    for i in range(6):
        row = by_id[f"q{i}"]
        assert row["error"] is None and row["label"] == i and row["prompt"] == f"Write item number {i} of a list."
        assert row["num_output_tokens"] == len(row["output_token_ids"]) > 0
        assert row["policy"] == "hydra" and dict(row["tree_usage"]) == {"hydra": row["steps"]}
        assert len(row["accepted_per_position"]) == 4 and row["tokens_per_s"] > 0 and row["actor_id"]
    assert "empty prompt" in by_id["empty"]["error"]
    assert "must be a string" in by_id["number"]["error"] and by_id["number"]["label"] == -2
    labels = pd.read_parquet(tmp_path / "out")["label"]  # an integer input column comes back an integer
    assert str(labels.dtype) == "int64" and sorted(labels) == [-3, -2, -1, 0, 1, 2, 3, 4, 5]
    assert "--max-input-tokens" in by_id["long"]["error"]
    # the start-up timeline, seconds since the job began: the driver's phases in order, then each actor's as it
    # reported them to the job's ledger (an actor that served no row reports no first request)
    startup = summary["startup"]
    assert list(startup["driver"]) == ["configs", "ray_up", "checks", "dtype", "planned"]
    assert startup["actors"] and {r["actor_id"][:12] for r in rows} <= {a["actor"] for a in startup["actors"]}
    for actor in startup["actors"]:
        assert actor["process_up"] <= actor["imports"] <= actor["weights"] <= actor["ready"]
        assert actor["ready"] <= actor.get("first_request", actor["ready"])
    first_requests = [a["first_request"] for a in startup["actors"] if "first_request" in a]
    assert startup["driver"]["planned"] < min(first_requests) < startup["first_row_s"] == summary["first_row_s"]


@pytest.mark.slow
def test_every_record_is_counted_an_unreadable_line_and_a_typed_column_included(tiny_model_dirs, tmp_path,
                                                                               ray_cluster):
    """9 JSON lines, one of them not UTF-8 and one a number where the prompt goes: 9 rows, input_rows 9; a column
    that is an int in every line before the last of the last file, and a string there, comes back text in every
    output file, with a warning (the job scans every file before it writes: the reader's tests in test_tasks.py
    cross a chunk of CHUNK_ROWS records the same way)."""
    lines = [json.dumps({"uid": f"q{i}", "text": f"Say {i}.", "n": i}).encode() for i in range(9)]
    lines[3] = b'{"uid": "q3", "text": "caf\xe9 \xff"}'
    lines[5] = json.dumps({"uid": "q5", "text": 5, "n": 5}).encode()
    data = tmp_path / "data"
    data.mkdir()
    (data / "messy.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    (data / "tail.jsonl").write_text("".join(json.dumps({"uid": f"l{i}", "text": "Hi.", "n": i}) + "\n"
                                             for i in range(3)) + json.dumps(
        {"uid": "last", "text": "Hi.", "n": "many"}) + "\n")
    proc = run_here(job_args(tiny_model_dirs, data, tmp_path / "out", "--policy", "ar", "--max-new-tokens", "1",
                             "--max-actors", "2", "--rows-per-file", "4"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    total = 9 + 4
    assert summary["rows"] == summary["input_rows"] == total and summary["duplicates"] == 0
    assert "column 'n' holds int values, then string at tail.jsonl line 4" in proc.stderr
    files = sorted((tmp_path / "out").glob("*.parquet"))
    assert len(files) > 1 and all(pq.read_schema(f).field("n").type == pa.string() for f in files)
    frame = pd.read_parquet(tmp_path / "out")
    assert len(frame) == total
    by_id = frame.set_index("id")
    assert "not valid Unicode" in by_id.loc["messy.jsonl:line-4", "error"]
    assert by_id.loc["q5", "n"] == "5" and by_id.loc["last", "n"] == "many"


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["exit", "broken"])
def test_actor_killed_mid_job_every_row_once(tiny_model_dirs, tmp_path, kind, ray_cluster):
    """An actor that dies mid-row (exit), or whose engine reports itself broken (as out of memory or a
    CUDA error would: the actor ends itself), is restarted and its row retried: every row once."""
    data = write_prompts(tmp_path / "prompts.jsonl", 8)
    marker = tmp_path / "crashed"
    args = job_args(tiny_model_dirs, data, tmp_path / "out", "--policy", "ar")
    proc = run_here(args, faulty_actor("q3", marker, kind))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert marker.exists(), "the fault was not injected"
    ids = [r["id"] for r in read_output(tmp_path / "out")]
    assert sorted(ids) == sorted(f"q{i}" for i in range(8))
    assert all(r["error"] is None for r in read_output(tmp_path / "out"))


@pytest.mark.slow
def test_concurrent_requests_write_the_rows_of_one_at_a_time_once_each_through_an_actor_death(tiny_model_dirs,
                                                                                              tmp_path, ray_cluster):
    """--concurrent-requests 3: each actor runs three rows at once through one batch; the rows equal those an engine
    decodes one at a time (what an actor of a one-at-a-time job runs, here in this process on the actor's one thread),
    and an actor that dies with rows in flight has every one of them retried, none twice."""
    import torch

    from helpers.engines import make_engine

    data = write_prompts(tmp_path / "prompts.jsonl", 10)
    model_dir, heads_dir = tiny_model_dirs
    with kept_torch_threads():
        torch.set_num_threads(1)  # an actor's threads: one per CPU it reserves (--cpus-per-actor 1)
        engine = make_engine(ModelConfig(model=str(model_dir), heads=str(heads_dir)),
                        DecodingConfig(policy="hydra", max_new_tokens=12))
        want = {f"q{i}": engine.run(f"q{i}", f"Write item number {i} of a list.")["output_token_ids"]
                for i in range(10)}
    marker = tmp_path / "crashed"
    args = job_args(tiny_model_dirs, data, tmp_path / "many", "--policy", "hydra", "--concurrent-requests", "3")
    many = run_here(args, faulty_actor("q4", marker))
    assert many.returncode == 0, many.stderr[-3000:]
    assert marker.exists(), "the fault was not injected"
    rows = read_output(tmp_path / "many")
    assert sorted(r["id"] for r in rows) == sorted(want) and all(r["error"] is None for r in rows)
    assert all(r["output_token_ids"] == want[r["id"]] for r in rows)
    spans = [(r["actor_id"], r["started_at"], r["started_at"] + r["total_s"]) for r in rows]
    assert any(a == b and s1 < e2 and s2 < e1 for i, (a, s1, e1) in enumerate(spans) for b, s2, e2 in spans[i + 1:]), \
        "no actor had two rows in flight at once"
    assert json.loads((tmp_path / "many" / "_manifest.json").read_text())["settings"]["concurrent_requests"] == 3
    other = run_here(args + ["--resume", "--concurrent-requests", "1"])  # another K is another setting of the rows
    assert other.returncode == 2 and "concurrent_requests: 3 -> 1" in other.stderr


@pytest.mark.slow
def test_stopped_job_resumes_without_regenerating(tiny_model_dirs, tmp_path, own_ray, ray_cluster):
    """A job killed with its local Ray (a subprocess: the driver's death is what is tested) part-way; --resume,
    run here on the shared Ray, writes only the rows it had not finished."""
    data = write_prompts(tmp_path / "prompts.jsonl", 16)
    out = tmp_path / "out"
    # rows long enough (about half a second each here) that the job is still decoding when the kill lands: with
    # 40 tokens a row all 16 were written between the third row's sight and the kill
    args = job_args(tiny_model_dirs, data, out, "--policy", "ar", "--max-new-tokens", "320", "--rows-per-file", "1")
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 240
    while time.time() < deadline and len(readable_rows(out)) < 3:
        time.sleep(0.2)
    # the job, its local Ray (raylet, GCS, workers: descendants of the job, or in this test's
    # RAY_TMPDIR), and nothing else; raises unless all of it is gone
    killed = raytools.kill_tree(proc.pid, own_ray)
    print("killed the job's processes:", *killed, sep="\n  ")
    proc.wait()
    # a file cut short by the kill is no output: --resume sets it aside and redoes its rows
    first = {r["id"]: r["started_at"] for r in readable_rows(out)}
    print("rows written before the kill (tokens, decode s):", len(first),
          [(r["num_output_tokens"], round(r["decode_s"], 2)) for r in readable_rows(out)])
    assert 3 <= len(first) < 16, f"the job should have been stopped part-way, wrote {len(first)} rows"

    proc = run_here(args + ["--resume"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_output(out)
    assert sorted(r["id"] for r in rows) == sorted(f"q{i}" for i in range(16))
    assert all(r["started_at"] == first[r["id"]] for r in rows if r["id"] in first), "finished rows were redone"
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["rows"] == 16 and summary["duplicates"] == 0


@pytest.mark.slow
def test_resume_into_an_output_of_other_settings_is_refused_and_names_them(tiny_model_dirs, tmp_path, ray_cluster):
    data = write_prompts(tmp_path / "prompts.jsonl", 3)
    out = tmp_path / "out"
    args = job_args(tiny_model_dirs, data, out, "--policy", "ar", "--max-new-tokens", "4")
    assert run_here(args).returncode == 0
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["settings"]["decoding"]["policy"] == "ar" and manifest["version"]
    assert len(read_output(out)) == 3  # the manifest is no data file to readers of the folder
    proc = run_here(args + ["--resume", "--temperature", "0.7", "--acceptance", "exact"])
    assert proc.returncode == 2
    assert "decoding.temperature: 0.0 -> 0.7" in proc.stderr and "decoding.acceptance" in proc.stderr
    assert len(read_output(out)) == 3
    same = run_here(args + ["--resume", "--max-actors", "2"])  # the pool's shape is no setting of the rows
    assert same.returncode == 0, same.stderr[-3000:]
    assert json.loads(same.stdout.strip().splitlines()[-1])["rows"] == 3


@pytest.mark.slow
def test_node_removed_mid_job_every_row_once(tiny_model_dirs, tmp_path, own_ray):
    import ray
    from ray.cluster_utils import Cluster

    from entmtp_ray.config import PoolConfig, ProcessorConfig
    from entmtp_ray.pipeline.dataplane import run_job
    from entmtp_ray.pipeline.processor import build_processor
    from entmtp_ray.pipeline.tasks import prompt_spec

    model_dir, heads_dir = tiny_model_dirs
    data = write_prompts(tmp_path / "prompts.jsonl", 12)
    ray.shutdown()  # the session's shared Ray, if a test before joined it: this test has a cluster of its own
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    worker = cluster.add_node(num_cpus=4)  # the only node an actor (3 CPUs) fits on
    ray.init(address=cluster.address)
    thread = None
    try:
        # one row per file: rows reach the output as they finish, so the node goes mid-job; the nodes share
        # this machine's disk (output_shared), which a multi-node job otherwise refuses
        job = JobConfig(output=str(tmp_path / "out"), address=cluster.address, rows_per_file=1, output_shared=True)
        spec = prompt_spec(None, str(data), prompt_column="text", id_column="uid")
        processor = build_processor(ProcessorConfig(
            model=ModelConfig(model=str(model_dir), heads=str(heads_dir)),
            decoding=DecodingConfig(policy="ar", max_new_tokens=40), pool=PoolConfig(cpus_per_actor=3)))
        result = {}
        thread = threading.Thread(target=lambda: result.update(run_job(spec, job, processor)))
        thread.start()
        deadline = time.time() + 240
        while time.time() < deadline and len(readable_rows(tmp_path / "out")) < 2:
            time.sleep(0.2)
        written_before = len(readable_rows(tmp_path / "out"))
        removed_at = time.time()
        cluster.remove_node(worker)
        cluster.add_node(num_cpus=4)
        thread.join(timeout=300)
        assert not thread.is_alive()
        assert 2 <= written_before < 12, f"the node should go mid-job; {written_before} rows were already written"
        rows = read_output(tmp_path / "out")
        assert sorted(r["id"] for r in rows) == sorted(f"q{i}" for i in range(12))
        assert any(r["started_at"] > removed_at for r in rows), "no row ran after the node was lost"
        assert result["duplicates"] == 0 and result["errors"] == 0
    finally:
        ray.shutdown()
        if thread is not None:
            thread.join(timeout=60)  # a pipeline cut short by a failed assert ends once Ray is gone
        ray.shutdown()  # in case its last call reconnected the driver
        cluster.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("extra, message", [
    (["--task", "nope"], "unknown task 'nope'"),
    (["--policy", "nope"], "unknown policy 'nope'"),
    (["--heads", "/nonexistent/heads"], "--heads /nonexistent/heads: no such directory"),
    (["--policy", "fixed", "--tree", "chain5"], "depth 5 but the heads draft at most 4"),
    (["--min-actors", "3", "--max-actors", "2"], "--min-actors 3 > --max-actors 2"),
])
def test_broken_config_fails_before_any_actor(tiny_model_dirs, tmp_path, extra, message):
    import ray

    ray.shutdown()  # left by a test before: the job must fail before it joins any
    data = write_prompts(tmp_path / "prompts.jsonl", 2)
    proc = run_here(job_args(tiny_model_dirs, data, tmp_path / "out", *extra))
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]
    assert not ray.is_initialized(), "the job joined Ray before its config was checked"
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_unwritable_or_used_output_fails_before_any_actor(tiny_model_dirs, tmp_path, ray_cluster):
    data = write_prompts(tmp_path / "prompts.jsonl", 2)
    blocker = tmp_path / "file"
    blocker.write_text("")
    proc = run_here(job_args(tiny_model_dirs, data, blocker / "out"))
    assert proc.returncode == 2 and "not writable" in proc.stderr
    used = tmp_path / "used"
    used.mkdir()
    (used / "part-x.parquet").write_text("")
    proc = run_here(job_args(tiny_model_dirs, data, used))
    assert proc.returncode == 2 and "--resume" in proc.stderr


def test_resume_sets_aside_files_a_stopped_job_cut_short(tmp_path):
    """A Parquet file left empty or truncated by a killed writer is moved to .unreadable/ (so the
    output reads again) and its rows count as not done; whole files count."""
    import pyarrow.parquet as pq

    from entmtp_ray.pipeline.outputs import finished_keys

    out = tmp_path / "out"
    out.mkdir()
    pq.write_table(pa.table({"id": ["a", "b"], "x": [1, 2]}), out / "part-0.parquet")
    pq.write_table(pa.table({"id": ["c", "d"], "x": [3, 4]}), tmp_path / "whole.parquet")
    whole = (tmp_path / "whole.parquet").read_bytes()
    (out / "part-1.parquet").write_bytes(whole[: len(whole) // 2])
    (out / "part-2.parquet").write_bytes(b"")
    assert sorted(finished_keys(str(out)).to_pylist()) == ["a#0", "b#0"]
    assert sorted(p.name for p in (out / ".unreadable").iterdir()) == ["part-1.parquet", "part-2.parquet"]
    assert sorted(r["id"] for r in read_output(out)) == ["a", "b"]
    assert finished_keys(str(tmp_path / "missing")).to_pylist() == []
