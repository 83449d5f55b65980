"""What a job checks once it has joined its Ray cluster, on real local clusters (ray.cluster_utils.Cluster): an
--output on one node's disk is refused when the job spans nodes (more than one node, or a head that cannot host
an actor, as cluster.yaml's CPU: 0 head), and a GPU that torch cannot use is refused where the actors would run
(a fake GPU Ray declares on this CPU machine); either exits 2 before anything is written. A local Ray the job
starts is one node, and its GPUs are the driver's.

Each test's Ray lives under its own directory (tests/helpers/raytools.py); only its processes are stopped after.
"""

from __future__ import annotations

import json

import pytest
import torch

from helpers import raytools
from helpers.jobs import job_args, read_output, run_job, write_prompts

pytestmark = pytest.mark.slow

CPU_ONLY_FIX = f"pip install torch=={torch.__version__.split('+')[0]} --index-url https://download.pytorch.org/whl/cu1"


@pytest.fixture(autouse=True)
def own_ray(monkeypatch):
    with raytools.own_ray_env(monkeypatch, "rc-") as temp_dir:
        yield temp_dir


@pytest.fixture
def cluster():
    """A function starting a local multi-node cluster: node resources in, GCS address out; shut down after."""
    from ray.cluster_utils import Cluster

    started = []

    def start(*nodes: dict) -> str:
        c = Cluster(initialize_head=True, head_node_args=nodes[0])
        started.append(c)
        for node in nodes[1:]:
            c.add_node(**node)
        c.wait_for_nodes()
        return c.address

    yield start
    for c in started:
        c.shutdown()


def refused(proc, output) -> str:
    assert proc.returncode == 2, (proc.stdout + proc.stderr)[-3000:]
    assert not output.exists(), "nothing may be written before the checks pass"
    return proc.stderr


@pytest.mark.parametrize("nodes, reason", [
    ([{"num_cpus": 1}, {"num_cpus": 2}], "a Ray cluster of 2 nodes"),
    ([{"num_cpus": 0}], "driver node cannot host an actor (it has 0 of the 1 CPU one needs)"),
], ids=["two-nodes", "cpu0-head"])
def test_a_node_local_output_on_a_multi_node_cluster_exits_2_before_writing(tiny_model_dirs, tmp_path, cluster,
                                                                          nodes, reason):
    address = cluster(*nodes)
    data = write_prompts(tmp_path / "prompts.jsonl", 2)
    output = tmp_path / "out"
    stderr = refused(run_job(job_args(tiny_model_dirs, data, output, "--address", address)), output)
    assert f"error: --output {output} is on the " in stderr and reason in stderr, stderr[-3000:]
    assert "s3://bucket/prefix/" in stderr and "--output-shared" in stderr


def test_a_declared_shared_output_runs_on_two_nodes(tiny_model_dirs, tmp_path, cluster):
    """Nodes on one machine share its disk: --output-shared says so, and the job runs."""
    address = cluster({"num_cpus": 1}, {"num_cpus": 2})
    data = write_prompts(tmp_path / "prompts.jsonl", 3)
    proc = run_job(job_args(tiny_model_dirs, data, tmp_path / "out", "--address", address, "--output-shared",
                            "--policy", "ar"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["rows"] == 3
    assert len(read_output(tmp_path / "out")) == 3


@pytest.mark.parametrize("device", ["cuda", "auto"])
def test_no_usable_gpu_where_the_actors_run_exits_2(tiny_model_dirs, tmp_path, cluster, device):
    """A node declaring a GPU that this CPU-only torch cannot use: Ray sets CUDA_VISIBLE_DEVICES for the task
    that reserves it, torch finds no CUDA build. --device cuda asks for a GPU per actor; --device auto does so
    because the cluster has a GPU, and must fail rather than run the model on CPU."""
    address = cluster({"num_cpus": 4, "num_gpus": 1})
    data = write_prompts(tmp_path / "prompts.jsonl", 2)
    output = tmp_path / "out"
    stderr = refused(run_job(job_args(tiny_model_dirs, data, output, "--address", address, "--device", device)),
                     output)
    assert "a task given GPU [0] on node" in stderr and "CPU-only build" in stderr and CPU_ONLY_FIX in stderr


def test_an_actor_given_a_gpu_torch_cannot_use_fails_naming_the_fix(tiny_model_dirs):
    """The actor's own check, for pipelines that apply the processor without the job's checks."""
    import ray

    from entmtp_ray.config import DecodingConfig, ModelConfig
    from entmtp_ray.pipeline.assemble import fixed_plan
    from entmtp_ray.pipeline.processor import GenerateActor

    model_dir, heads_dir = tiny_model_dirs
    ray.shutdown()  # the session's shared Ray, if a test before joined it
    ray.init(num_cpus=2, num_gpus=1, include_dashboard=False)
    try:
        actor = ray.remote(num_cpus=1, num_gpus=1)(GenerateActor).remote(
            ModelConfig(model=str(model_dir), heads=str(heads_dir), device="cuda").model_dump(),
            fixed_plan(DecodingConfig(policy="ar")), 1)
        with pytest.raises(ray.exceptions.ActorDiedError) as caught:
            ray.get(actor.__ray_ready__.remote(), timeout=120)
        message = str(caught.value)
        assert "was assigned GPU [0] by Ray, but this torch" in message and CPU_ONLY_FIX in message
    finally:
        ray.shutdown()


@pytest.mark.parametrize("extra, message", [
    (["--device", "cuda"], "--device cuda: this torch"),
    (["--gpus-per-actor", "1"], "--gpus-per-actor 1: this machine has 0 GPUs"),
    (["--device", "cuda", "--gpus-per-actor", "0"], "with --gpus-per-actor 0"),
])
def test_a_local_job_asking_for_a_gpu_this_machine_lacks_exits_2(tiny_model_dirs, tmp_path, extra, message):
    data = write_prompts(tmp_path / "prompts.jsonl", 2)
    output = tmp_path / "out"
    stderr = refused(run_job(job_args(tiny_model_dirs, data, output, *extra)), output)
    assert message in stderr, stderr[-3000:]
    if extra[:2] == ["--device", "cuda"]:  # config and driver checks: before a local Ray starts
        assert "Started a local Ray instance" not in stderr

