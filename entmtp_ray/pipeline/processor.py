"""The generation stage as a Ray Data transform: `build_processor(config)(dataset)` -> a lazy Dataset with the
output columns (docs/design.md §5) added to every row. The job (jobs/generate.py) is a thin CLI over it;
users put it inside their own pipelines:

    processor = build_processor(ProcessorConfig(decoding=DecodingConfig(policy="entmtp-tau", task="gsm8k")))
    ds = ray.data.read_parquet("s3://bucket/questions/").rename_columns({"question": "prompt"})
    processor(ds).write_parquet("s3://bucket/labels/")

Nothing algorithmic here: each actor of the pool wraps one engine.Engine. A broken config fails in
build_processor, before any work; a bad row becomes a row with `error` set; an actor whose process is broken
(out of memory, a CUDA device error) exits, and Ray Data restarts it and retries its rows. The GPUs an actor
reserves and the device it loads on follow pipeline/placement.py, from the cluster's GPUs when the stage is
first applied (the job decides it earlier, in dataplane.connect); an actor given a GPU it cannot use fails.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pyarrow as pa
import ray
from ray.data import ActorPoolStrategy, DataContext

from entmtp_ray.config import DecodingConfig, ModelConfig, ProcessorConfig
from entmtp_ray.model.loading import cuda_problem
from entmtp_ray.pipeline.assemble import plan
from entmtp_ray.pipeline.engine import EngineBroken
from entmtp_ray.pipeline.placement import ActorPlacement, check_device, place_actors
from entmtp_ray.pipeline.records import output_table
from entmtp_ray.pipeline.sampling import SAMPLE_INDEX, SAMPLING, expand, sample_key
from entmtp_ray.pipeline.tasks import INTERNAL_COLUMNS, PromptSpec, standardize

log = logging.getLogger(__name__)

ROW_COLUMNS = (*INTERNAL_COLUMNS, SAMPLE_INDEX, SAMPLING)  # what the actor reads of a row; not passed through

# Fault injection for the exactly-once tests: the actor that meets this row id (or sample key) fails, once (the
# marker file records that it happened): it exits abruptly (kind `exit`), or its engine reports
# itself broken (kind `broken`, as an out-of-memory error would).
FAULT_ROW_ENV = "ENTMTP_FAULT_EXIT_ON_ROW"
FAULT_MARKER_ENV = "ENTMTP_FAULT_MARKER"
FAULT_KIND_ENV = "ENTMTP_FAULT_KIND"


class GenerateActor:
    """Callable class for map_batches: loads model, heads and policy once, then decodes row by row."""

    def __init__(self, model_cfg: dict, decoding: dict, threads: int):
        import torch

        from entmtp_ray.pipeline.engine import Engine

        if model_cfg["device"] == "cuda":
            check_assigned_gpu()
        torch.set_num_threads(max(1, threads))
        self.engine = Engine(ModelConfig(**model_cfg), DecodingConfig(**decoding))
        self.engine.actor_id = ray.get_runtime_context().get_actor_id()
        self.engine.warm_up()

    def __call__(self, batch: pa.Table) -> pa.Table:
        rows = []
        for row in batch.select(list(ROW_COLUMNS)).to_pylist():
            index = row[SAMPLE_INDEX]
            if row["_input_error"]:
                rows.append(self.engine.error_row(row["id"], row["prompt"], row["_input_error"], index))
                continue
            messages = json.loads(row["_messages"]) if row["_messages"] else None
            overrides = json.loads(row[SAMPLING]) if row[SAMPLING] else None
            try:
                _maybe_fault(row["id"], index)
                rows.append(self.engine.run(row["id"], row["prompt"], messages, index, overrides))
            except EngineBroken:
                # this actor is unusable: end it, and Ray Data restarts it and retries the block
                log.exception("actor %s is broken; exiting so that Ray retries its rows", self.engine.actor_id)
                os._exit(1)
        passthrough = batch.drop_columns([c for c in ROW_COLUMNS if c in batch.column_names])
        return output_table(passthrough, rows)


def check_assigned_gpu() -> None:
    """In an actor that reserved GPUs: fail, naming the fix, unless torch can use the one Ray assigned (never
    fall back to a CPU run of a model sized for a GPU)."""
    problem = cuda_problem()
    if problem:
        raise RuntimeError(f"this actor on {ray.util.get_node_ip_address()} was assigned GPU {ray.get_gpu_ids()} by "
                           f"Ray, but {problem}")


def _maybe_fault(row_id: str | None, sample_index: int = 0) -> None:
    target, marker = os.environ.get(FAULT_ROW_ENV), os.environ.get(FAULT_MARKER_ENV)
    if target and marker and target in (row_id, sample_key(row_id, sample_index)) and not os.path.exists(marker):
        Path(marker).write_text(str(os.getpid()))
        if os.environ.get(FAULT_KIND_ENV, "exit") == "broken":
            raise EngineBroken(f"row {row_id}: injected fault")
        os._exit(1)


class Processor:
    """The generation stage of one configuration; call it on a Dataset of prompts."""

    def __init__(self, config: ProcessorConfig):
        self.plan = plan(config.model, config.decoding)  # a broken config fails here, before any work
        # the actors, rows and manifest see the policy that runs (`auto` resolved once, here)
        self.config = config.model_copy(update={"decoding": self.plan.decoding})
        check_device(config.model.device, config.pool.gpus_per_actor)
        self.spec = PromptSpec("dataset", None, config.decoding.task, config.prompt_column, config.id_column,
                               config.messages_column)
        self.placement: ActorPlacement | None = None  # decided once Ray is up (dataplane.connect, or generate)

    def place(self) -> ActorPlacement:
        """The actors' GPUs and device on the connected Ray cluster (placement.place_actors), decided once."""
        if self.placement is None:
            if not ray.is_initialized():
                ray.init()  # as Ray Data itself would, when the dataset first runs
            gpus = ray.cluster_resources().get("GPU", 0.0)
            self.placement = place_actors(self.config.model.device, self.config.pool.gpus_per_actor, gpus)
        return self.placement

    def __call__(self, dataset: "ray.data.Dataset") -> "ray.data.Dataset":
        """`dataset` rows with a prompt (or messages) column -> rows with the output columns added (the
        dataset's other columns follow them, renamed `input_<name>` where the output uses the name)."""
        spec = self.spec
        prompts = dataset.map_batches(lambda batch: standardize(batch, spec), batch_format="pyarrow",
                                      batch_size=None)
        return self.generate(prompts)

    def generate(self, prompts: "ray.data.Dataset") -> "ray.data.Dataset":
        """The stage on rows that already hold the prompt columns (tasks.standardize's output)."""
        return self.decode(self.expand(prompts))

    def expand(self, prompts: "ray.data.Dataset") -> "ray.data.Dataset":
        """Prompt rows -> one row per sample, their sampling_params checked (pipeline/sampling.py)."""
        decoding = self.config.decoding
        return prompts.map_batches(lambda batch: expand(batch, decoding), batch_format="pyarrow", batch_size=None)

    def decode(self, samples: "ray.data.Dataset") -> "ray.data.Dataset":
        """The actor pool over expanded rows (`expand`'s output): one output row per sample."""
        pool, placement = self.config.pool, self.place()
        DataContext.get_current().max_errored_blocks = 0  # never drop a failed block silently
        return samples.repartition(target_num_rows_per_block=pool.rows_per_block).map_batches(
            GenerateActor,
            fn_constructor_kwargs={"model_cfg": self.config.model.model_dump() | {"device": placement.device},
                                   "decoding": self.config.decoding.model_dump(),
                                   "threads": max(1, int(pool.cpus_per_actor))},
            batch_size=1,
            batch_format="pyarrow",
            compute=ActorPoolStrategy(min_size=pool.min_actors, max_size=pool.max_actors),
            num_cpus=pool.cpus_per_actor,
            num_gpus=placement.gpus,
        )


def build_processor(config: ProcessorConfig | dict | None = None) -> Processor:
    """The generation stage for `config` (a ProcessorConfig or its dict); see the module docstring."""
    if config is None:
        config = ProcessorConfig()
    elif isinstance(config, dict):
        config = ProcessorConfig(**config)
    return Processor(config)
