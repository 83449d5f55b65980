"""`--bank auto`: a topology bank calibrated on the job's own prompts, on a worker like the generation actors, and
cached by everything it depends on. All of it is here: the driver's half (`calibrate`: the key, the cache, the
sample, the report) and the worker's (`probe_hardware`, `calibrate_on_worker`). No Ray import: the processor hands
`calibrate` a function that runs a function as a Ray task with the actors' resources (pipeline/processor.py), then
re-plans with the bank it returns; the job writes the rollouts as its rows (`calibration_rows`, pipeline/dataplane.py).

1. `probe_hardware` (on a worker of the actors' kind): the device, dtype, threads and CPU (on a GPU, its torch and
   CUDA versions) the bank is timed on.
2. The key: model, chat format, heads (content hash or hub snapshot), the data (task, or the dataset's files),
   what of that hardware sets a step's cost (`Hardware.key`, calibrate/bank.py), the draft vocabulary, the sample
   size and node budget. A bank under the key in any cache root (`--bank-cache`, else `<output>/_banks` and the user's cache) is
   used as it is.
3. Otherwise `calibrate_on_worker`: greedy rollouts of the sampled prompts (AR on a CPU, Hydra's tree on a GPU:
   greedy output is the same), then pipeline/calibration.build_bank, the code jobs/build_bank.py runs. Every
   stage is saved under the first root's `<key>/work/` and a calibration stopped midway resumes from there.
   A greedy job's rollouts are its own output rows for those prompts: the job writes them and decodes the rest.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs

from entmtp_ray.calibrate.bank import BANK_VERSION, Bank, Hardware, current_hardware
from entmtp_ray.config import CalibrationConfig, DecodingConfig, ModelConfig, ProcessorConfig
from entmtp_ray.model.loading import cache_dir, draft_vocab_for, pick_device, pick_dtype
from entmtp_ray.pipeline.assemble import Plan, fallback_warning, fixed_plan
from entmtp_ray.pipeline.calibration import CalibrationRow, build_bank
from entmtp_ray.pipeline.manifest import heads_identity
from entmtp_ray.pipeline.records import output_table
from entmtp_ray.pipeline.sampling import ROW_COLUMNS, SAMPLE_INDEX, SAMPLING
from entmtp_ray.pipeline.sources import Location

log = logging.getLogger(__name__)

ROLLOUT_TOKENS = 128  # a sampling job's greedy calibration rollouts (its own length when the job is greedy)
TIMING_PROMPTS = 3  # prompts each candidate tree is timed on, as jobs/build_bank.py
BANK_FILE = "bank.json"
ACTOR_LABEL = "calibration"  # the actor_id of output rows the calibration decoded


@dataclass
class AutoBank:
    """What a calibration gives the job: the bank (None: the fallback runs), where it is cached, the rollouts that
    are the job's rows, and the summary's `calibration` entry."""

    bank: Bank | None
    label: str | None
    report: dict
    records: list[dict] = field(default_factory=list)  # output rows (OUTPUT_SCHEMA) of the sampled prompts
    sample: pa.Table | None = None  # the sampled rows the records are of, in order


def cache_roots(calibration: CalibrationConfig, output: str | None) -> list[Location]:
    """Where auto banks are looked up, in order (the first is written first, and holds the stages)."""
    if calibration.bank_cache:
        return [Location.of(calibration.bank_cache)]
    roots = [Location.of(output).sub("_banks")] if output else []
    return roots + [Location.of(str(cache_dir() / "banks"))]


def probe_hardware(model_cfg: dict, threads: int, concurrency: int = 1) -> Hardware:
    """The hardware a bank would be timed on here, at the actors' concurrency: run where a generation actor would."""
    import torch

    torch.set_num_threads(max(1, threads))
    device = pick_device(model_cfg["device"])
    quantize = model_cfg.get("quantize", "none")
    dtype = pick_dtype(model_cfg["dtype"], device, quantize, model_cfg.get("model"))
    return current_hardware(device, dtype, concurrency, quantize)


def data_identity(task: str | None, files: list[tuple[str, int]] | None = None, dataset: str | None = None,
                  prompts: list | None = None) -> tuple[str, str]:
    """(a readable label, a fingerprint) of the data a bank is calibrated on: a task's prompts are the task's (any
    copy of its data); a dataset of files is its files' names and sizes; anything else, the sampled prompts."""
    if task:
        return task, f"task:{task}"
    if files is not None:
        label = Path(dataset.rstrip("/")).name if dataset else "dataset"
        return label, "files:" + _digest(sorted(files))
    if dataset:
        return Path(dataset.rstrip("/")).name, f"dataset:{dataset}"
    return "prompts", "prompts:" + _digest(prompts or [])


def _digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


def bank_key(model_cfg: ModelConfig, data: str, hardware: Hardware, calibration: CalibrationConfig) -> dict:
    """Everything an auto bank depends on (compared whole: a bank is reused only for the same key)."""
    vocab = draft_vocab_for(model_cfg.model, model_cfg.heads, model_cfg.draft_vocab)
    return {"version": BANK_VERSION, "model": model_cfg.model, "chat_format": model_cfg.chat_format,
            "heads": heads_identity(model_cfg)[1], "data": data, "hardware": hardware.key(),
            "draft_vocab": len(vocab) if vocab else 0, "prompts": calibration.calibration_prompts,
            "budget": calibration.calibration_budget}


def key_name(key: dict, label: str) -> str:
    """The key's folder name: readable, and unique by the key's hash."""
    readable = re.sub(r"[^A-Za-z0-9_.-]+", "-", f"{Path(key['model']).name}-{label}").strip("-")[:60]
    return f"{readable}-{_digest(key)[:16]}"


def find_cached(roots: list[Location], name: str) -> tuple[Bank, str] | None:
    """The bank cached under `name` in the first root that has it, and its URI; copied into the roots before it
    (so the output keeps the bank its rows were decoded with, and the label names that copy)."""
    for k, root in enumerate(roots):
        folder = root.sub(name)
        try:
            if not folder.exists(BANK_FILE):
                continue
            text = folder.read_text(BANK_FILE)
            bank = Bank.model_validate_json(text)
        except (OSError, ValueError) as exc:  # unreadable: calibrate again
            log.warning("auto bank %s/%s is unreadable (%s); ignoring it", folder.uri, BANK_FILE, exc)
            continue
        copied = [earlier for earlier in roots[:k] if store(earlier, name, text, None)]
        return bank, f"{(copied[0].sub(name) if copied else folder).uri}/{BANK_FILE}"
    return None


def store(root: Location, name: str, bank_json: str, key: dict | None) -> bool:
    """Write a bank (and its key, for people) under root/name; False (with a warning) where it cannot be written."""
    folder = root.sub(name)
    try:
        folder.make()
        if key is not None:
            folder.write_text("key.json", json.dumps(key, indent=1) + "\n")
        folder.write_text(BANK_FILE, bank_json)
        return True
    except OSError as exc:
        log.warning("could not cache the auto bank in %s: %s", folder.uri, exc)
        return False


# ---- on the driver ---------------------------------------------------------------------------------

# --bank auto calibrates on at most 1 / CALIBRATION_SHARE of the job's rows: on fewer, its rollouts (decoded as AR)
# and its build would cost more than the bank saves on the rest (issue 40: 40 rows, 40 rollouts, a bank no row used)
CALIBRATION_SHARE = 4


def calibrate(config: ProcessorConfig, plan: Plan, device: str, on_worker, samples, output: str | None = None,
              data: tuple[str, str] | None = None) -> AutoBank:
    """An auto bank for the job of `config`, whose `plan` (assemble.resolve's, with `calibrate` set) runs its
    fallback until a bank is in hand: the cached one for this key, else one calibrated on the first
    --calibration-prompts eligible rows of `samples` (a Ray Dataset of expanded rows: no input error, sample 0, no row
    sampling_params) by `calibrate_on_worker`, when the job has CALIBRATION_SHARE times as many rows (else the
    fallback decodes them, and the report says why). `device`: the actors'; `on_worker(fn, *args, retries=0)`: fn's
    result, run where an actor would run (a Ray task with an actor's CPUs and GPUs). `output`: the job's output,
    whose `_banks` folder caches it first; `data`: (label, fingerprint) of the job's input (default: the task, else the
    sampled prompts). A failed calibration leaves the fallback in place, with a warning, and says so in the report
    (`calibration_problem`); with no row left to decode (--resume) there is nothing to calibrate for. Returns the
    bank, the rollouts a greedy job writes as its rows (with their sample rows), and the report."""
    started = time.time()
    calibration, pool = config.calibration, config.pool
    model = config.model.model_dump() | {"device": device}
    threads, concurrency = max(1, int(pool.cpus_per_actor)), pool.concurrent_requests
    hardware = on_worker(probe_hardware, model, threads, concurrency, retries=3)
    roots = cache_roots(calibration, output)
    taken = None
    if data is None and not plan.requested.task:
        taken = calibration_sample(samples, calibration.calibration_prompts)
        data = data_identity(None, prompts=taken[1])
    label, fingerprint = data or data_identity(plan.requested.task)
    key = bank_key(config.model, fingerprint, hardware, calibration)
    name = key_name(key, label)
    report = {"status": "cached", "key": name, "hardware": hardware.describe(), "prompts": 0, "rows_reused": 0}

    def done(auto: AutoBank) -> AutoBank:
        return _reported(auto, plan, config, started)

    found = find_cached(roots, name)
    if found:
        return done(AutoBank(found[0], found[1], report))
    sample, rows, read = taken or calibration_sample(samples, calibration.calibration_prompts)
    if not read:  # every row already written (--resume): none decodes, with a bank or without
        report.update(status="skipped", reason="no row of the job is left to decode")
        return done(AutoBank(None, None, report))
    if read < CALIBRATION_SHARE * calibration.calibration_prompts:
        running = plan.decoding
        report.update(status="skipped", fallback=running.bank or running.policy,
                      reason=f"the job has {read} rows to decode, fewer than {CALIBRATION_SHARE} x "
                      f"--calibration-prompts ({calibration.calibration_prompts}): a bank calibrated on a share "
                      "that large would not pay back its calibration; the rows decode with the fallback. Pass "
                      "--calibration-prompts N for a smaller sample, or --bank FILE")
        log.warning("--bank auto: not calibrating: %s (%s)", report["reason"], report["fallback"])
        return done(AutoBank(None, None, report))
    if not rows:
        report.update(status="failed", error=f"none of the job's first {read} rows decodes as the job does "
                      "(each has an input error, or sampling_params of its own), so none can be calibrated on")
        return done(AutoBank(None, None, report))
    report.update(status="built", prompts=len(rows))
    work = roots[0].sub(name).sub("work")
    log.warning("--bank auto: calibrating a bank on %d of the job's prompts (%s; stages in %s)", len(rows),
                report["hardware"], work.uri)
    try:
        result = on_worker(calibrate_on_worker, model, plan.requested.model_dump(), threads, rows, work.uri,
                           f"{label}-auto", calibration.calibration_budget, label, concurrency, retries=1)
    except Exception as exc:  # noqa: BLE001 - a failed calibration falls back, it never ends the job
        report.update(status="failed", error=f"{type(exc).__name__}: {exc}"[:2000])
        return done(AutoBank(None, None, report))
    report["stage_seconds"] = {k: round(v, 1) for k, v in result["seconds"].items()}
    auto = AutoBank(None, None, report, result["records"], sample if result["records"] else None)
    if result["bank"] is None:
        report.update(status="failed", error=result["error"])
        return done(auto)
    stored = [root for root in roots if store(root, name, result["bank"], key)]
    auto.bank = Bank.model_validate_json(result["bank"])
    auto.label = f"{(stored[0] if stored else roots[0]).sub(name).uri}/{BANK_FILE}"
    return done(auto)


def _reported(auto: AutoBank, plan: Plan, config: ProcessorConfig, started: float) -> AutoBank:
    """`auto` with its report finished: the bank's star and trees, or the fallback that runs (with a warning when the
    calibration failed), and the seconds it took."""
    report = auto.report
    if auto.bank is not None:
        policy = auto.bank.policy
        switching = policy.signals[policy.signal]
        report.update(bank=auto.label, star=policy.star, trees={t.name: t.nodes for t in auto.bank.trees},
                      selection=auto.bank.selection.reason if auto.bank.selection else None,
                      # None: no signal's switching gained enough over the star, and entmtp-tau runs the star
                      signal=policy.signal if switching.conservative != switching.aggressive else None)
    elif report["status"] == "failed":
        running = plan.decoding
        report.update(fallback=running.bank or running.policy,
                      fallback_accepted=config.calibration.allow_bank_fallback)
        log.warning(fallback_warning(config.model, running, f"calibration failed ({report['error']})"))
    report["seconds"] = round(time.time() - started, 1)
    return auto


def calibration_sample(samples, count: int) -> tuple[pa.Table | None, list[dict], int]:
    """The first `count` rows of `samples` (a Ray Dataset of expanded rows) that a calibration may decode as the job
    would: no input error, the first sample of its prompt, no sampling_params of its own; as a table, and as the {id,
    prompt, messages} the calibration task takes; and how many rows were read for them (0, and no table: `samples`
    has no row). Reads only the first blocks."""
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


# ---- on the worker ---------------------------------------------------------------------------------

class _Stages:
    """A calibration's working folder: local files for the stages, mirrored to a folder on any filesystem (the
    first cache root, which every node of the job sees) after each, so that a calibration stopped anywhere resumes
    on whichever node runs it next."""

    def __init__(self, remote: Location):
        self.remote = remote
        if remote.is_local:
            self.path = Path(remote.path)
            self.path.mkdir(parents=True, exist_ok=True)
            self._temporary = None
        else:
            self._temporary = tempfile.mkdtemp(prefix="entmtp-calibration-")
            self.path = Path(self._temporary)
            if remote.exists():
                pafs.copy_files(remote.path, str(self.path), source_filesystem=remote.filesystem,
                                destination_filesystem=pafs.LocalFileSystem())

    def save(self) -> None:
        if self._temporary is not None:
            self.remote.make()
            pafs.copy_files(str(self.path), self.remote.path, source_filesystem=pafs.LocalFileSystem(),
                            destination_filesystem=self.remote.filesystem)

    def close(self) -> None:
        if self._temporary is not None:
            shutil.rmtree(self._temporary, ignore_errors=True)


def rollout_decoding(decoding: DecodingConfig, device: str) -> tuple[DecodingConfig, bool]:
    """(how the calibration rollouts decode, whether they are the job's own rows): a greedy job's settings with
    the fastest policy at hand (greedy output is the same under every tree), else greedy ROLLOUT_TOKENS."""
    policy = "hydra" if device.startswith("cuda") else "ar"  # a tree step pays on a GPU, not on a small CPU
    plain = {"policy": policy, "bank": None, "signal": None, "tree": None, "n": 1}
    if decoding.temperature == 0:
        return decoding.model_copy(update=plain), True
    greedy = DecodingConfig(**decoding.model_dump(exclude={"temperature", "acceptance", "top_p", "top_k"}) | plain)
    return greedy.model_copy(update={"max_new_tokens": min(ROLLOUT_TOKENS, decoding.max_new_tokens)}), False


def calibrate_on_worker(model_cfg: dict, decoding: dict, threads: int, rows: list[dict], work_uri: str, name: str,
                        budget: int, source: str, concurrency: int = 1) -> dict:
    """Rollouts of `rows` ({id, prompt, messages}) and the bank from them, on this worker. Returns the bank's JSON
    (None, with `error`, when no bank could be built), the rollouts of `rows` as output rows when the job is greedy
    (in the order of `rows`; a row may have none, see below), and the seconds of each stage. Rollouts already saved
    under work_uri by a stopped calibration with the same settings count towards len(rows), whichever prompts they
    are of: they are not decoded again, and fewer of `rows` are. `concurrency`: the actors' --concurrent-requests;
    the rollouts decode that many at once, as the job's rows would, and the trees are timed at it."""
    import torch

    from entmtp_ray.pipeline.engine import Engine, RowRequest

    started = time.time()
    torch.set_num_threads(max(1, threads))
    model = ModelConfig(**model_cfg)
    job = DecodingConfig(**decoding)
    # fixed policies, no bank: the job's plan (the driver's) has checked the model and heads they decode with
    drafting = Engine(model, fixed_plan(DecodingConfig(policy="hydra", max_new_tokens=job.max_new_tokens,
                                                       max_input_tokens=job.max_input_tokens)), concurrency=concurrency)
    rollout, reused = rollout_decoding(job, str(drafting.loaded.device))
    roller = Engine(model, fixed_plan(rollout), stack=drafting.stack, concurrency=concurrency)
    roller.actor_id = ACTOR_LABEL
    stages = _Stages(Location.of(work_uri))
    try:
        saved_file = stages.path / f"rollouts-{_digest(rollout.model_dump())[:12]}.jsonl"  # per rollout settings
        saved = {}
        if saved_file.is_file():
            for line in saved_file.read_text().splitlines():
                record = json.loads(line)
                saved[record["id"]] = record
        loaded = time.time()
        todo = [row for row in rows if row["id"] not in saved][:max(0, len(rows) - len(saved))]  # saved ones count
        requests = [RowRequest(row["id"], row["prompt"], _messages(row)) for row in todo]
        with saved_file.open("a") as out:
            # `concurrency` rows in flight at once (on this thread, as the actors' Batcher would); each is saved as
            # it finishes
            for index, record in roller.run_many(requests):
                row = todo[index]
                saved[row["id"]] = record | {"_prompt": _prompt(row)}
                out.write(json.dumps(saved[row["id"]]) + "\n")
                out.flush()
                stages.save()
        rolled = time.time()
        records = [{k: v for k, v in saved[row["id"]].items() if k != "_prompt"} for row in rows if row["id"] in saved]
        calibration_rows = [CalibrationRow(r["id"], r["_prompt"], r["output_token_ids"])
                            for r in saved.values() if not r["error"]]
        timing = [r.prompt for r in calibration_rows[:TIMING_PROMPTS]]
        result = {"records": records if reused else [], "bank": None, "error": None,
                  "seconds": {"load": loaded - started, "rollouts": rolled - loaded}}
        try:
            if not calibration_rows:
                raise ValueError(f"none of the {len(saved)} calibration prompts decoded (first error: "
                                 f"{next(iter(saved.values()))['error'] if saved else 'no prompts'})")
            built = build_bank(drafting, calibration_rows, timing, stages.path / "bank", name=name,
                               budget=budget, max_new_tokens=rollout.max_new_tokens,
                               calibration={"source": source, "subset": "the job's prompts", "auto": True})
            result["bank"] = built.bank.model_dump_json(indent=1) + "\n"
        except (ValueError, RuntimeError, MemoryError) as exc:
            result["error"] = f"{type(exc).__name__}: {exc}"
        result["seconds"]["bank"] = time.time() - rolled
        stages.save()
        return result
    finally:
        stages.close()


def _messages(row: dict) -> list[dict] | None:
    return json.loads(row["messages"]) if row.get("messages") else None


def _prompt(row: dict):
    return json.loads(row["messages"]) if row.get("messages") else row["prompt"]

