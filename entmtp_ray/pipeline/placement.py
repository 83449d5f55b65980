"""Where a job's actors run and where its output must be, decided from facts about the Ray cluster it joined
(pipeline/dataplane.py gathers them): the GPUs an actor reserves and the device it loads on, whether the job
spans nodes, and whether a local --output is seen by all of them. No Ray here.

GPUs per actor: an explicit --gpus-per-actor wins; absent, 1 with --device cuda[:N], 0 with --device cpu, and
with --device auto 1 when the cluster has GPUs when the job starts, else 0. An autoscaling cluster whose GPU
nodes are not up yet reports none, so pass --gpus-per-actor there (Ray 2.60 has no public API that lists the
autoscaler's node types). An actor that reserves GPUs loads on `cuda`: Ray sets CUDA_VISIBLE_DEVICES to the GPU
it assigned, which is cuda:0 inside the actor, and actors with fractions of one GPU share it. An actor without
GPUs never touches CUDA (auto becomes cpu; --device cuda with --gpus-per-actor 0 is refused).

Multi-node: the job spans nodes when the cluster has more than one alive node, or when the driver's node cannot
host one actor (cluster.yaml's head has CPU: 0, so every actor and Ray Data task lands on a worker the
autoscaler adds). Then a node-local --output would scatter the Parquet files over the workers' disks.

Node-local: a local path (no URI scheme, or file://) on a filesystem that is not one every node can mount: the
longest mount point of /proc/self/mounts that holds the path (symlinks resolved) decides, by its type.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from entmtp_ray.pipeline.sources import Location

DEVICES = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")
MOUNTS_FILE = "/proc/self/mounts"

# Mount types whose files every node of a cluster sees: network and cluster filesystems, and FUSE mounts of
# object stores or cluster filesystems. 9p and virtiofs are not among them: they share a host's folder with
# its virtual machines, not a folder between machines.
SHARED_FILESYSTEMS = frozenset({
    "nfs", "nfs4", "efs", "lustre", "cifs", "smb3", "smbfs", "gpfs", "beegfs", "ceph", "glusterfs", "wekafs",
    "fuse.glusterfs", "fuse.ceph-fuse", "fuse.s3fs", "fuse.gcsfuse", "fuse.mountpoint-s3", "fuse.goofys",
    "fuse.geesefs", "fuse.juicefs", "fuse.alluxio-fuse", "fuse.blobfuse2",
})


@dataclass(frozen=True)
class ActorPlacement:
    """What each actor of the pool reserves from Ray and loads on."""

    gpus: float  # Ray's num_gpus per actor (a fraction shares one GPU)
    device: str  # "cpu" or "cuda": with GPUs, Ray's assignment is cuda:0 in the actor's process
    auto: bool  # gpus was chosen here (no --gpus-per-actor)


def check_device(device: str, gpus_per_actor: float | None) -> None:
    """Refuse, before any Ray work, a device string the pool cannot place, or CUDA without a GPU per actor."""
    if not DEVICES.match(device):
        raise ValueError(f"--device {device!r}: choose cpu, cuda, cuda:N or auto")
    if device.startswith("cuda") and gpus_per_actor == 0:
        raise ValueError(f"--device {device} with --gpus-per-actor 0: Ray would give the actors no GPU, so they would "
                         "all load on whatever GPU they find; pass --gpus-per-actor 1 (or a fraction such as 0.5 "
                         "to share one), or --device cpu")


def place_actors(device: str, gpus_per_actor: float | None, cluster_gpus: float) -> ActorPlacement:
    """GPUs per actor and the device it loads on (module docstring); `cluster_gpus`: the GPUs the Ray
    cluster has now (ray.cluster_resources())."""
    check_device(device, gpus_per_actor)
    auto = gpus_per_actor is None
    if auto:
        gpus = 1.0 if device.startswith("cuda") or (device == "auto" and cluster_gpus > 0) else 0.0
    else:
        gpus = float(gpus_per_actor)
    if gpus == 0:
        return ActorPlacement(0.0, "cpu", auto)
    # cpu with GPUs reserved is honoured (e.g. to exercise GPU autoscaling without GPUs); anything else is
    # the GPU Ray assigned, whatever index --device named (indexes are the node's, not the actor's)
    return ActorPlacement(gpus, "cpu" if device == "cpu" else "cuda", auto)


def spans_nodes(alive_nodes: int, driver_resources: dict, cpus_per_actor: float, gpus_per_actor: float) -> str | None:
    """Why the job's actors and tasks run on other nodes than the driver's; None when they all fit on it."""
    if alive_nodes > 1:
        return f"a Ray cluster of {alive_nodes} nodes"
    short = [f"{driver_resources.get(name, 0):g} of the {need:g} {name}" for name, need in
             (("CPU", cpus_per_actor), ("GPU", gpus_per_actor)) if need > driver_resources.get(name, 0)]
    if short:
        return (f"a Ray cluster whose driver node cannot host an actor (it has {' and '.join(short)} one needs), "
                "so the actors and the write tasks run on nodes the autoscaler adds")
    return None


def parse_mounts(text: str) -> list[tuple[str, str]]:
    """(mount point, filesystem type) of each line of a mount table (/proc/mounts format: octal escapes for
    spaces and the like in the mount point)."""
    mounts = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) >= 3:
            point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[1])
            mounts.append((point, fields[2]))
    return mounts


def mount_of(path: str, mounts: list[tuple[str, str]]) -> tuple[str, str] | None:
    """The (mount point, type) that holds absolute `path`: the longest mount point that is `path` or one of
    its parent folders (the last such line wins, as the kernel's latest mount hides earlier ones)."""
    best = None
    for point, fstype in mounts:
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best[0])):
            best = (point, fstype)
    return best


def read_mounts() -> str:
    """This machine's mount table ('' where there is none, e.g. macOS: every local path then counts as local)."""
    try:
        with open(MOUNTS_FILE, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def output_problem(location: Location, spans: str | None, mounts_text: str, declared_shared: bool = False) -> str | None:
    """Why `location` cannot take a job that runs on `spans` (spans_nodes' reason; None: one node), or None."""
    if spans is None or declared_shared or not location.is_local:
        return None
    path = os.path.realpath(os.path.expanduser(location.path))  # a symlink into a shared mount counts as shared
    mount = mount_of(path, parse_mounts(mounts_text))
    if mount is not None and mount[1] in SHARED_FILESYSTEMS:
        return None
    where = f"the {mount[1]} filesystem mounted at {mount[0]}" if mount else "a filesystem of this node"
    return (f"--output {location.uri} is on {where}, local to the driver's node, but the job runs on {spans}: the "
            "Parquet files would land on the workers' own disks. Write to an object store (--output "
            "s3://bucket/prefix/) or to a path on a filesystem every node mounts (EFS/NFS: /shared/... with EFS_ID "
            "set in cluster.yaml); if this path is shared in a way this check does not know, pass --output-shared")
