"""The generation stage as a Ray Data transform: `build_processor(config)(dataset)` -> a lazy Dataset with the
output columns (docs/design.md §5) added to every row. The job (jobs/generate.py) is a thin CLI over it;
users put it inside their own pipelines:

    processor = build_processor(ProcessorConfig(decoding=DecodingConfig(policy="entmtp-tau", task="gsm8k")))
    ds = ray.data.read_parquet("s3://bucket/questions/").rename_columns({"question": "prompt"})
    processor(ds).write_parquet("s3://bucket/labels/")

Nothing algorithmic here: each actor of the pool wraps one engine.Engine, built from the plan the driver resolved
once (assemble.resolve: once the actors are placed and their dtype known, and once more with a bank a calibration
hands it, pipeline/autobank.py); an actor never resolves one. A broken config fails in build_processor, before any
work; a bad row becomes a row with `error` set; an actor whose process is broken
(out of memory, a CUDA device error) exits, and Ray Data restarts it and retries its rows. The GPUs an actor
reserves and the device it loads on follow pipeline/placement.py, from the cluster's GPUs when the stage is
first applied (the job decides it earlier, in dataplane.connect); an actor given a GPU it cannot use fails.
"""

from __future__ import annotations

import json
import logging
import os
import time

import pyarrow as pa
import ray
from ray.data import ActorPoolStrategy, DataContext

from entmtp_ray.calibrate.bank import Actors
from entmtp_ray.config import ModelConfig, PoolConfig, ProcessorConfig
from entmtp_ray.model.loading import cuda_problem
from entmtp_ray.pipeline import autobank
from entmtp_ray.pipeline.assemble import AUTO_BANK, Plan, actors_here, check, resolve
from entmtp_ray.pipeline.autobank import AutoBank, probe_hardware
from entmtp_ray.pipeline.engine import EngineBroken, TorchThread
from entmtp_ray.pipeline.placement import ActorPlacement, check_device, place_actors
from entmtp_ray.pipeline.records import output_table
from entmtp_ray.pipeline.sampling import ROW_COLUMNS, SAMPLE_INDEX, SAMPLING, expand
from entmtp_ray.pipeline.tasks import PromptSpec, standardize

log = logging.getLogger(__name__)

PROBE_PATIENCE_S = 60  # between warnings while a probe task waits for a node (the autoscaler may be adding one)


class GenerateActor:
    """Callable class for map_batches: loads model, heads and policy once, as the driver's `plan` says, then decodes
    row by row."""

    def __init__(self, model_cfg: dict, plan: Plan, threads: int, concurrency: int = 1,
                 ledger: "ray.actor.ActorHandle | None" = None):
        import psutil  # Ray's own copy (ray/thirdparty_files), on the path of every Ray worker

        # this actor's start-up timeline (unix seconds by phase), reported to the job's JobLedger when given
        self.ledger, self.marks = ledger, {"process_up": psutil.Process().create_time(), "init": time.time()}
        self.noted: str | None = None  # the step costs' line last reported to the ledger
        self.torch_thread = None
        if concurrency > 1:
            # Ray runs up to K calls of this actor at once, on threads of its own; each hands its row to the engine's
            # Batcher, which decodes them together on the thread that loaded the model (all torch work of the
            # process on one thread, engine.Batcher)
            self.torch_thread = TorchThread()
            self.engine = self.torch_thread.submit(self._load, model_cfg, plan, threads, concurrency).result()
        else:
            self.engine = self._load(model_cfg, plan, threads, 1)
        self._mark("ready")

    def _mark(self, phase: str) -> None:
        self.marks[phase] = time.time()
        if phase in ("ready", "first_request") and self.ledger is not None:
            actor = ray.get_runtime_context().get_actor_id()
            self.ledger.started.remote(actor, dict(self.marks))
        if phase == "ready":
            self._note_costs()

    def _note_costs(self) -> None:
        """Where the decoder's step costs came from, to the job's ledger: at ready, and again when the engine has
        measured them after its first row (Engine.settle_costs)."""
        costs = self.engine.decoder.costs
        if costs and costs != self.noted and self.ledger is not None:
            self.ledger.note.remote(ray.get_runtime_context().get_actor_id(), "step_costs", costs)
        self.noted = costs

    def _load(self, model_cfg: dict, plan: Plan, threads: int, concurrency: int):
        import torch

        from entmtp_ray.model.attention import DTYPES, fixed_order_ready
        from entmtp_ray.pipeline.engine import Engine

        self._mark("imports")
        if model_cfg["device"] == "cuda":
            check_assigned_gpu()
        torch.set_num_threads(max(1, threads))
        engine = Engine(ModelConfig(**model_cfg), plan, concurrency=concurrency, executor=self.torch_thread,
                        transformers_forward=False)
        self.marks.update(engine.startup)
        engine.actor_id = ray.get_runtime_context().get_actor_id()
        if engine.loaded.device.type == "cpu" and engine.loaded.dtype in DTYPES:
            fixed_order_ready()  # loads (or builds) the kernel now, so that the timeline shows it apart
            self._mark("kernels")
        engine.warm_up()
        self._mark("warm_up")
        return engine

    def __call__(self, batch: pa.Table) -> pa.Table:
        if "first_request" not in self.marks:
            self._mark("first_request")
        rows = []
        for row in batch.select(list(ROW_COLUMNS)).to_pylist():
            index = row[SAMPLE_INDEX]
            if row["_input_error"]:
                rows.append(self.engine.error_row(row["id"], row["prompt"], row["_input_error"], index))
                continue
            messages = json.loads(row["_messages"]) if row["_messages"] else None
            overrides = json.loads(row[SAMPLING]) if row[SAMPLING] else None
            try:
                rows.append(self.engine.run(row["id"], row["prompt"], messages, index, overrides))
            except EngineBroken:
                # this actor is unusable: end it, and Ray Data restarts it and retries the block
                log.exception("actor %s is broken; exiting so that Ray retries its rows", self.engine.actor_id)
                os._exit(1)
        self._note_costs()
        passthrough = batch.drop_columns([c for c in ROW_COLUMNS if c in batch.column_names])
        return output_table(passthrough, rows)


def check_assigned_gpu() -> None:
    """In an actor that reserved GPUs: fail, naming the fix, unless torch can use the one Ray assigned (never
    fall back to a CPU run of a model sized for a GPU)."""
    problem = cuda_problem()
    if problem:
        raise RuntimeError(f"this actor on {ray.util.get_node_ip_address()} was assigned GPU {ray.get_gpu_ids()} by "
                           f"Ray, but {problem}")


class Processor:
    """The generation stage of one configuration; call it on a Dataset of prompts. `actor`: the pool's callable
    class (GenerateActor, or a subclass of it: the tests' faulty actors)."""

    def __init__(self, config: ProcessorConfig, actor: type = GenerateActor):
        self.config = config  # as the user gave it; what runs is self.plan
        check(config.model, config.decoding)  # a broken config fails here, before any work
        check_device(config.model.device, config.pool.gpus_per_actor)
        self.actor = actor
        self.spec = PromptSpec("dataset", None, config.decoding.task, config.prompt_column, config.id_column,
                               config.messages_column)
        self.placement: ActorPlacement | None = None  # decided once Ray is up (dataplane.connect, or generate)
        self._dtype: str | None = None  # the actors' (actors_dtype)
        self._plan: Plan | None = None  # resolved once the actors' facts are known (`plan`)
        self.ledger = None  # a streams.JobLedger the actors report their start-up to (set by dataplane.run_job)

    @property
    def plan(self) -> Plan:
        """What the actors run (assemble.resolve), resolved once, on first use, for the actors as placed (`place`)
        with the dtype they compute in (`ask_actors`): the shipped bank's variant that suits them, or a bank the
        job calibrates when none does; resolved again only with a bank a calibration hands it (`calibrate`). Raises,
        placing nothing, when the plan fails."""
        if self._plan is None:
            self.ask_actors()
            self._plan = resolve(self.config.model, self.config.decoding, self.actors())
            if self._plan.calibrate and self.config.decoding.bank != AUTO_BANK:
                log.warning("--bank auto: %s", self._plan.source)
        return self._plan

    def place(self) -> ActorPlacement:
        """The actors' GPUs and device on the connected Ray cluster (placement.place_actors), decided once."""
        if self.placement is None:
            if not ray.is_initialized():
                ray.init()  # as Ray Data itself would, when the dataset first runs
            gpus = ray.cluster_resources().get("GPU", 0.0)
            self.placement = place_actors(self.config.model.device, self.config.pool.gpus_per_actor, gpus)
        return self.placement

    def actors(self, placement: ActorPlacement | None = None) -> Actors:
        """What the resolver knows of the actors (of `placement`, else of this processor's)."""
        placement = placement or self.placement
        on_gpu = placement.device.startswith("cuda")
        return Actors(on_gpu=on_gpu, concurrency=self.config.pool.concurrent_requests,
                      quantize=self.config.model.quantize, dtype=self.actors_dtype(on_gpu))

    def actors_dtype(self, on_gpu: bool) -> str | None:
        """What the actors compute in: --dtype, or for auto what it picks on their device. On a CPU that depends on
        the host (native bf16 or not): None until ask_actors has asked one."""
        model = self.config.model
        if self._dtype is None and (on_gpu or model.dtype != "auto"):
            return actors_here(model, on_gpu=on_gpu).dtype
        return self._dtype

    def ask_actors(self, local: bool = False) -> None:
        """With --dtype auto on CPU actors, ask a Ray task with an actor's CPUs which dtype it picks there (once per
        job; on an autoscaling cluster it waits for a node, so the job's checks run first); the plan is resolved
        with it. `local`: the cluster is a local Ray this process started, so the actors' CPU is this one and
        nothing need be asked."""
        placement, model, pool = self.place(), self.config.model, self.config.pool
        if self._dtype is not None or placement.device.startswith("cuda") or model.dtype != "auto":
            return
        if local:  # no worker process to start (and torch to import) for the question
            self._dtype = actors_here(model, on_gpu=False).dtype
            return
        probe = ray.remote(probe_hardware).options(num_cpus=pool.cpus_per_actor).remote(
            model.model_dump() | {"device": "cpu"}, int(pool.cpus_per_actor), pool.concurrent_requests)
        while not ray.wait([probe], timeout=PROBE_PATIENCE_S)[0]:
            log.warning("waiting for a node with %g free CPUs to ask which dtype --dtype auto picks there (the "
                        "autoscaler may be starting one)", pool.cpus_per_actor)
        self._dtype = ray.get(probe).dtype

    def __call__(self, dataset: "ray.data.Dataset") -> "ray.data.Dataset":
        """`dataset` rows with a prompt (or messages) column -> rows with the output columns added (the
        dataset's other columns follow them, renamed `input_<name>` where the output uses the name)."""
        spec = self.spec
        prompts = dataset.map_batches(lambda batch: standardize(batch, spec), batch_format="pyarrow",
                                      batch_size=None)
        return self.generate(prompts)

    def generate(self, prompts: "ray.data.Dataset") -> "ray.data.Dataset":
        """The stage on rows that already hold the prompt columns (tasks.standardize's output). With an auto bank
        not yet calibrated, this calibrates it first, on the first rows (`calibrate`)."""
        samples = self.expand(prompts)
        if self.plan.calibrate:
            self.calibrate(samples)
        return self.decode(samples)

    def calibrate(self, samples: "ray.data.Dataset", output: str | None = None,
                  data: tuple[str, str] | None = None) -> AutoBank:
        """An auto bank for this stage's actors (autobank.calibrate: cached, or calibrated on the first rows of
        `samples` by a Ray task with an actor's CPUs and GPUs), and the plan resolved again with it; a failed or
        skipped calibration leaves the plan's fallback running."""
        auto = autobank.calibrate(self.config, self.plan, self.place().device, self._on_worker, samples, output, data)
        if auto.bank is not None:
            self._plan = resolve(self.config.model, self.config.decoding, self.actors(), bank=auto.bank,
                                 bank_label=auto.label)
        return auto

    def _on_worker(self, fn, *args, retries: int = 0):
        """fn(*args) run as a Ray task with an actor's CPUs and GPUs (where an actor would run), and its result."""
        resources = {"num_cpus": self.config.pool.cpus_per_actor, "num_gpus": self.place().gpus}
        return ray.get(ray.remote(fn).options(**resources, max_retries=retries).remote(*args))

    def expand(self, prompts: "ray.data.Dataset") -> "ray.data.Dataset":
        """Prompt rows -> one row per sample, their sampling_params checked (pipeline/sampling.py)."""
        decoding = self.config.decoding
        return prompts.map_batches(lambda batch: expand(batch, decoding), batch_format="pyarrow", batch_size=None)

    def decode(self, samples: "ray.data.Dataset") -> "ray.data.Dataset":
        """The actor pool over expanded rows (`expand`'s output): one output row per sample."""
        pool, placement, plan = self.config.pool, self.place(), self.plan
        DataContext.get_current().max_errored_blocks = 0  # never drop a failed block silently
        return samples.repartition(target_num_rows_per_block=pool.rows_per_block).map_batches(
            self.actor,
            fn_constructor_kwargs={"model_cfg": self.config.model.model_dump() | {"device": placement.device},
                                   "plan": plan, "threads": max(1, int(pool.cpus_per_actor)),
                                   "concurrency": pool.concurrent_requests, "ledger": self.ledger},
            batch_size=1,
            batch_format="pyarrow",
            compute=actor_pool(pool),
            num_cpus=pool.cpus_per_actor,
            num_gpus=placement.gpus,
        )


def actor_pool(pool: PoolConfig) -> ActorPoolStrategy:
    """The actor pool; with --concurrent-requests K, each actor runs K calls (rows) at once on threads of its own
    (Ray Data's documented multi-threaded actors), with K more queued so that a lane that empties refills at once."""
    k = pool.concurrent_requests
    if k == 1:
        return ActorPoolStrategy(min_size=pool.min_actors, max_size=pool.max_actors)
    return ActorPoolStrategy(min_size=pool.min_actors, max_size=pool.max_actors, max_tasks_in_flight_per_actor=2 * k,
                             max_concurrent_calls_per_actor=k, enable_true_multi_threading=True)


def build_processor(config: ProcessorConfig | dict | None = None, actor: type = GenerateActor) -> Processor:
    """The generation stage for `config` (a ProcessorConfig or its dict); see the module docstring. `actor`: the
    pool's callable class (a subclass of GenerateActor)."""
    if config is None:
        config = ProcessorConfig()
    elif isinstance(config, dict):
        config = ProcessorConfig(**config)
    return Processor(config, actor)
