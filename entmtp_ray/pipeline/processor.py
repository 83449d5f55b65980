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
import time
from pathlib import Path

import pyarrow as pa
import ray
from ray.data import ActorPoolStrategy, DataContext

from entmtp_ray.calibrate.bank import Actors, Bank
from entmtp_ray.config import DecodingConfig, ModelConfig, PoolConfig, ProcessorConfig
from entmtp_ray.model.loading import cuda_problem
from entmtp_ray.pipeline.assemble import actors_here, fallback_warning, resolve
from entmtp_ray.pipeline.autobank import (BANK_FILE, AutoBank, bank_key, cache_roots, calibrate_on_worker,
                                          data_identity, find_cached, key_name, probe_hardware, store)
from entmtp_ray.pipeline.engine import EngineBroken, TorchThread
from entmtp_ray.pipeline.placement import ActorPlacement, check_device, place_actors
from entmtp_ray.pipeline.records import output_table
from entmtp_ray.pipeline.sampling import SAMPLE_INDEX, SAMPLING, expand, sample_key
from entmtp_ray.pipeline.tasks import INTERNAL_COLUMNS, PromptSpec, standardize

log = logging.getLogger(__name__)

PROBE_PATIENCE_S = 60  # between warnings while a probe task waits for a node (the autoscaler may be adding one)

ROW_COLUMNS = (*INTERNAL_COLUMNS, SAMPLE_INDEX, SAMPLING)  # what the actor reads of a row; not passed through

# Fault injection for the exactly-once tests: the actor that meets this row id (or sample key) fails, once (the
# marker file records that it happened): it exits abruptly (kind `exit`), or its engine reports
# itself broken (kind `broken`, as an out-of-memory error would).
FAULT_ROW_ENV = "ENTMTP_FAULT_EXIT_ON_ROW"
FAULT_MARKER_ENV = "ENTMTP_FAULT_MARKER"
FAULT_KIND_ENV = "ENTMTP_FAULT_KIND"


class GenerateActor:
    """Callable class for map_batches: loads model, heads and policy once, then decodes row by row."""

    def __init__(self, model_cfg: dict, decoding: dict, threads: int, bank: str | None = None,
                 bank_label: str | None = None, concurrency: int = 1, ledger: "ray.actor.ActorHandle | None" = None):
        import psutil  # Ray's own copy (ray/thirdparty_files), on the path of every Ray worker

        # this actor's start-up timeline (unix seconds by phase), reported to the job's JobLedger when given
        self.ledger, self.marks = ledger, {"process_up": psutil.Process().create_time(), "init": time.time()}
        self.torch_thread = None
        if concurrency > 1:
            # Ray runs up to K calls of this actor at once, on threads of its own; each hands its row to the engine's
            # Batcher, which decodes them together on the thread that loaded the model (all torch work of the
            # process on one thread, engine.Batcher)
            self.torch_thread = TorchThread()
            self.engine = self.torch_thread.submit(self._load, model_cfg, decoding, threads, bank, bank_label,
                                                   concurrency).result()
        else:
            self.engine = self._load(model_cfg, decoding, threads, bank, bank_label, 1)
        self._mark("ready")

    def _mark(self, phase: str) -> None:
        self.marks[phase] = time.time()
        if phase in ("ready", "first_request") and self.ledger is not None:
            actor = ray.get_runtime_context().get_actor_id()
            self.ledger.started.remote(actor, dict(self.marks))
            if phase == "ready" and self.engine.decoder.costs:
                self.ledger.note.remote(actor, "step_costs", self.engine.decoder.costs)

    def _load(self, model_cfg: dict, decoding: dict, threads: int, bank: str | None, bank_label: str | None,
              concurrency: int):
        import torch

        from entmtp_ray.model.attention import DTYPES, fixed_order_ready
        from entmtp_ray.pipeline.engine import Engine

        self._mark("imports")
        if model_cfg["device"] == "cuda":
            check_assigned_gpu()
        torch.set_num_threads(max(1, threads))
        calibrated = Bank.model_validate_json(bank) if bank else None  # an auto bank, as the job calibrated it
        engine = Engine(ModelConfig(**model_cfg), DecodingConfig(**decoding), calibrated, bank_label,
                        concurrency=concurrency, executor=self.torch_thread, transformers_forward=False)
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
        self.config = config  # as the user gave it; what runs is self.plan
        # a broken config fails here, before any work; the plan that runs is resolved again once the actors are
        # placed (place), when whether the default's shipped bank suits them is known
        self.plan = resolve(config.model, config.decoding)
        self.bank_json: str | None = None  # a calibrated auto bank, for the actors
        check_device(config.model.device, config.pool.gpus_per_actor)
        self.spec = PromptSpec("dataset", None, config.decoding.task, config.prompt_column, config.id_column,
                               config.messages_column)
        self.placement: ActorPlacement | None = None  # decided once Ray is up (dataplane.connect, or generate)
        self._dtype: str | None = None  # the actors' (actors_dtype)
        self.ledger = None  # a streams.JobLedger the actors report their start-up to (set by dataplane.run_job)

    def place(self) -> ActorPlacement:
        """The actors' GPUs and device on the connected Ray cluster (placement.place_actors), decided once, and the
        plan for those actors (assemble.resolve: --quantize on their device; the default's shipped bank may not
        suit them, and is then calibrated afresh). Raises, placing nothing, when the plan fails."""
        if self.placement is None:
            if not ray.is_initialized():
                ray.init()  # as Ray Data itself would, when the dataset first runs
            gpus = ray.cluster_resources().get("GPU", 0.0)
            placement = place_actors(self.config.model.device, self.config.pool.gpus_per_actor, gpus)
            if self.bank_json is None:  # a calibrated bank stays
                before, self.plan = self.plan, resolve(self.config.model, self.config.decoding, self.actors(placement))
                if self.plan.calibrate and not before.calibrate:
                    log.warning("the default bank does not suit the actors: %s", self.plan.source)
            self.placement = placement
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
        job; on an autoscaling cluster it waits for a node, so the job's checks run first), and resolve the plan
        again with it: the default bank's variant for that dtype, or a calibrated bank when none ships. `local`: the
        cluster is a local Ray this process started, so the actors' CPU is this one and nothing need be asked."""
        placement, model, pool = self.place(), self.config.model, self.config.pool
        if self._dtype is not None or placement.device.startswith("cuda") or model.dtype != "auto":
            return
        if local:  # no worker process to start (and torch to import) for the question
            self._dtype = actors_here(model, on_gpu=False).dtype
        else:
            probe = ray.remote(probe_hardware).options(num_cpus=pool.cpus_per_actor).remote(
                model.model_dump() | {"device": "cpu"}, int(pool.cpus_per_actor), pool.concurrent_requests)
            while not ray.wait([probe], timeout=PROBE_PATIENCE_S)[0]:
                log.warning("waiting for a node with %g free CPUs to ask which dtype --dtype auto picks there (the "
                            "autoscaler may be starting one)", pool.cpus_per_actor)
            self._dtype = ray.get(probe).dtype
        if self.bank_json is None:  # a calibrated bank stays
            before, self.plan = self.plan, resolve(model, self.config.decoding, self.actors(placement))
            if self.plan.calibrate and not before.calibrate:
                log.warning("the default bank does not suit the actors: %s", self.plan.source)

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
        self.place()  # resolves the plan for the placed actors: it may calibrate a bank
        self.ask_actors()  # and their dtype, where --dtype auto leaves it to their host
        if self.plan.calibrate:
            self.calibrate(samples)
        return self.decode(samples)

    # ---- --bank auto ----------------------------------------------------------------------------------

    def calibrate(self, samples: "ray.data.Dataset", output: str | None = None,
                  data: tuple[str, str] | None = None) -> AutoBank:
        """Give an auto bank to this stage's actors: the cached one for this key, else one calibrated on the first
        --calibration-prompts eligible rows of `samples` (expanded rows: no input error, sample 0, no row
        sampling_params) by a Ray task with an actor's CPUs and GPUs (pipeline/autobank.py), when the job has
        CALIBRATION_SHARE times as many rows (else the fallback decodes them, and the report says why). `output`:
        the job's output, whose `_banks` folder caches it first; `data`: (label, fingerprint) of the job's input
        (default: the task, else the sampled prompts). A failed calibration leaves the fallback in place, with a
        warning, and says so in the report (`calibration_problem`); with no row left to decode (--resume) there is
        nothing to calibrate for. Returns the bank, the rollouts a greedy job writes as its rows (with their sample rows),
        and the report."""
        started = time.time()
        calibration, pool, placement = self.config.calibration, self.config.pool, self.place()
        model = self.config.model.model_dump() | {"device": placement.device}
        threads = max(1, int(pool.cpus_per_actor))
        resources = {"num_cpus": pool.cpus_per_actor, "num_gpus": placement.gpus}
        concurrency = pool.concurrent_requests
        hardware = ray.get(ray.remote(probe_hardware).options(**resources).remote(model, threads, concurrency))
        roots = cache_roots(calibration, output)
        taken = None
        if data is None and not self.plan.requested.task:
            taken = calibration_sample(samples, calibration.calibration_prompts)
            data = data_identity(None, prompts=taken[1])
        label, fingerprint = data or data_identity(self.plan.requested.task)
        key = bank_key(self.config.model, fingerprint, hardware, calibration)
        name = key_name(key, label)
        report = {"status": "cached", "key": name, "hardware": hardware.describe(), "prompts": 0, "rows_reused": 0}
        found = find_cached(roots, name)
        if found:
            return self._calibrated(AutoBank(found[0], found[1], report), started)
        sample, rows, read = taken or calibration_sample(samples, calibration.calibration_prompts)
        if not read:  # every row already written (--resume): none decodes, with a bank or without
            report.update(status="skipped", reason="no row of the job is left to decode")
            return self._calibrated(AutoBank(None, None, report), started)
        if read < CALIBRATION_SHARE * calibration.calibration_prompts:
            running = self.plan.decoding
            report.update(status="skipped", fallback=running.bank or running.policy,
                          reason=f"the job has {read} rows to decode, fewer than {CALIBRATION_SHARE} x "
                          f"--calibration-prompts ({calibration.calibration_prompts}): a bank calibrated on a share "
                          "that large would not pay back its calibration; the rows decode with the fallback. Pass "
                          "--calibration-prompts N for a smaller sample, or --bank FILE")
            log.warning("--bank auto: not calibrating: %s (%s)", report["reason"], report["fallback"])
            return self._calibrated(AutoBank(None, None, report), started)
        if not rows:
            report.update(status="failed", error=f"none of the job's first {read} rows decodes as the job does "
                          "(each has an input error, or sampling_params of its own), so none can be calibrated on")
            return self._calibrated(AutoBank(None, None, report), started)
        report.update(status="built", prompts=len(rows))
        work = roots[0].sub(name).sub("work")
        log.warning("--bank auto: calibrating a bank on %d of the job's prompts (%s; stages in %s)", len(rows),
                    report["hardware"], work.uri)
        task = ray.remote(calibrate_on_worker).options(**resources, max_retries=1)
        try:
            result = ray.get(task.remote(model, self.plan.requested.model_dump(), threads, rows, work.uri,
                                         f"{label}-auto", calibration.calibration_budget, label, concurrency))
        except Exception as exc:  # noqa: BLE001 - a failed calibration falls back, it never ends the job
            report.update(status="failed", error=f"{type(exc).__name__}: {exc}"[:2000])
            return self._calibrated(AutoBank(None, None, report), started)
        report["stage_seconds"] = {k: round(v, 1) for k, v in result["seconds"].items()}
        auto = AutoBank(None, None, report, result["records"], sample if result["records"] else None)
        if result["bank"] is None:
            report.update(status="failed", error=result["error"])
            return self._calibrated(auto, started)
        stored = [root for root in roots if store(root, name, result["bank"], key)]
        auto.bank = Bank.model_validate_json(result["bank"])
        auto.label = f"{(stored[0] if stored else roots[0]).sub(name).uri}/{BANK_FILE}"
        return self._calibrated(auto, started)

    def _calibrated(self, auto: AutoBank, started: float) -> AutoBank:
        """Re-plan with the calibrated bank (or keep the fallback, with a warning when it failed) and finish the
        report."""
        report = auto.report
        if auto.bank is not None:
            self.plan = resolve(self.config.model, self.config.decoding, self.actors(), bank=auto.bank,
                                bank_label=auto.label)
            self.bank_json = auto.bank.model_dump_json()
            policy = auto.bank.policy
            switching = policy.signals[policy.signal]
            report.update(bank=auto.label, star=policy.star, trees={t.name: t.nodes for t in auto.bank.trees},
                          selection=auto.bank.selection.reason if auto.bank.selection else None,
                          # None: no signal's switching gained enough over the star, and entmtp-tau runs the star
                          signal=policy.signal if switching.conservative != switching.aggressive else None)
        elif report["status"] == "failed":
            running = self.plan.decoding
            report.update(fallback=running.bank or running.policy,
                          fallback_accepted=self.config.calibration.allow_bank_fallback)
            log.warning(fallback_warning(self.config.model, running, f"calibration failed ({report['error']})"))
        report["seconds"] = round(time.time() - started, 1)
        return auto

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
                                   "decoding": self.plan.decoding.model_dump(),
                                   "threads": max(1, int(pool.cpus_per_actor)),
                                   "bank": self.bank_json, "bank_label": self.plan.bank_label,
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


# --bank auto calibrates on at most 1 / CALIBRATION_SHARE of the job's rows: on fewer, its rollouts (decoded as AR)
# and its build would cost more than the bank saves on the rest (issue 40: 40 rows, 40 rollouts, a bank no row used)
CALIBRATION_SHARE = 4


def calibration_sample(samples: "ray.data.Dataset", count: int) -> tuple[pa.Table | None, list[dict], int]:
    """The first `count` rows of `samples` (expanded rows) that a calibration may decode as the job would: no input
    error, the first sample of its prompt, no sampling_params of its own; as a table, and as the {id, prompt,
    messages} the calibration task takes; and how many rows were read for them (0, and no table: `samples` has no
    row). Reads only the first blocks."""
    read = CALIBRATION_SHARE * count
    first = samples.limit(read).iter_batches(batch_size=read, batch_format="pyarrow", prefetch_batches=0)
    rows = next(iter(first), None)  # a few more than `count`, for the rows that do not qualify
    if rows is None:
        return None, [], 0
    keep = [i for i, (error, index, own) in enumerate(zip(*(rows.column(c).to_pylist() for c in
            ("_input_error", SAMPLE_INDEX, SAMPLING)))) if not error and index == 0 and not own][:count]
    sample = rows.take(pa.array(keep, pa.int64()))
    prompts = [{"id": r["id"], "prompt": r["prompt"], "messages": r["_messages"]}
               for r in sample.select(["id", "prompt", "_messages"]).to_pylist()]
    return sample, prompts, rows.num_rows


def calibration_problem(report: dict | None) -> str | None:
    """A calibration report's failure that the user did not accept (--allow-bank-fallback), as one line: the error,
    what decoded the rows instead, and the fixes; None when the job has nothing to report."""
    if not report or report["status"] != "failed" or report["fallback_accepted"]:
        return None
    error = [line.strip() for line in report["error"].splitlines() if line.strip()]  # a task's traceback: its end
    why = error[-1][:500] if error else "no error recorded"
    return (f"--bank auto: the calibration failed ({why}); every row was still decoded and written, with "
            f"{report['fallback']} instead of a calibrated bank, which may be slower. Fix the cause and run again "
            "(--resume decodes only the rows not yet written), pass --bank FILE, or pass --allow-bank-fallback to "
            "accept the fallback")


def calibration_rows(auto: AutoBank) -> pa.Table | None:
    """A greedy job's calibration rollouts as its output rows (the sample rows' own columns after them), or None."""
    if not auto.records:
        return None
    position = {row_id: k for k, row_id in enumerate(auto.sample.column("id").to_pylist())}
    sample = auto.sample.take(pa.array([position[r["id"]] for r in auto.records], pa.int64()))
    passthrough = sample.drop_columns([c for c in ROW_COLUMNS if c in sample.column_names])
    return output_table(passthrough, auto.records)


def build_processor(config: ProcessorConfig | dict | None = None) -> Processor:
    """The generation stage for `config` (a ProcessorConfig or its dict); see the module docstring."""
    if config is None:
        config = ProcessorConfig()
    elif isinstance(config, dict):
        config = ProcessorConfig(**config)
    return Processor(config)
