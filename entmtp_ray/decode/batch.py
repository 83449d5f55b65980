"""Several requests in flight over one model: each step verifies every running request's tree in one forward.

A `BatchDecoder` holds K lanes (`SpecDecoder.lane`: the same model, heads and tree buffers; a KV cache, drafter
cache and policy state of each lane's own). A step chooses and drafts each request's tree as its own policy and
signal say, scores all of their trees in one call of the lanes' verifier (decode/verify.py: the products once
over all rows, the attention per request over its own cache, one projection of all their logit rows), then accepts, commits and observes each request on its own. A
request that finishes leaves at once and the next one enters (continuous batching): `run` keeps every lane busy
while requests remain.

Each request decodes as it would alone: the same trees, drafts, acceptance and generator draws, and verifier
logits that differ from its lone run only where a product rounds a row differently beside other rows
(docs/design.md §7). Knows nothing about Ray or Parquet.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch

from entmtp_ray.config import DecodingConfig
from entmtp_ray.decode.drafting import draft_together
from entmtp_ray.decode.loop import SpecDecoder, in_inference_mode
from entmtp_ray.decode.results import GenerationResult, PendingStep, Request
from entmtp_ray.decode.verify import Tree, Verified

_END = object()  # the end of a run's jobs (a live source yields None for "none now")


@dataclass
class Job:
    """One request for `BatchDecoder.run`: `tag` comes back with its result."""

    tag: Any
    prompt_ids: list[int]
    cfg: DecodingConfig
    generator: torch.Generator | None = None


@dataclass
class Flight:
    """A request in a lane."""

    job: Job
    request: Request
    started: float  # perf_counter when it entered (its prefill began)
    prefill_s: float


class BatchDecoder:
    """K lanes over one decoder's model: `admit` requests, `step` them together, or `run` a stream of jobs."""

    def __init__(self, decoder: SpecDecoder, slots: int):
        if slots < 1:
            raise ValueError(f"a batch needs at least one slot, got {slots}")
        self.decoder = decoder
        self.lanes = [decoder.lane() for _ in range(slots)]
        self.flights: list[Flight | None] = [None] * slots
        self.steps = 0  # batched steps run
        self.rows = 0  # verified rows over them (their mean is the batch's mean forward size)

    @property
    def slots(self) -> int:
        return len(self.lanes)

    @property
    def running(self) -> int:
        return sum(f is not None for f in self.flights)

    @in_inference_mode
    def admit(self, job: Job) -> GenerationResult | None:
        """Prefill `job` in a free lane (ValueError for a prompt that does not fit). Returns its result when the
        prefill already ended it (EOS, a stop, a one-token limit), else None: it runs with the next steps."""
        slot = self.flights.index(None)  # ValueError when full: callers admit only while `running < slots`
        lane = self.lanes[slot]
        start = time.perf_counter()
        request = lane.prefill(job.prompt_ids, job.cfg, job.generator)
        lane._sync()
        flight = Flight(job, request, start, time.perf_counter() - start)
        if request.finish is not None:
            return self._result(lane, flight)
        self.flights[slot] = flight
        return None

    @in_inference_mode
    def step(self) -> list[tuple[Job, GenerationResult | BaseException]]:
        """One step of every running request, their trees verified in one forward. Returns the requests that
        finished, with their results (or the exception that ended one: a failure in one request's own phases ends
        only that request; a failed forward ends every request in it)."""
        done: list[tuple[Job, GenerationResult | BaseException]] = []
        pending: list[tuple[int, PendingStep]] = []
        for slot, flight in enumerate(self.flights):
            if flight is None:
                continue
            try:
                step = self.lanes[slot].choose_step(flight.request)
            except Exception as exc:  # noqa: BLE001 - this request's failure, not the batch's
                done.append(self._drop(slot, exc))
                continue
            if step is None:  # its context is full
                done.append((flight.job, self._leave(slot)))
            else:
                pending.append((slot, step))
        if pending:
            try:
                drafted = draft_together([self.lanes[slot].drafter for slot, _ in pending],
                                         [step.buffers for _, step in pending],
                                         [self.flights[slot].request.root for slot, _ in pending])
            except Exception as exc:  # noqa: BLE001 - the drafting of every pending request failed
                return done + [self._drop(slot, exc) for slot, _ in pending]
            for (_, step), tokens in zip(pending, drafted):
                step.tokens = tokens
                step.clock.mark("draft")
        if not pending:
            return done
        try:
            verified = self._verify(pending)
        except Exception as exc:  # noqa: BLE001 - the forward of every pending request failed
            return done + [self._drop(slot, exc) for slot, _ in pending]
        self.steps += 1
        self.rows += sum(step.buffers.num_nodes for _, step in pending)
        for (slot, step), result in zip(pending, verified):
            flight = self.flights[slot]
            step.clock.mark("verify")
            try:
                self.lanes[slot].finish_step(flight.request, step, result)
            except Exception as exc:  # noqa: BLE001
                done.append(self._drop(slot, exc))
                continue
            if flight.request.finish is not None:
                done.append((flight.job, self._leave(slot)))
        return done

    def run(self, jobs: Iterable[Job | None]) -> Iterator[tuple[Job, GenerationResult | BaseException]]:
        """Decode every job, keeping up to `slots` in flight; yields each (job, result or exception) as it
        finishes, so the order follows the finishing, not the input. `jobs` may be a live source (the serving
        loop's queue, engine.Batcher): it yields None when no job waits now, and the batch steps on and asks again
        (it should block rather than yield None while nothing runs); the run ends when `jobs` ends and nothing
        runs."""
        source = iter(jobs)
        exhausted = False
        while True:
            while not exhausted and self.running < self.slots:
                job = next(source, _END)
                if job is _END:
                    exhausted = True
                    break
                if job is None:  # nothing waits now
                    break
                try:
                    early = self.admit(job)
                except Exception as exc:  # noqa: BLE001 - a prompt that cannot run is its own result
                    yield job, exc
                    continue
                if early is not None:
                    yield job, early
            if self.running:
                yield from self.step()
            elif exhausted:
                return

    def _verify(self, pending: list[tuple[int, PendingStep]]) -> list[Verified]:
        """Every pending tree scored in one call of the lanes' verifier (one forward of the base model)."""
        plan = self.flights[pending[0][0]].request.plan
        trees = [Tree(self.lanes[slot].cache, step.buffers, step.tokens, plan) for slot, step in pending]
        return self.lanes[pending[0][0]].verifier(trees)

    def _leave(self, slot: int) -> GenerationResult:
        lane, flight = self.lanes[slot], self.flights[slot]
        self.flights[slot] = None
        return self._result(lane, flight)

    def _drop(self, slot: int, exc: BaseException) -> tuple[Job, BaseException]:
        job = self.flights[slot].job
        self.flights[slot] = None
        return job, exc

    @staticmethod
    def _result(lane: SpecDecoder, flight: Flight) -> GenerationResult:
        """The request's result; its decode time is its time in flight after its prefill (steps it shared)."""
        request = flight.request
        decode_s = time.perf_counter() - flight.started - flight.prefill_s
        return lane.result(request, flight.prefill_s, decode_s)
