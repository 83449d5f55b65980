"""The streamed prompt plane and the processor API on a real local Ray (the session's shared one, conftest.py):
read tasks give the rows the in-memory reader gives (same ids, prompts, errors), folders, globs and gzip
work, --limit's sample is the lowest hashes, and build_processor runs inside a user's own Dataset."""

from __future__ import annotations

import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

pytestmark = pytest.mark.slow


@pytest.fixture
def ray_local(ray_cluster):
    """The session's shared Ray (conftest.py), as the module's tests call it."""
    import ray

    return ray


def _rows(table: pa.Table) -> list[dict]:
    keep = ["id", "prompt", "_messages", "_input_error"]
    return sorted(table.select(keep).to_pylist(), key=lambda r: r["id"])


def write_folder(root):
    root.mkdir()
    (root / "a.jsonl").write_text("".join(json.dumps({"prompt": f"a{i}", "k": i}) + "\n" for i in range(5))
                                  + "{broken\n" + json.dumps({"prompt": 3}) + "\n")
    (root / "sub").mkdir()
    with gzip.open(root / "sub" / "b.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps({"prompt": f"b{i}", "k": 10 + i}) + "\n" for i in range(3)))
    (root / "c.csv").write_text("prompt,k\nc0,20\n,21\nc2,22\n")
    (root / "_hidden.jsonl").write_text(json.dumps({"prompt": "never"}) + "\n")
    (root / "notes.txt").write_text("not data")
    return root


def test_streamed_rows_equal_the_in_memory_reader_for_a_folder_a_glob_and_a_file(ray_local, tmp_path):
    from entmtp_ray.pipeline.streams import read_prompts
    from entmtp_ray.pipeline.tasks import load_prompts, prompt_spec

    root = write_folder(tmp_path / "data")
    for dataset in [str(root), str(root / "*.jsonl"), f"file://{root}/a.jsonl", str(root / "sub" / "b.jsonl.gz")]:
        streamed = pa.concat_tables(ray_local.get(read_prompts(prompt_spec(None, dataset)).to_arrow_refs()),
                                    promote_options="permissive")
        assert _rows(streamed) == _rows(load_prompts(None, dataset)), dataset
    ids = {r["id"]: r for r in _rows(load_prompts(None, str(root)))}
    assert sorted(ids) == sorted([f"a.jsonl:row-{i:07d}" for i in range(7)] + [f"sub/b.jsonl.gz:row-{i:07d}"
                                 for i in range(3)] + [f"c.csv:row-{i:07d}" for i in range(3)])
    assert "not valid JSON" in ids["a.jsonl:row-0000005"]["_input_error"]
    assert "must be a string, got int" in ids["a.jsonl:row-0000006"]["_input_error"]
    assert ids["c.csv:row-0000001"]["prompt"] == ""  # an empty CSV field is text too (the engine refuses it)
    pq.write_table(pa.table({"prompt": ["d0"], "k": [30]}), root / "d.parquet")
    with pytest.raises(ValueError, match="both Parquet and JSON lines/CSV"):
        load_prompts(None, str(root))
    parquet = _rows(load_prompts(None, str(root / "*.parquet")))
    assert parquet == [{"id": "d.parquet:row-0000000", "prompt": "d0", "_messages": None, "_input_error": None}]
    single = load_prompts(None, str(root / "a.jsonl"))
    assert single.column("id").to_pylist()[:2] == ["row-0000000", "row-0000001"]  # one file: positions alone


def test_limit_keeps_the_rows_whose_ids_hash_lowest(ray_local, tmp_path):
    from entmtp_ray.pipeline.streams import read_prompts, sample
    from entmtp_ray.pipeline.tasks import prompt_spec, sample_keys

    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"p{i}"}) + "\n" for i in range(300)))
    spec = prompt_spec(None, str(path))
    ids = [f"row-{i:07d}" for i in range(300)]
    keys = sample_keys(ids, 5)
    expected = sorted(ids[i] for i in keys.argsort()[:17])
    assert sorted(r["id"] for r in sample(read_prompts(spec), 17, 5).take_all()) == expected
    assert sorted(r["id"] for r in sample(read_prompts(spec), 17, 6).take_all()) != expected


def test_a_small_local_dataset_is_read_and_sampled_here_as_ray_tasks_read_and_sample_it(ray_local, tmp_path):
    """A job reads a small local dataset in its driver (streams.read_here, no read task, sort or limit to start
    worker processes for): the same rows, and the same --limit sample in the same order, as the tasks give."""
    from entmtp_ray.pipeline.streams import (TablePrompts, read_here, read_prompts, sample, sample_here, scan_files,
                                             small_local)
    from entmtp_ray.pipeline.tasks import open_source, prompt_spec

    root = write_folder(tmp_path / "data")
    spec = prompt_spec(None, str(root))
    source = open_source(spec)
    typed = scan_files(spec, source)
    assert small_local(source)
    here = read_here(typed, source)
    by_tasks = pa.concat_tables(ray_local.get(read_prompts(typed, source).to_arrow_refs()), promote_options="default")
    assert _rows(here) == _rows(by_tasks) and here.num_rows == 13
    handed = ray_local.data.read_datasource(TablePrompts(here), override_num_blocks=1)
    assert pa.concat_tables(ray_local.get(handed.to_arrow_refs())).equals(here)  # one lazy read task, as read
    for limit, seed in [(5, 1), (5, 2), (13, 1), (40, 3)]:
        sampled = [r["id"] for r in sample(read_prompts(typed, source), limit, seed).take_all()]
        assert sample_here(here, limit, seed).column("id").to_pylist() == sampled, (limit, seed)


def test_build_processor_runs_inside_a_users_dataset(ray_local, tiny_model_dirs):
    from entmtp_ray import ProcessorConfig, build_processor
    from entmtp_ray.config import DecodingConfig, ModelConfig, PoolConfig
    from helpers.engines import make_engine
    from entmtp_ray.pipeline.records import OUTPUT_COLUMNS

    model_dir, heads_dir = tiny_model_dirs
    model = ModelConfig(model=str(model_dir), heads=str(heads_dir), dtype="fp32")
    decoding = DecodingConfig(policy="hydra", max_new_tokens=6)
    processor = build_processor(ProcessorConfig(model=model, decoding=decoding,
                                                pool=PoolConfig(max_actors=2, rows_per_block=2)))
    items = [{"question": f"Write item number {i}.", "qid": f"q{i}"} for i in range(5)] + [{"question": "", "qid": "e"}]
    ds = ray_local.data.from_items(items).map(lambda r: {"prompt": r["question"], "qid": r["qid"]})
    rows = {r["qid"]: r for r in processor(ds).take_all()}
    assert set(rows) == {"q0", "q1", "q2", "q3", "q4", "e"}
    assert set(OUTPUT_COLUMNS) <= set(rows["q0"]) and rows["q0"]["id"] is None
    assert "empty prompt" in rows["e"]["error"]
    engine = make_engine(model, decoding)
    for i in range(5):
        assert list(rows[f"q{i}"]["output_token_ids"]) == engine.run(None, f"Write item number {i}.")["output_token_ids"]

    with pytest.raises(ValueError, match="unknown policy"):
        build_processor({"decoding": {"policy": "nope"}})


def test_the_readme_example_runs_as_written(ray_local, tmp_path):
    """The README's five lines, with its two S3 URIs pointed at local folders (tests/pipeline/test_s3.py covers S3)."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    code = re.search(r"```python\n(import ray\nfrom entmtp_ray import build_processor.*?)```", readme, re.S).group(1)
    assert len(code.strip().splitlines()) <= 5
    questions, labels = tmp_path / "questions", tmp_path / "labels"
    questions.mkdir()
    pq.write_table(pa.table({"question": ["What is 2 + 3?", "Name a prime number."], "qid": [1, 2]}),
                   questions / "part-0.parquet")
    code = code.replace("s3://bucket/questions/", str(questions)).replace("s3://bucket/labels/", str(labels))
    exec(compile(code, "README.md", "exec"), {})
    rows = pq.read_table(labels).to_pylist()
    assert sorted(r["qid"] for r in rows) == [1, 2]
    assert all(r["error"] is None and r["policy"] == "entmtp-tau" and r["bank"] and r["output_text"] for r in rows)


def test_a_hub_dataset_streams_through_the_datasets_library(ray_local, tmp_path):
    """The hub path (datasets.load_dataset(streaming=True) -> Ray), on a local folder the datasets library
    loads as it loads a hub repository's files (the hub itself is unreachable here)."""
    from entmtp_ray.pipeline.streams import read_prompts
    from entmtp_ray.pipeline.tasks import PromptSpec

    folder = tmp_path / "hubby"
    folder.mkdir()
    pq.write_table(pa.table({"question": [f"q{i}" for i in range(7)], "n": list(range(7))}), folder / "train.parquet")
    spec = PromptSpec("hub", str(folder), "gsm8k", "question", split="train")
    rows = sorted(read_prompts(spec).take_all(), key=lambda r: r["id"])
    assert [r["id"] for r in rows] == [f"row-{i:07d}" for i in range(7)]
    assert [r["prompt"] for r in rows] == [f"q{i}" for i in range(7)] and [r["n"] for r in rows] == list(range(7))


def test_the_named_tasks_stream_through_the_same_plane(ray_local):
    """HumanEval (the package's own file) and ShareGPT (one read task parsing the wheel) give the rows the
    in-memory reader gives; --limit samples them by id."""
    from entmtp_ray.pipeline.streams import read_prompts, sample
    from entmtp_ray.pipeline.tasks import load_prompts, prompt_spec, sample_keys

    humaneval = read_prompts(prompt_spec("humaneval", None)).take_all()
    assert sorted(r["id"] for r in humaneval) == sorted(load_prompts("humaneval", None).column("id").to_pylist())
    every = load_prompts("sharegpt", None).column("id").to_pylist()
    lowest = sorted(every[i] for i in sample_keys(every, 3).argsort()[:5])
    assert sorted(r["id"] for r in sample(read_prompts(prompt_spec("sharegpt", None)), 5, 3).take_all()) == lowest


def test_the_driver_resolves_the_plan_once_and_an_actor_builds_from_it_without_resolving(tiny_model_dirs, ray_local,
                                                                                          monkeypatch):
    """The plan is decided once, by the driver, for the placed actors; an actor receives it and builds its engine
    from it (its bank inside it) with no resolution of its own."""
    from entmtp_ray.config import DecodingConfig, ModelConfig, ProcessorConfig
    from entmtp_ray.pipeline import assemble
    from entmtp_ray.pipeline import processor as stage
    from entmtp_ray.pipeline.placement import ActorPlacement

    model_dir, heads_dir = tiny_model_dirs
    model = ModelConfig(model=str(model_dir), heads=str(heads_dir), dtype="fp32", device="cpu")
    processor = stage.Processor(ProcessorConfig(model=model, decoding=DecodingConfig(policy="hydra",
                                                                                     max_new_tokens=4)))
    processor.placement = ActorPlacement(gpus=0.0, device="cpu", auto=True)
    calls, real = [], stage.resolve
    monkeypatch.setattr(stage, "resolve", lambda *args, **kwargs: calls.append(args) or real(*args, **kwargs))
    plan = processor.plan
    assert processor.plan is plan and len(calls) == 1 and calls[0][2].on_gpu is False  # for the placed actors

    def refuse(*args, **kwargs):
        raise AssertionError("a plan resolved outside the driver")

    monkeypatch.setattr(stage, "resolve", refuse)
    monkeypatch.setattr(assemble, "resolve", refuse)
    actor = stage.GenerateActor(model.model_dump(), plan, threads=1)  # in this process: no Ray worker to hide it
    assert actor.engine.plan is plan and actor.engine.decoding == plan.decoding
    row = actor.engine.run("r", "Write a poem.")
    assert row["error"] is None and row["policy"] == "hydra" and row["num_output_tokens"] > 0


def test_the_actors_dtype_is_asked_of_a_worker_once_when_cpu_actors_pick_it(ray_local):
    """--dtype auto on CPU actors: bf16 where their host has native bf16, else fp32; a Ray task with an actor's
    CPUs asks (this host is the worker here), once per job, and a --dtype given needs no task."""
    from entmtp_ray.config import ModelConfig, ProcessorConfig
    from entmtp_ray.pipeline.assemble import actors_here
    from entmtp_ray.pipeline.placement import ActorPlacement
    from entmtp_ray.pipeline.processor import Processor

    cpu = ActorPlacement(gpus=0.0, device="cpu", auto=True)
    processor = Processor(ProcessorConfig())
    processor.placement = cpu
    assert processor.actors(cpu).dtype is None  # not known before it is asked (placing must not wait for a node)
    processor.ask_actors()
    here = actors_here(ModelConfig(device="cpu")).dtype
    assert processor.actors(cpu).dtype == here and processor._dtype == here  # kept for the job's later resolves
    assert processor.plan.bank.hardware.dtype == here  # resolved again: the default bank's variant for that dtype
    assert Processor(ProcessorConfig(model=ModelConfig(dtype="bf16"))).actors(cpu).dtype == "bfloat16"
    assert Processor(ProcessorConfig(model=ModelConfig(dtype="auto"))).actors(
        ActorPlacement(gpus=1.0, device="cuda", auto=True)).dtype == "float16"  # what auto picks on any GPU
    local = Processor(ProcessorConfig())  # a local Ray the job started: its actors run on this CPU, nothing asked
    local.placement = cpu
    local.ask_actors(local=True)
    assert local._dtype == here and local.plan.bank.hardware.dtype == here


def test_a_small_local_dataset_is_scanned_here_as_ray_tasks_scan_it(ray_local, tmp_path, monkeypatch):
    """scan_files types small local files in the driver's process (no worker to wait for before the plan) and
    anything else by a Ray task per file: the same kinds either way, a column mixing int and text made text."""
    from entmtp_ray.pipeline import streams
    from entmtp_ray.pipeline.tasks import open_source, prompt_spec

    root = write_folder(tmp_path / "data")
    (root / "mixed.jsonl").write_text(json.dumps({"prompt": "m0", "k": 1}) + "\n" + json.dumps({"prompt": "m1", "k": "x"})
                                      + "\n")
    spec = prompt_spec(None, str(root))
    source = open_source(spec)
    calls = []
    remote = streams._scan_file.remote
    monkeypatch.setattr(streams._scan_file, "remote", lambda *a: calls.append(a) or remote(*a))
    here = streams.scan_files(spec, source)
    assert not calls, "a small local dataset went to Ray tasks"
    monkeypatch.setattr(streams, "SCAN_HERE_BYTES", 0)
    by_tasks = streams.scan_files(spec, source)
    assert len(calls) == len(source.files)
    assert here.types == by_tasks.types and dict(here.types)["k"] == "text"
