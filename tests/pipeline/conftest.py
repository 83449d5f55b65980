"""`own_ray`, for the modules of this folder that ask for it (test_pipeline and test_s3, each with
`pytestmark = pytest.mark.usefixtures("own_ray")`, so it runs around each of their tests); the modules that
start their Ray otherwise define their own `own_ray`."""

from __future__ import annotations

import pytest

from helpers import raytools


@pytest.fixture
def own_ray(monkeypatch):
    """This test's Ray directory, in the environment of the test (the in-process Cluster) and of
    every job it runs; a local Ray started by a job puts its session under it, and afterwards
    whatever of it is left is stopped (named in a warning) and checked gone."""
    with raytools.own_ray_env(monkeypatch, "rp-") as temp_dir:
        yield temp_dir
