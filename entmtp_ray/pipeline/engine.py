"""One process's generation service: configs in, a ready decoder; a prompt in, an output row out.

Shared by the one-machine CLI and the Ray actor. A bad row (empty, non-string or over-long
prompt, or a failure while decoding it) becomes a row with `error` set; a broken config
fails in the constructor, before any row runs.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Iterable, Iterator

from pydantic import ValidationError

from entmtp_ray.config import DecodingConfig, ModelConfig
from entmtp_ray.decode.batch import BatchDecoder, Job
from entmtp_ray.decode.acceptance import row_generator
from entmtp_ray.decode.loop import SpecDecoder
from entmtp_ray.decode.results import GenerationResult
from entmtp_ray.model.loading import LoadedModel
from entmtp_ray.pipeline.assemble import Plan, Stack, fallback_warning, load_stack, warn_if_bank_elsewhere
from entmtp_ray.pipeline.records import RowContext, error_row, result_row
from entmtp_ray.pipeline.sampling import explain, row_decoding, sample_key

log = logging.getLogger(__name__)

WARMUP_PROMPT = "Say hello."


class EngineBroken(RuntimeError):
    """This process can decode no further row (out of memory, a CUDA device error): its owner should
    end it, so that a fresh one retries the row."""


def process_is_broken(exc: BaseException) -> bool:
    """Whether `exc` means the process, not the row, is at fault: memory exhausted, or the device failed."""
    import torch

    if isinstance(exc, (MemoryError, torch.cuda.OutOfMemoryError)):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("CUDA error" in text or "out of memory" in text.lower())


def encode_checked(loaded: LoadedModel, prompt, max_input_tokens: int) -> list[int]:
    """Prompt ids for one user message (or a list of chat turns); ValueError says why a prompt is bad."""
    if isinstance(prompt, list):
        if not prompt or not all(isinstance(t.get("content"), str) for t in prompt):
            raise ValueError("messages must be a non-empty list of {role, content} turns")
    elif not isinstance(prompt, str):
        raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
    elif not prompt.strip():
        raise ValueError("empty prompt: nothing to generate from")
    ids = loaded.encode_prompt(prompt)
    if len(ids) > max_input_tokens:
        raise ValueError(f"prompt has {len(ids)} tokens, over --max-input-tokens {max_input_tokens}; shorten it or "
                         "raise --max-input-tokens")
    return ids


class TorchThread:
    """One daemon thread that runs the callables submitted to it, in turn (`submit` -> Future): where a process does
    all its torch work (see Batcher). A daemon, so a Batcher serving on it forever never holds up the process's
    exit (a ThreadPoolExecutor's worker is joined at exit, and would)."""

    def __init__(self, name: str = "entmtp-torch"):
        self.calls: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def submit(self, fn, *args) -> Future:
        future: Future = Future()
        self.calls.put((future, fn, args))
        return future

    def _run(self) -> None:
        while True:
            future, fn, args = self.calls.get()
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - the caller's to handle
                future.set_exception(exc)


class Batcher:
    """Decodes the requests that any thread submits, up to `slots` at once, on one serving thread (a BatchDecoder's
    continuous batching): `generate` blocks its caller until that request is done. How a Ray actor that takes
    several rows at once (--concurrent-requests) shares one model between them.

    `executor`: a TorchThread to serve on, the thread that loaded the model (GenerateActor's). Every torch
    op of a process should run on one thread: a second thread that has run one (and lives on) makes each parallel
    region of the other slower, about 1.4x a step here (docs/design.md §8); without one, a thread of its own."""

    def __init__(self, decoder: SpecDecoder, slots: int, executor: TorchThread | None = None):
        self.batch = BatchDecoder(decoder, slots)
        self.executor = executor
        self.jobs: queue.SimpleQueue[Job] = queue.SimpleQueue()
        self.serving: Future | None = None
        self.lock = threading.Lock()

    def generate(self, prompt_ids: list[int], cfg: DecodingConfig, generator=None) -> GenerationResult:
        import torch

        with self.lock:
            if self.serving is None or self.serving.done():  # started once (again only if the loop died)
                threads = torch.get_num_threads()
                if self.executor is None:
                    self.executor = TorchThread("entmtp-batcher")
                self.serving = self.executor.submit(self._serve, threads)
        future: Future = Future()
        self.jobs.put(Job(future, prompt_ids, cfg, generator))
        return future.result()

    def _serve(self, threads: int) -> None:
        import torch

        torch.set_num_threads(threads)
        try:
            self._loop()
        except BaseException as exc:  # a bug in the loop: fail every request it holds, none waits forever
            for flight in self.batch.flights:
                if flight is not None:
                    flight.job.tag.set_exception(exc)
            self.batch.flights = [None] * self.batch.slots
            while not self.jobs.empty():
                self.jobs.get().tag.set_exception(exc)
            raise

    def _loop(self) -> None:
        """The batch's run over the submitted jobs: a free lane takes a waiting job, and the loop waits for one
        only when none is running."""
        batch = self.batch

        def waiting():
            while True:
                try:
                    yield self.jobs.get(block=not batch.running)
                except queue.Empty:
                    yield None

        for job, result in batch.run(waiting()):
            if isinstance(result, BaseException):
                job.tag.set_exception(result)
            else:
                job.tag.set_result(result)


@dataclass
class RowRequest:
    """One sample of a prompt (or chat, `messages`) for `Engine.run_many`, with a row's sampling overrides."""

    row_id: object
    prompt: object
    messages: list[dict] | None = None
    sample_index: int = 0
    overrides: dict | None = None


class Engine:
    """Decodes what `plan` says (assemble.resolve's, made by whoever runs the engine: a job's driver for its actors,
    the CLI, the bank builder; the engine never resolves one); `stack`: a loaded model (and heads) to share with
    another engine of the same model_cfg; `concurrency`: requests decoded at once, by `run_many` on the calling
    thread or by `run` called from that many threads (a Batcher, serving on `executor` when given); 1: each request
    decodes alone; `transformers_forward`: load_model's (False where nothing will call transformers' forward on the
    engine's model: a job's actors)."""

    def __init__(self, model_cfg: ModelConfig, plan: Plan, stack: Stack | None = None, concurrency: int = 1,
                 executor: TorchThread | None = None, transformers_forward: bool = True):
        self.model_cfg = model_cfg
        self.concurrency = concurrency
        self.startup: dict[str, float] = {}  # unix time each phase of the load ended (a job's start-up timeline)
        self.plan = plan
        if plan.calibrate:
            log.warning(fallback_warning(model_cfg, plan.decoding, "this process calibrates no bank"))
        self.decoding = plan.decoding  # the policy that runs, never `auto`
        if stack is not None and plan.needs_heads and stack.drafter is None:
            raise ValueError("the shared model was loaded without heads, which this policy drafts with")
        self.stack = stack or load_stack(model_cfg, plan.needs_heads, transformers_forward)
        self.loaded = self.stack.loaded
        self.startup["weights"] = time.time()
        # a static cache sized from the job; one request at a time, step costs not measured here yet are measured
        # after the first row (settle_costs), not before it
        self.decoder = self.stack.decoder(plan.policy, self.decoding, defer_costs=concurrency == 1)
        self.rows = 0  # rows run
        self.startup["decoder"] = time.time()
        self.batcher = Batcher(self.decoder, concurrency, executor) if concurrency > 1 else None
        self.bank_label = plan.bank_label
        warn_if_bank_elsewhere(self.stack, plan, concurrency)
        self.actor_id: str | None = None  # set by the Ray actor that owns this engine

    @property
    def heads_label(self) -> str | None:
        return self.stack.heads_label

    def warm_up(self, max_new_tokens: int = 4) -> None:
        """One short generation outside any timed region (allocates caches, warms kernels, runs a few tree steps).
        It stands between an actor and its first row: 4 tokens, not 16, took 1.3 s off a 2-core start (issue 50)."""
        cfg = self.decoding.model_copy(update={"max_new_tokens": max_new_tokens})
        self.decoder.generate(self.loaded.encode_prompt(WARMUP_PROMPT), cfg, row_generator(cfg.seed, "warmup",
                                                                                            self.loaded.device))

    def encode(self, prompt) -> list[int]:
        """Prompt ids for one user message (or a list of chat turns); ValueError says why a prompt is bad."""
        return encode_checked(self.loaded, prompt, self.decoding.max_input_tokens)

    def generate(self, row_id, prompt, decoding: DecodingConfig | None = None, sample_index: int = 0
                 ) -> GenerationResult:
        """One sample for a prompt, with the job's settings or a row's own (`decoding`, from row_decoding)."""
        return self._decode(self._job(row_id, prompt, decoding or self.decoding, sample_index))

    def _job(self, row_id, prompt, cfg: DecodingConfig, sample_index: int) -> Job:
        """The prompt's ids (ValueError for a bad one) with its row generator: a row without an id (a user's Dataset
        may have none) is seeded by its prompt."""
        ids = self.encode(prompt)
        key = sample_key(row_id if row_id is not None else repr(prompt), sample_index)
        return Job(None, ids, cfg, row_generator(cfg.seed, key, self.loaded.device))

    def _decode(self, job: Job) -> GenerationResult:
        """One job decoded alone, or with the other callers' through the Batcher."""
        if self.batcher is not None:
            return self.batcher.generate(job.prompt_ids, job.cfg, job.generator)
        return self.decoder.generate(job.prompt_ids, job.cfg, job.generator)

    def _context(self, row_id, prompt, decoding: DecodingConfig | None = None, sample_index: int = 0) -> RowContext:
        return RowContext(id=row_id, prompt=prompt if isinstance(prompt, str) or prompt is None else repr(prompt),
                          decoding=decoding or self.decoding, model=self.model_cfg.model, heads=self.heads_label,
                          bank=self.bank_label, max_depth=self.decoder.drafter.max_depth, started_at=time.time(),
                          actor_id=self.actor_id, sample_index=sample_index)

    def error_row(self, row_id, prompt, message: str, sample_index: int = 0) -> dict:
        """The output row of a row that cannot run (e.g. unreadable input)."""
        return error_row(self._context(row_id, prompt, sample_index=sample_index), message)

    def run(self, row_id, prompt, messages: list[dict] | None = None, sample_index: int = 0,
            overrides: dict | None = None) -> dict:
        """The output row for one sample of a prompt (or chat, `messages`), with a row's sampling overrides
        (pipeline/sampling.py). Any failure of this row becomes its `error` ("TypeName: message"; a bad prompt's
        or setting's ValueError says what is wrong); only a failure that means this process is broken (out of
        memory, a CUDA device error) raises, as EngineBroken. With a concurrency above 1, calls from several threads
        decode together (the Batcher)."""
        if self.rows and self.decoder.costs_pending:
            self.settle_costs()
        self.rows += 1
        context, job, row = self._start(RowRequest(row_id, prompt, messages, sample_index, overrides))
        if row is not None:
            return row
        try:
            result = self._decode(job)
        except Exception as exc:  # noqa: BLE001 - judged by _finish
            return self._finish(context, exc)
        return self._finish(context, result)

    def settle_costs(self) -> None:
        """The step costs the decoder was built without (none cached here: its bank's ran), measured now into this
        machine's table; the policy settles at them and the decoder is built again over the trees it settled on,
        then warmed up. `run` calls it before its second row, so that the first row is never held back by it."""
        started = time.time()
        try:
            self.decoder = self.stack.decoder(self.plan.policy, self.decoding)
        except Exception:  # noqa: BLE001 - never a row's failure: the bank's costs keep serving
            log.exception("measuring the step costs failed; decoding goes on at the bank's")
            self.decoder.costs_pending = False
            return
        self.warm_up()
        log.info("step costs measured after the first row in %.1f s: %s", time.time() - started, self.decoder.costs)

    def run_many(self, requests: Iterable[RowRequest]) -> Iterator[tuple[int, dict]]:
        """(index in `requests`, output row) of each request as it finishes, up to `concurrency` decoded at once on
        this thread (rows that cannot start come first); as `run` for each row. At concurrency 1, `run` in turn."""
        if self.concurrency == 1:
            for index, r in enumerate(requests):
                yield index, self.run(r.row_id, r.prompt, r.messages, r.sample_index, r.overrides)
            return
        batch = BatchDecoder(self.decoder, self.concurrency)
        jobs = []
        for index, request in enumerate(requests):
            context, job, row = self._start(request)
            if row is not None:
                yield index, row
            else:
                job.tag = (index, context)
                jobs.append(job)
        for job, outcome in batch.run(jobs):
            index, context = job.tag
            yield index, self._finish(context, outcome)

    def _start(self, request: RowRequest) -> tuple[RowContext, Job | None, dict | None]:
        """(context, the job to decode, None), or (context, None, its error row) for a row that cannot start."""
        try:
            decoding = row_decoding(self.decoding, request.overrides or {})
        except ValidationError as exc:
            context = self._context(request.row_id, request.prompt, sample_index=request.sample_index)
            return context, None, error_row(context, explain(exc))
        context = self._context(request.row_id, request.prompt, decoding, request.sample_index)
        try:
            job = self._job(request.row_id, request.messages if request.messages else request.prompt, decoding,
                            request.sample_index)
        except ValueError as exc:
            return context, None, error_row(context, str(exc))
        return context, job, None

    def _finish(self, context: RowContext, outcome: GenerationResult | BaseException) -> dict:
        """The row of a decoded request, or of the exception that ended it (EngineBroken: the process is)."""
        if isinstance(outcome, GenerationResult):
            return result_row(context, outcome)
        if isinstance(outcome, ValueError):
            return error_row(context, str(outcome))
        if process_is_broken(outcome):
            raise EngineBroken(f"row {context.id}: {type(outcome).__name__}: {outcome}") from outcome
        log.error("row %s failed", context.id, exc_info=outcome)
        return error_row(context, f"{type(outcome).__name__}: {outcome}")
