"""`--bank auto` (pipeline/autobank.py): the cache key and roots, the calibration on a worker (rollouts, bank,
resume from its stages), the fallback, and the job on real local Ray: a greedy job writes the calibration's
rollouts as its rows exactly once and decodes the rest with the calibrated bank, equal to AR; a second job with
the same key reuses the bank; a calibration that fails falls back and still writes every row, then exits 3
unless --allow-bank-fallback accepts the fallback."""

from __future__ import annotations

import json
import logging

import pytest

from entmtp_ray.calibrate.bank import Bank, Hardware
from entmtp_ray.config import CalibrationConfig, DecodingConfig, ModelConfig
from entmtp_ray.pipeline.assemble import AUTO_BANK, resolve
from entmtp_ray.pipeline.autobank import (ACTOR_LABEL, bank_key, cache_roots, calibrate_on_worker, data_identity,
                                          find_cached, key_name, rollout_decoding, store)
from helpers.engines import make_engine

from helpers.banks import make_bank
from helpers.jobs import job_args, read_output, run_here, write_prompts

HW = Hardware(device="cpu", threads=2, dtype="bfloat16", machine="Some CPU")


def tiny(dirs, **extra) -> ModelConfig:
    model_dir, heads_dir = dirs
    return ModelConfig(model=str(model_dir), heads=str(heads_dir), dtype="fp32", device="cpu", **extra)


# ---- the key and the caches --------------------------------------------------------------------------

def test_the_key_changes_with_everything_a_bank_depends_on(tiny_model_dirs):
    model = tiny(tiny_model_dirs)
    calibration = CalibrationConfig()
    key = bank_key(model, "task:gsm8k", HW, calibration)
    assert key["heads"] and len(key["heads"]) == 64  # the heads folder's content hash
    assert key == bank_key(model, "task:gsm8k", HW, calibration)
    variants = [bank_key(model, "task:humaneval", HW, calibration),
                bank_key(model, "task:gsm8k", HW.model_copy(update={"threads": 4}), calibration),
                bank_key(model, "task:gsm8k", HW.model_copy(update={"dtype": "float32"}), calibration),
                bank_key(model, "task:gsm8k", HW.model_copy(update={"device": "NVIDIA A100"}), calibration),
                bank_key(model, "task:gsm8k", HW, CalibrationConfig(calibration_prompts=16)),
                bank_key(model, "task:gsm8k", HW, CalibrationConfig(calibration_budget=16))]
    names = {key_name(k, "gsm8k") for k in [key, *variants]}
    assert len(names) == 7 and all(n.startswith("tiny-vicuna-gsm8k-") for n in names)
    shipped, full = (bank_key(ModelConfig(draft_vocab=v), "task:gsm8k", HW, calibration) for v in (None, 0))
    assert shipped["draft_vocab"] == 8192 and full["draft_vocab"] == 0
    assert data_identity("gsm8k", [("a.jsonl", 10)]) == ("gsm8k", "task:gsm8k")  # any copy of the task's data
    one = data_identity(None, [("a.jsonl", 10)], "s3://b/prompts/")
    assert one[0] == "prompts" and one != data_identity(None, [("a.jsonl", 11)], "s3://b/prompts/")


def test_a_cpu_banks_key_is_the_one_it_had_before_the_gpu_backend(monkeypatch):
    import entmtp_ray.pipeline.autobank as autobank

    monkeypatch.setattr(autobank, "heads_identity", lambda model: (None, "h" * 64))
    monkeypatch.setattr(autobank, "draft_vocab_for", lambda *args: None)
    model, calibration = ModelConfig(model="m", heads="x"), CalibrationConfig()
    key = bank_key(model, "task:gsm8k", HW, calibration)
    # the keys (and their folders) of the release before `backend`: banks cached with it are still found
    assert key == {"version": 1, "model": "m", "chat_format": "auto", "heads": "h" * 64, "data": "task:gsm8k",
                   "hardware": {"device": "cpu", "threads": 2, "dtype": "bfloat16", "machine": "Some CPU"},
                   "draft_vocab": 0, "prompts": 64, "budget": 64}
    assert key_name(key, "gsm8k") == "m-gsm8k-d4c66f429d389982"
    settings = bank_key(model, "task:gsm8k", HW.model_copy(update={"concurrency": 4, "quantize": "int8"}), calibration)
    assert settings["hardware"] == {"device": "cpu", "threads": 2, "dtype": "bfloat16", "machine": "Some CPU",
                                    "concurrency": 4, "quantize": "int8"}
    assert key_name(settings, "gsm8k") == "m-gsm8k-73573b1024462c8b"


def test_a_gpu_banks_key_names_the_gpu_and_backend_not_the_host_cpu(tiny_model_dirs):
    model, calibration = tiny(tiny_model_dirs), CalibrationConfig()
    gpu = Hardware(device="NVIDIA H100 80GB HBM3", threads=8, dtype="bfloat16", machine="AMD EPYC 7R13",
                   backend="torch 2.5.1, CUDA 12.4")
    key = bank_key(model, "task:gsm8k", gpu, calibration)
    assert key["hardware"] == {"device": "NVIDIA H100 80GB HBM3", "dtype": "bfloat16",
                               "backend": "torch 2.5.1, CUDA 12.4", "concurrency": 1, "quantize": "none"}
    other_host = gpu.model_copy(update={"machine": "Intel(R) Xeon(R) Platinum 8480C", "threads": 2})
    assert bank_key(model, "task:gsm8k", other_host, calibration) == key  # the same bank: no recalibration
    for change in ({"device": "NVIDIA A100-SXM4-80GB"}, {"backend": "torch 2.4.0, CUDA 12.1"}, {"dtype": "float16"},
                   {"concurrency": 4}, {"quantize": "int8"}):
        assert bank_key(model, "task:gsm8k", gpu.model_copy(update=change), calibration) != key, change


def test_the_probed_cpu_hardware_records_no_backend():
    import torch

    from entmtp_ray.pipeline.autobank import probe_hardware

    threads = torch.get_num_threads()
    try:
        probed = probe_hardware({"device": "cpu", "dtype": "fp32"}, threads=1)
    finally:
        torch.set_num_threads(threads)  # as it was, for the tests after this one
    assert (probed.device, probed.threads, probed.dtype, probed.backend) == ("cpu", 1, "float32", "")
    assert "backend" not in bank_key(ModelConfig(draft_vocab=0), "task:gsm8k", probed, CalibrationConfig())["hardware"]


def test_cache_roots_and_a_cached_bank_is_found_and_copied_beside_the_output(tmp_path, monkeypatch):
    monkeypatch.setenv("ENTMTP_CACHE", str(tmp_path / "user"))
    roots = cache_roots(CalibrationConfig(), str(tmp_path / "out"))
    assert [r.path for r in roots] == [str(tmp_path / "out" / "_banks"), str(tmp_path / "user" / "banks")]
    assert [r.path for r in cache_roots(CalibrationConfig(bank_cache=str(tmp_path / "c")), "x")] == [
        str(tmp_path / "c")]
    assert find_cached(roots, "k") is None
    bank = make_bank(model="tiny-vicuna")
    assert store(roots[1], "k", bank.model_dump_json(), {"model": "m"})  # an earlier job's, in the user's cache
    found, label = find_cached(roots, "k")
    assert found == bank and label == f"{roots[0].sub('k').uri}/bank.json"
    assert (tmp_path / "out" / "_banks" / "k" / "bank.json").is_file()
    (tmp_path / "out" / "_banks" / "k" / "bank.json").write_text("{not json")  # unreadable: the next root's
    assert find_cached(roots, "k")[0] == bank


def test_rollouts_are_the_jobs_own_rows_only_when_the_job_is_greedy():
    greedy = DecodingConfig(policy="entmtp-tau", bank=AUTO_BANK, max_new_tokens=300, stop=["Q:"])
    rollout, reused = rollout_decoding(greedy, "cpu")
    assert reused and (rollout.policy, rollout.bank, rollout.max_new_tokens, rollout.stop) == ("ar", None, 300, ["Q:"])
    assert rollout_decoding(greedy, "cuda")[0].policy == "hydra"  # a tree step pays on a GPU
    sampling = greedy.model_copy(update={"temperature": 0.7, "acceptance": "exact", "top_p": 0.9})
    rollout, reused = rollout_decoding(sampling, "cpu")
    assert not reused and (rollout.temperature, rollout.acceptance, rollout.top_p) == (0.0, "greedy", 1.0)
    assert rollout.max_new_tokens == 128


def test_an_auto_bank_plans_its_fallback_until_calibrated(tiny_model_dirs, caplog):
    model = tiny(tiny_model_dirs)
    waiting = resolve(model, DecodingConfig())  # no bank ships for this model: the default calibrates one
    assert waiting.calibrate and waiting.requested.bank == AUTO_BANK and waiting.requested.policy == "entmtp-tau"
    assert waiting.decoding.policy == "hydra" and waiting.needs_heads and waiting.bank is None
    bank = make_bank(model="tiny-vicuna")
    ready = resolve(model, waiting.requested, bank=bank, bank_label="out/_banks/k/bank.json")
    assert not ready.calibrate and ready.bank is bank and ready.decoding.policy == "entmtp-tau"
    assert ready.bank_label == "out/_banks/k/bank.json" and ready.bank_path is None
    embedded = resolve(ModelConfig(), DecodingConfig(task="gsm8k", bank=AUTO_BANK))  # falls back to the shipped bank
    assert embedded.calibrate and embedded.decoding.bank.endswith("gsm8k.json")
    with pytest.raises(ValueError, match="--policy ar reads none"):
        resolve(model, DecodingConfig(policy="ar", bank=AUTO_BANK))
    with caplog.at_level(logging.WARNING, logger="entmtp_ray.pipeline.engine"):
        engine = make_engine(model, DecodingConfig(max_new_tokens=4))  # a process that calibrates nothing
    assert engine.decoding.policy == "hydra" and "this process calibrates no bank" in caplog.text
    assert "jobs/build_bank.py --task general --model" in caplog.text


def test_the_default_calibrates_for_actors_on_another_kind_of_device_than_the_shipped_bank():
    from entmtp_ray.config import ProcessorConfig
    from entmtp_ray.pipeline.placement import ActorPlacement
    from entmtp_ray.pipeline.processor import Processor

    def placed(decoding: DecodingConfig, device: str, quantize: str = "none", dtype: str = "bf16") -> Processor:
        processor = Processor(ProcessorConfig(decoding=decoding, model=ModelConfig(quantize=quantize, dtype=dtype)))
        placement = ActorPlacement(gpus=1.0 if device == "cuda" else 0.0, device=device, auto=True)
        processor.placement = placement  # the plan is resolved for these actors on its first use
        return processor

    on_gpu = placed(DecodingConfig(task="gsm8k"), "cuda")  # the shipped GSM8K bank was timed on a CPU
    assert on_gpu.plan.calibrate and on_gpu.plan.requested.bank == AUTO_BANK
    assert "was timed on cpu" in on_gpu.plan.source and "a CPU, not a GPU" in on_gpu.plan.source
    assert on_gpu.config.decoding == DecodingConfig(task="gsm8k")  # the user's settings, never rewritten
    calibrated = resolve(ModelConfig(dtype="bf16"), DecodingConfig(task="gsm8k"),
                         on_gpu.actors(ActorPlacement(1.0, "cuda", True)),
                         bank=on_gpu.plan.bank, bank_label="out/_banks/k/bank.json")
    assert calibrated.requested.bank == AUTO_BANK and not calibrated.calibrate  # the same decision, now served
    assert calibrated.source == "calibrated on the job's prompts (out/_banks/k/bank.json)"
    # until calibrated: the shipped bank, its fallback
    assert on_gpu.plan.decoding.bank.endswith("gsm8k.json") and on_gpu.plan.bank_label.endswith("gsm8k.json")
    assert not placed(DecodingConfig(task="gsm8k"), "cpu").plan.calibrate  # the device it was timed on
    assert placed(DecodingConfig(task="gsm8k"), "cpu", "int4").plan.calibrate  # timed on unquantized weights
    fp32 = placed(DecodingConfig(task="gsm8k"), "cpu", dtype="fp32")  # the variant timed in fp32 serves them
    assert not fp32.plan.calibrate and fp32.plan.bank.hardware.dtype == "float32"
    kept = placed(DecodingConfig(task="gsm8k", policy="entmtp-tau"), "cuda")  # asked for by name: kept
    assert not kept.plan.calibrate and kept.plan.bank_label.endswith("gsm8k.json")


# ---- the calibration on a worker ---------------------------------------------------------------------

def calibration_rows(n: int) -> list[dict]:
    return [{"id": f"c{i}", "prompt": f"Write item number {i} of a list.", "messages": None} for i in range(n)]


def test_a_worker_calibrates_a_bank_from_its_rollouts_and_resumes_from_its_stages(tiny_model_dirs, tmp_path):
    model = tiny(tiny_model_dirs).model_dump()
    job = DecodingConfig(policy="entmtp-tau", bank=AUTO_BANK, max_new_tokens=10).model_dump()
    rows = calibration_rows(4) + [{"id": "bad", "prompt": "", "messages": None}]
    work = tmp_path / "work"
    result = calibrate_on_worker(model, job, 1, rows, str(work), "tiny-auto", 8, "gsm8k")
    assert result["error"] is None, result["error"]
    bank = Bank.model_validate_json(result["bank"])
    assert bank.task == "tiny-auto" and bank.calibration["auto"]
    assert (bank.calibration["prompts"], bank.calibration["held_out"]) == (3, 1)  # one held out, and measured on
    assert bank.selection.by == "measured" and bank.policy.star in {c.name for c in bank.selection.candidates}
    assert bank.hardware.threads == 1 and max(t.nodes for t in bank.trees) <= 8
    records = result["records"]
    assert [r["id"] for r in records] == [r["id"] for r in rows]  # the job's rows, the bad one as its error row
    assert records[-1]["error"] and all(r["actor_id"] == ACTOR_LABEL and r["policy"] == "ar" for r in records)
    ar = make_engine(ModelConfig(**model), DecodingConfig(policy="ar", max_new_tokens=10))
    for row, record in zip(rows[:4], records):
        assert record["output_token_ids"] == ar.generate(row["id"], row["prompt"]).output_token_ids

    # stopped after two rollouts: those are not decoded again; tables and timing start afresh
    saved = next(work.glob("rollouts-*.jsonl"))
    lines = [json.loads(line) for line in saved.read_text().splitlines()]
    marked = [line | {"total_s": -1.0} for line in lines if line["id"] in ("c0", "c1")]
    saved.write_text("".join(json.dumps(r) + "\n" for r in marked))
    for stage in (work / "bank").iterdir():
        stage.unlink()
    again = calibrate_on_worker(model, job, 1, rows, str(work), "tiny-auto", 8, "gsm8k")
    assert [r["total_s"] for r in again["records"][:2]] == [-1.0, -1.0]  # read back, not decoded
    assert all(r["total_s"] > 0 for r in again["records"][2:4])
    assert [r["output_token_ids"] for r in again["records"]] == [r["output_token_ids"] for r in records]
    retimed = Bank.model_validate_json(again["bank"]).trees  # the same rollouts: the same frontier, timed afresh
    assert [(t.name, t.paths, t.tau) for t in retimed] == [(t.name, t.paths, t.tau) for t in bank.trees]

    # resumed with other prompts first (a dataset read in another order): the saved rollouts count towards the
    # sample, so only as many new prompts are decoded as are missing, and only those are the job's rows
    others = [{"id": f"n{i}", "prompt": f"Name a colour, number {i}.", "messages": None} for i in range(3)]
    third = calibrate_on_worker(model, job, 1, others + rows[:3], str(work), "tiny-auto", 8, "gsm8k")
    assert [r["id"] for r in third["records"]] == ["n0", "c0", "c1", "c2"]  # 5 saved + n0 = the 6 asked for
    built = Bank.model_validate_json(third["bank"]).calibration  # c0-c3 and n0 decoded: 4 fit, 1 held out
    assert (built["prompts"], built["held_out"]) == (4, 1)


def test_a_calibration_with_no_usable_prompt_reports_why_and_builds_nothing(tiny_model_dirs, tmp_path):
    model = tiny(tiny_model_dirs).model_dump()
    job = DecodingConfig(policy="entmtp-tau", bank=AUTO_BANK, max_new_tokens=6, max_input_tokens=2).model_dump()
    result = calibrate_on_worker(model, job, 1, calibration_rows(2), str(tmp_path / "w"), "x-auto", 8, "x")
    assert result["bank"] is None and "none of the 2 calibration prompts decoded" in result["error"]
    assert "over --max-input-tokens 2" in result["error"] and len(result["records"]) == 2  # still the job's rows


# ---- the job -------------------------------------------------------------------------------------------

def ar_outputs(dirs, ids_prompts: dict[str, str], max_new_tokens: int = 12) -> dict[str, list[int]]:
    engine = make_engine(tiny(dirs), DecodingConfig(policy="ar", max_new_tokens=max_new_tokens))
    return {i: engine.generate(i, p).output_token_ids for i, p in ids_prompts.items()}


@pytest.mark.slow
def test_a_greedy_job_calibrates_writes_its_rollouts_once_and_decodes_the_rest_as_ar(tiny_model_dirs, tmp_path,
                                                                                     ray_cluster, monkeypatch):
    data = write_prompts(tmp_path / "prompts.jsonl", 12)  # 4x the calibration's prompts: enough to calibrate
    extra = ["--bank", "auto", "--calibration-prompts", "3", "--calibration-budget", "8", "--dtype", "fp32"]
    monkeypatch.setenv("ENTMTP_CACHE", str(tmp_path / "user"))  # the user's cache, which the driver writes
    proc = run_here(job_args(tiny_model_dirs, data, tmp_path / "out", *extra))
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    calibration = summary["calibration"]
    assert calibration["status"] == "built" and calibration["prompts"] == 3 and calibration["rows_reused"] == 3
    assert calibration["seconds"] > 0 and set(calibration["stage_seconds"]) == {"load", "rollouts", "bank"}
    assert summary["bank"] == calibration["bank"] and calibration["bank"].endswith("/bank.json")
    assert str(tmp_path / "out" / "_banks") in calibration["bank"]
    rows = read_output(tmp_path / "out")
    assert sorted(r["id"] for r in rows) == sorted(f"q{i}" for i in range(12))  # every row once
    by_policy = {}
    for r in rows:
        by_policy.setdefault((r["policy"], r["actor_id"] == "calibration"), []).append(r["id"])
    assert len(by_policy[("ar", True)]) == 3 and len(by_policy[("entmtp-tau", False)]) == 9
    assert all(r["label"] == int(r["id"][1:]) for r in rows)  # the input's columns follow calibration rows too
    want = ar_outputs(tiny_model_dirs, {f"q{i}": f"Write item number {i} of a list." for i in range(12)})
    assert {r["id"]: r["output_token_ids"] for r in rows} == want  # fp32: every row equals AR's
    assert (tmp_path / "user" / "banks" / calibration["key"] / "bank.json").is_file()
    manifest = json.loads((tmp_path / "out" / "_manifest.json").read_text())
    assert manifest["settings"]["bank_sha256"] == "auto" and manifest["sources"]["bank"] == "auto"

    # the same key in a new output: the user's cache has the bank, nothing is calibrated
    proc = run_here(job_args(tiny_model_dirs, data, tmp_path / "out2", *extra))
    assert proc.returncode == 0, proc.stderr[-3000:]
    second = json.loads(proc.stdout.strip().splitlines()[-1])
    assert second["calibration"]["status"] == "cached" and second["calibration"]["rows_reused"] == 0
    assert second["calibration"]["key"] == calibration["key"]
    rows2 = read_output(tmp_path / "out2")
    assert {r["id"]: r["output_token_ids"] for r in rows2} == want and {r["policy"] for r in rows2} == {"entmtp-tau"}


@pytest.mark.slow
def test_a_failed_calibration_falls_back_writes_every_row_and_exits_3_unless_accepted(tiny_model_dirs, tmp_path,
                                                                                      ray_cluster):
    data = write_prompts(tmp_path / "prompts.jsonl", 8)
    # every prompt is longer than --max-input-tokens: no calibration rollout decodes, so no bank can be built
    extra = ["--bank", "auto", "--calibration-prompts", "2", "--max-input-tokens", "3",
             "--bank-cache", str(tmp_path / "cache")]
    proc = run_here(job_args(tiny_model_dirs, data, tmp_path / "out", *extra))
    assert proc.returncode == 3, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    calibration = summary["calibration"]
    assert calibration["status"] == "failed" and "none of the 2 calibration prompts decoded" in calibration["error"]
    assert calibration["fallback"] == "hydra" and summary["policy"] == "hydra"
    assert calibration["fallback_accepted"] is False and summary["ok"] is False
    error = proc.stderr.strip().splitlines()[-1]  # one line: the error, what ran instead, the fixes
    assert error.startswith("error: --bank auto: the calibration failed (ValueError: none of the 2 calibration")
    assert "with hydra instead of a calibrated bank" in error
    assert all(fix in error for fix in ("--resume", "--bank FILE", "--allow-bank-fallback"))
    rows = read_output(tmp_path / "out")
    assert sorted(r["id"] for r in rows) == [f"q{i}" for i in range(8)]
    assert all("max-input-tokens" in r["error"] for r in rows)
    assert not list((tmp_path / "cache").rglob("bank.json"))

    # run again with --resume: no row is left to decode, so nothing is calibrated and nothing failed
    proc = run_here(job_args(tiny_model_dirs, data, tmp_path / "out", *extra, "--resume"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    again = json.loads(proc.stdout.strip().splitlines()[-1])
    assert again["calibration"]["status"] == "skipped" and again["ok"] is True and again["rows"] == 8

    # the fallback accepted: the same failure in the summary, a warning, exit 0
    proc = run_here(job_args(tiny_model_dirs, data, tmp_path / "accepted", *extra, "--allow-bank-fallback"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    accepted = json.loads(proc.stdout.strip().splitlines()[-1])
    assert accepted["calibration"]["status"] == "failed" and accepted["calibration"]["fallback_accepted"] is True
    assert accepted["ok"] is True and "calibration failed" in proc.stderr
    assert not [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert sorted(r["id"] for r in read_output(tmp_path / "accepted")) == [f"q{i}" for i in range(8)]


@pytest.mark.slow
def test_a_sampling_job_calibrates_on_greedy_rollouts_it_does_not_write(tiny_model_dirs, tmp_path,
                                                                        ray_cluster):
    data = write_prompts(tmp_path / "prompts.jsonl", 8)
    extra = ["--bank", "auto", "--calibration-prompts", "2", "--calibration-budget", "8", "--temperature", "0.7",
             "--bank-cache", str(tmp_path / "cache")]
    proc = run_here(job_args(tiny_model_dirs, data, tmp_path / "out", *extra))
    assert proc.returncode == 0, proc.stderr[-3000:]
    calibration = json.loads(proc.stdout.strip().splitlines()[-1])["calibration"]
    assert calibration["status"] == "built" and calibration["prompts"] == 2 and calibration["rows_reused"] == 0
    rows = read_output(tmp_path / "out")
    assert sorted(r["id"] for r in rows) == [f"q{i}" for i in range(8)]
    assert {(r["policy"], r["acceptance"], r["actor_id"] == ACTOR_LABEL) for r in rows} == {
        ("entmtp-tau", "exact", False)}  # every row sampled by the pool, with the calibrated bank
    assert all(r["bank"] == calibration["bank"] for r in rows)
    saved = [json.loads(line) for f in (tmp_path / "cache").rglob("rollouts-*.jsonl") for line in f.open()]
    assert len(saved) == 2 and {r["temperature"] for r in saved} == {0.0}  # the calibration decoded greedily


@pytest.mark.slow
def test_a_job_too_small_to_pay_back_a_bank_decodes_with_the_fallback_and_says_so(tiny_model_dirs, tmp_path,
                                                                                  ray_cluster):
    """7 rows, 2 calibration prompts: fewer than 4x, so no rollout is decoded for a bank no row would use; every
    row decodes with the fallback, and the summary says why (issue 40: 40 rows, 40 rollouts, an unused bank)."""
    data = write_prompts(tmp_path / "prompts.jsonl", 7)
    extra = ["--bank", "auto", "--calibration-prompts", "2", "--bank-cache", str(tmp_path / "cache")]
    proc = run_here(job_args(tiny_model_dirs, data, tmp_path / "out", *extra))
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    calibration = summary["calibration"]
    assert calibration["status"] == "skipped" and calibration["prompts"] == 0 and calibration["rows_reused"] == 0
    assert "has 7 rows to decode, fewer than 4 x --calibration-prompts (2)" in calibration["reason"]
    assert calibration["fallback"] == "hydra" and summary["policy"] == "hydra" and summary["ok"] is True
    assert "--bank auto: not calibrating" in proc.stderr
    rows = read_output(tmp_path / "out")
    assert sorted(r["id"] for r in rows) == [f"q{i}" for i in range(7)]
    assert {(r["policy"], r["actor_id"] == ACTOR_LABEL) for r in rows} == {("hydra", False)}
    assert not list((tmp_path / "cache").rglob("bank.json"))
