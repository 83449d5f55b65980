"""Where a job's actors run and where its output may go (pipeline/placement.py), as pure rules on the facts the
job gathers from its Ray cluster: GPUs per actor and the device an actor loads on, whether a job spans nodes,
and whether a local --output is on a filesystem every node sees."""

from __future__ import annotations

import pytest

from entmtp_ray.pipeline.placement import (ActorPlacement, check_device, mount_of, output_problem, parse_mounts,
                                           place_actors, spans_nodes)
from entmtp_ray.pipeline.sources import Location

# /proc/mounts of a cluster.yaml worker: the root disk, the instance's NVMe, EFS on /shared (NFS 4.1, as the
# setup mounts it), a FUSE mount of S3, a folder with a space, and a local disk mounted inside the EFS folder
MOUNTS = """\
/dev/root / ext4 rw,relatime,discard,errors=remount-ro 0 0
proc /proc proc rw,nosuid,nodev,noexec,relatime 0 0
tmpfs /run tmpfs rw,nosuid,nodev,size=78612248k,mode=755,inode64 0 0
/dev/nvme1n1 /opt/dlami/nvme ext4 rw,relatime 0 0
fs-0123456789abcdef0.efs.us-west-2.amazonaws.com:/ /shared nfs4 rw,relatime,vers=4.1,rsize=1048576,wsize=1048576,hard,noresvport,proto=tcp,timeo=600,retrans=2,sec=sys 0 0
mountpoint-s3 /mnt/s3 fuse.mountpoint-s3 rw,nosuid,nodev,noatime,user_id=1000,group_id=1000 0 0
/dev/nvme2n1 /data/my\\040runs xfs rw,relatime 0 0
/dev/nvme3n1 /shared/scratch ext4 rw,relatime 0 0
host0 /mnt/host 9p rw,relatime,trans=virtio 0 0
"""
SPANS = "a Ray cluster of 3 nodes"


# ---- GPUs per actor and the device it loads on --------------------------------------------------

@pytest.mark.parametrize("device, flag, cluster_gpus, want", [
    # absent --gpus-per-actor: cuda asks for a GPU, cpu for none, auto for one when the cluster has GPUs now
    ("cuda", None, 0, ActorPlacement(1.0, "cuda", True)),
    ("cuda:3", None, 8, ActorPlacement(1.0, "cuda", True)),  # Ray's GPU is cuda:0 in the actor, whatever N
    ("cpu", None, 8, ActorPlacement(0.0, "cpu", True)),
    ("auto", None, 8, ActorPlacement(1.0, "cuda", True)),
    ("auto", None, 0, ActorPlacement(0.0, "cpu", True)),  # an actor without a GPU never touches CUDA
    # an explicit value wins, fractions included (two actors share one GPU at 0.5)
    ("auto", 0.5, 0, ActorPlacement(0.5, "cuda", False)),
    ("cuda", 0.25, 8, ActorPlacement(0.25, "cuda", False)),
    ("auto", 0.0, 8, ActorPlacement(0.0, "cpu", False)),
    ("cpu", 1.0, 0, ActorPlacement(1.0, "cpu", False)),  # a GPU reserved but not used: honoured as asked
])
def test_gpus_per_actor_and_device(device, flag, cluster_gpus, want):
    assert place_actors(device, flag, cluster_gpus) == want


@pytest.mark.parametrize("device, flag, message", [
    ("cuda", 0.0, "--gpus-per-actor 1"),
    ("cuda:1", 0, "--device cpu"),
    ("gpu", None, "choose cpu, cuda, cuda:N or auto"),
    ("cuda:x", 1.0, "choose cpu, cuda, cuda:N or auto"),
])
def test_a_device_the_pool_cannot_place_is_a_config_error(device, flag, message):
    with pytest.raises(ValueError, match=message.replace("-", r"\-").replace(".", r"\.")):
        check_device(device, flag)
    with pytest.raises(ValueError):
        place_actors(device, flag, 8)


# ---- multi-node ----------------------------------------------------------------------------------

def test_a_job_spans_nodes_with_more_than_one_node_or_a_driver_node_that_cannot_host_an_actor():
    assert spans_nodes(1, {"CPU": 4.0}, 1.0, 0.0) is None  # `ray start --head --num-cpus=4`, one actor fits
    assert spans_nodes(1, {"CPU": 8.0, "GPU": 1.0}, 1.0, 0.5) is None
    assert spans_nodes(2, {"CPU": 8.0}, 1.0, 0.0) == "a Ray cluster of 2 nodes"
    head = spans_nodes(1, {"CPU": 0.0}, 1.0, 1.0)  # cluster.yaml before any worker: CPU 0, no GPU
    assert "0 of the 1 CPU and 0 of the 1 GPU one needs" in head and "autoscaler" in head
    assert "0 of the 1 GPU" in spans_nodes(1, {"CPU": 16.0}, 1.0, 1.0)
    assert "2 of the 4 CPU" in spans_nodes(1, {"CPU": 2.0, "memory": 1e9}, 4.0, 0.0)


# ---- node-local output -------------------------------------------------------------------------------

def test_mount_table_lines_unescape_and_the_longest_mount_point_holds_a_path():
    mounts = parse_mounts(MOUNTS)
    assert ("/data/my runs", "xfs") in mounts and len(mounts) == 9
    assert mount_of("/home/ubuntu/out", mounts) == ("/", "ext4")
    assert mount_of("/shared", mounts) == ("/shared", "nfs4")
    assert mount_of("/shared/gsm8k/part", mounts) == ("/shared", "nfs4")
    assert mount_of("/sharedx/out", mounts) == ("/", "ext4"), "a mount point holds its own folder, not a prefix"
    assert mount_of("/shared/scratch/out", mounts) == ("/shared/scratch", "ext4")
    assert mount_of("/data/my runs/x", mounts) == ("/data/my runs", "xfs")
    assert mount_of("/x", []) is None
    # the kernel's latest mount on a point hides earlier ones
    assert mount_of("/shared/a", parse_mounts(MOUNTS + "tmpfs /shared tmpfs rw 0 0\n")) == ("/shared", "tmpfs")


@pytest.mark.parametrize("output", ["/home/ubuntu/out", "/opt/dlami/nvme/out", "/shared/scratch/out",
                                    "/data/my runs/out", "/mnt/host/out", "file:///home/ubuntu/out", "relative/out"])
def test_a_node_local_output_is_refused_on_a_multi_node_job_naming_the_fix(output):
    problem = output_problem(Location.of(output), SPANS, MOUNTS)
    assert problem is not None and SPANS in problem
    for fix in ("s3://bucket/prefix/", "EFS", "--output-shared"):
        assert fix in problem


@pytest.mark.parametrize("output", ["/shared/gsm8k", "/shared", "/mnt/s3/labels"])
def test_an_output_on_a_shared_filesystem_is_accepted(output):
    assert output_problem(Location.of(output), SPANS, MOUNTS) is None


def test_object_stores_one_node_jobs_and_a_declared_shared_path_are_accepted(tmp_path):
    assert output_problem(Location.of("memory://bucket/out"), SPANS, MOUNTS) is None  # not a local path
    assert output_problem(Location.of("/home/ubuntu/out"), None, MOUNTS) is None  # one node: every path is seen
    assert output_problem(Location.of("/home/ubuntu/out"), SPANS, MOUNTS, declared_shared=True) is None
    assert output_problem(Location.of("/anywhere"), SPANS, "") is not None  # no mount table: counts as local


def test_a_symlink_into_the_shared_mount_counts_as_shared(tmp_path):
    target = tmp_path / "efs"
    target.mkdir()
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "out").symlink_to(target)
    mounts = f"/dev/root / ext4 rw 0 0\nfs-1:/ {target} nfs4 rw 0 0\n"
    assert output_problem(Location.of(str(tmp_path / "home" / "out" / "run1")), SPANS, mounts) is None
    assert output_problem(Location.of(str(tmp_path / "home" / "run1")), SPANS, mounts) is not None
