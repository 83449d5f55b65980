"""Inputs and outputs on an object store: an S3 server (moto's) that the test starts on 127.0.0.1 holds the
prompts and receives the Parquet output, through pyarrow's S3 filesystem in the job and in every Ray worker
(given the endpoint in their environment, as a cluster's workers would be given credentials).

Covered: a job end to end, then a resume that completes it; a multi-file Parquet folder as input and a glob listed;
a resume with other settings refused, naming them.
"""

from __future__ import annotations

import json
import os
import socket

import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from entmtp_ray.pipeline.sources import list_source
from helpers.jobs import environment, run_here

pytestmark = pytest.mark.slow
BUCKET = "entmtp-test"


@pytest.fixture(scope="module")
def s3_env():
    """Start an S3 server on a free local port with one bucket; the environment that points S3 clients at it."""
    from moto.server import ThreadedMotoServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_REGION": "us-east-1", "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
           "AWS_EC2_METADATA_DISABLED": "true"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        import boto3

        boto3.client("s3").create_bucket(Bucket=BUCKET)
        yield env
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        server.stop()


def s3() -> pafs.S3FileSystem:
    return pafs.S3FileSystem(endpoint_override=os.environ["AWS_ENDPOINT_URL"], region="us-east-1")


def put(key: str, data: bytes) -> str:
    with s3().open_output_stream(f"{BUCKET}/{key}") as f:
        f.write(data)
    return f"s3://{BUCKET}/{key}"


def put_table(key: str, table: pa.Table) -> str:
    with s3().open_output_stream(f"{BUCKET}/{key}") as f:
        pq.write_table(table, f)
    return f"s3://{BUCKET}/{key}"


def output_rows(prefix: str) -> list[dict]:
    return pads.dataset(f"{BUCKET}/{prefix}", filesystem=s3(), format="parquet").to_table().to_pylist()


def job(dirs, dataset: str, output: str, *extra) -> list[str]:
    model_dir, heads_dir = dirs
    return ["--dataset", dataset, "--model", str(model_dir), "--heads", str(heads_dir), "--policy", "ar",
            "--max-new-tokens", "4", "--output", output, *extra]


def summary_of(proc) -> dict:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_job_reads_and_writes_s3_then_a_resume_completes_it_and_other_settings_are_refused(
        s3_env, tiny_model_dirs, ray_cluster):
    lines = [json.dumps({"qid": f"q{i}", "text": f"Write item number {i}.", "label": i}) for i in range(10)]
    source = put("in/prompts.jsonl", ("\n".join(lines) + "\n{broken\n").encode())
    output = f"s3://{BUCKET}/out/run1"
    args = job(tiny_model_dirs, source, output, "--prompt-column", "text", "--id-column", "qid")

    with environment(ray_cluster, s3_env):  # the workers' S3 endpoint (this process has it in os.environ)
        first = summary_of(run_here(args + ["--limit", "4"]))
        assert (first["rows"], first["input_rows"], first["duplicates"]) == (4, 4, 0)
        assert first["output"] == output
        before = {r["id"]: r["started_at"] for r in output_rows("out/run1")}
        assert len(before) == 4
        manifest = json.loads(s3().open_input_stream(f"{BUCKET}/out/run1/_manifest.json").read())
        assert manifest["settings"]["input"]["dataset"] == source

        done = summary_of(run_here(args + ["--resume"]))
        assert (done["rows"], done["input_rows"], done["duplicates"], done["errors"]) == (11, 11, 0, 1)
        rows = output_rows("out/run1")
        assert sorted(r["id"] for r in rows) == sorted([f"q{i}" for i in range(10)] + ["prompts.jsonl:line-11"])
        assert all(r["started_at"] == before[r["id"]] for r in rows if r["id"] in before), "finished rows were redone"
        assert {r["label"] for r in rows if r["error"] is None} == set(range(10))  # the input's type

        refused = run_here(args + ["--resume", "--max-new-tokens", "5"])
    assert refused.returncode == 2 and "decoding.max_new_tokens: 4 -> 5" in refused.stderr, refused.stderr[-2000:]
    assert len(output_rows("out/run1")) == 11


def test_a_parquet_folder_and_a_glob_on_s3(s3_env, tiny_model_dirs, ray_cluster):
    for part in range(3):
        put_table(f"folder/part-{part}.parquet",
                  pa.table({"prompt": [f"Count to {part * 10 + i}." for i in range(4)], "part": [part] * 4}))
    put("folder/_SUCCESS", b"")  # a marker file, as Spark and Ray leave: skipped
    with environment(ray_cluster, s3_env):
        whole = summary_of(run_here(job(tiny_model_dirs, f"s3://{BUCKET}/folder/", f"s3://{BUCKET}/out/folder")))
    assert (whole["rows"], whole["input_rows"], whole["duplicates"], whole["errors"]) == (12, 12, 0, 0)
    ids = sorted(r["id"] for r in output_rows("out/folder"))
    assert ids == sorted(f"part-{p}.parquet:row-{i:07d}" for p in range(3) for i in range(4))
    # a glob lists its files on the store and labels them as the folder does: the job reads whatever files a
    # source lists, the same way (the data plane over a local glob: test_dataplane)
    glob = list_source(f"s3://{BUCKET}/folder/part-[12].parquet")
    assert [glob.label(f) for f in glob.files] == ["part-1.parquet", "part-2.parquet"]
