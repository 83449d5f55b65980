"""Faults injected through the actor a test passes to the job (jobs/generate.main(argv, actor=...) ->
build_processor(..., actor=...)), not through anything the product reads: a GenerateActor whose engine, on meeting
one row (its id, or its sample's key), fails once for the whole job (a marker file records that it happened). Ray
ships the class to its workers by value (this module is registered for it), as a user's own subclass would be."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import ray.cloudpickle

from entmtp_ray.pipeline.engine import EngineBroken
from entmtp_ray.pipeline.processor import GenerateActor
from entmtp_ray.pipeline.sampling import sample_key

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def faulty_actor(row: str, marker: Path, kind: str = "exit") -> type:
    """A GenerateActor that fails at `row` once: the process exits abruptly (`exit`), or its engine reports itself
    broken (`broken`, as an out-of-memory error would: the actor then ends itself)."""

    class FaultyActor(GenerateActor):
        def _load(self, *args):
            engine = super()._load(*args)
            run = engine.run

            def run_or_fail(row_id, prompt, messages=None, sample_index=0, overrides=None):
                if row in (row_id, sample_key(row_id, sample_index)) and not os.path.exists(marker):
                    Path(marker).write_text(str(os.getpid()))
                    if kind == "broken":
                        raise EngineBroken(f"row {row_id}: injected fault")
                    os._exit(1)
                return run(row_id, prompt, messages, sample_index, overrides)

            engine.run = run_or_fail
            return engine

    return FaultyActor
