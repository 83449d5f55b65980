"""Bank files: JSON round trip and every check made on load."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from pydantic import ValidationError

from entmtp_ray.calibrate.bank import BankTree, Hardware, PolicyParams, SignalParams, load_bank, save_bank
from helpers.banks import make_bank
from helpers.jobs import run_main

ROOT = Path(__file__).resolve().parents[2]
GSM8K = ROOT / "tests" / "fixtures" / "gsm8k_train_200.jsonl"  # GSM8K train's first 200 lines


def test_bank_round_trips_through_json(tmp_path):
    bank = make_bank()
    save_bank(bank, tmp_path / "b.json")
    assert load_bank(tmp_path / "b.json", max_depth=4) == bank
    assert bank.tree("n5").nodes == 5


def test_unknown_version_and_deep_trees_name_the_fix(tmp_path):
    path = tmp_path / "b.json"
    raw = json.loads(make_bank().model_dump_json())
    path.write_text(json.dumps({**raw, "version": 99}))
    with pytest.raises(ValueError, match="format version 99 is not 1; rebuild it with jobs/build_bank.py"):
        load_bank(path)
    save_bank(make_bank(), path)
    with pytest.raises(ValueError, match="depth 3 but the heads draft at most 2"):
        load_bank(path, max_depth=2)
    with pytest.raises(FileNotFoundError, match="build one with jobs/build_bank.py"):
        load_bank(tmp_path / "missing.json")


def test_model_or_hardware_mismatch_warns_to_rebuild(tmp_path, caplog):
    path = tmp_path / "b.json"
    save_bank(make_bank(), path)
    with caplog.at_level(logging.WARNING):
        load_bank(path, model="vicuna-7b", hardware=Hardware(device="NVIDIA A100", threads=8, dtype="float16"))
    text = caplog.text
    assert "built for model smollm2-135m-instruct, not vicuna-7b" in text and "rebuild" in text
    assert "measured on cpu (2 threads, float32)" in text


GPU = Hardware(device="NVIDIA H100 80GB HBM3", threads=8, dtype="bfloat16", machine="AMD EPYC 7R13",
               backend="torch 2.5.1, CUDA 12.4")


def test_a_gpu_bank_is_the_same_hardware_on_another_host_cpu_but_not_another_gpu_or_backend():
    other_host = GPU.model_copy(update={"machine": "Intel(R) Xeon(R) Platinum 8480C", "threads": 2})
    assert GPU.same_as(other_host) and other_host.same_as(GPU)  # a GPU step does not depend on the host CPU
    for change in ({"device": "NVIDIA A100-SXM4-80GB"}, {"backend": "torch 2.4.0, CUDA 12.1"}, {"backend": ""},
                   {"dtype": "float16"}, {"concurrency": 4}, {"quantize": "int8"}):
        assert not GPU.same_as(GPU.model_copy(update=change)), change
    cpu = Hardware(device="cpu", threads=2, dtype="bfloat16", machine="x86_64")
    assert not cpu.same_as(cpu.model_copy(update={"threads": 4})) and not cpu.same_as(GPU) and not GPU.same_as(cpu)
    assert cpu.same_as(cpu.model_copy(update={"machine": "other"}))  # as before: the threads, not the CPU model
    assert GPU.describe() == "NVIDIA H100 80GB HBM3 (bfloat16, torch 2.5.1, CUDA 12.4)"
    assert GPU.model_copy(update={"backend": "", "concurrency": 4}).describe() == (
        "NVIDIA H100 80GB HBM3 (bfloat16, backend not recorded, 4 concurrent requests)")
    assert cpu.describe() == "cpu (2 threads, bfloat16)"


def test_a_bank_matches_actors_of_its_kind_of_device_concurrency_and_weights_whatever_their_threads():
    from entmtp_ray.calibrate.bank import Actors

    cpu = Hardware(device="cpu", threads=2, dtype="bfloat16", machine="x86_64")
    assert cpu.matches(Actors(on_gpu=False)) == [] and GPU.matches(Actors(on_gpu=True)) == []
    assert cpu.matches(Actors(on_gpu=True)) == ["a CPU, not a GPU"]
    assert GPU.matches(Actors(on_gpu=True, concurrency=4, quantize="int8")) == [
        "1 concurrent requests, not 4", "none weights, not int8"]
    # the dtype, once the actors know theirs: a bf16 bank's trees are too big where a CPU computes in fp32
    assert cpu.matches(Actors(on_gpu=False, dtype="bfloat16")) == []
    assert cpu.matches(Actors(on_gpu=False, dtype="float32")) == ["bfloat16, not float32"]
    # the cache key: a GPU's step-cost fields; a CPU's as keys always were (no backend, defaults left out)
    assert GPU.key() == {"device": GPU.device, "dtype": "bfloat16", "backend": GPU.backend, "concurrency": 1,
                         "quantize": "none"}
    assert cpu.key() == {"device": "cpu", "threads": 2, "dtype": "bfloat16", "machine": "x86_64"}
    assert cpu.model_copy(update={"quantize": "int4"}).key()["quantize"] == "int4"


def test_a_bank_file_without_a_backend_still_loads(tmp_path):
    path = tmp_path / "b.json"
    raw = json.loads(make_bank().model_dump_json())
    del raw["hardware"]["backend"]  # written before the field existed, as the shipped banks were
    path.write_text(json.dumps(raw))
    assert load_bank(path).hardware.backend == ""
    shipped = ROOT / "entmtp_ray" / "assets" / "banks"
    for file in shipped.rglob("*.json"):
        assert load_bank(file).hardware.backend == "", file


def test_current_hardware_names_the_backend_on_a_gpu_only(monkeypatch):
    import torch

    from entmtp_ray.calibrate.bank import current_hardware

    cpu = current_hardware("cpu", torch.bfloat16)
    assert (cpu.device, cpu.backend, cpu.dtype) == ("cpu", "", "bfloat16")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    gpu = current_hardware("cuda", torch.float16, concurrency=2)
    assert (gpu.device, gpu.dtype, gpu.concurrency) == ("NVIDIA H200", "float16", 2)
    assert gpu.backend == f"torch {torch.__version__}, CUDA 12.4"


def test_policy_must_use_trees_of_the_bank():
    ok = SignalParams(ladder_trees=["n1"], conservative="n1", aggressive="n3", tau_on=0.1, tau_off=0.2)
    with pytest.raises(ValidationError, match="policy uses tree 'n9'"):
        make_bank(policy=PolicyParams(star="n9", signals={"entropy": ok}))
    with pytest.raises(ValidationError, match="tau_on"):
        SignalParams(ladder_trees=["a"], conservative="a", aggressive="a", tau_on=1.0, tau_off=1.0)
    with pytest.raises(ValidationError, match="default signal 'entropy' has no settings"):
        PolicyParams(star="n1", signals={"top1": ok})
    with pytest.raises(ValidationError, match="unknown signal"):
        PolicyParams(star="n1", signals={"entropy": ok, "vibes": ok})


def test_bank_consistency_checks_name_what_is_wrong(tmp_path):
    with pytest.raises(ValidationError, match="bank tree names must be unique"):
        make_bank(trees=[*make_bank().trees, BankTree(name="n3", paths=[[0]], nodes=2)])
    for trees, thresholds in [(["n5", "n3", "n1"], [1.5, 0.5]), (["n5", "n3", "n1"], [0.5]), (["n5"], [0.5])]:
        with pytest.raises(ValidationError, match="ascending and one fewer than ladder_trees"):
            SignalParams(ladder_trees=trees, ladder_thresholds=thresholds, conservative="n1", aggressive="n5",
                         tau_on=0.1, tau_off=0.2)
    SignalParams(ladder_trees=["n5", "n3", "n1"], ladder_thresholds=[0.5, 0.5], conservative="n1", aggressive="n5",
                 tau_on=0.1, tau_off=0.2)  # equal thresholds are ascending: the middle tree is never used
    raw = json.loads(make_bank().model_dump_json())
    raw["trees"][1]["nodes"] = 4
    path = tmp_path / "b.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="tree 'n3' says 4 nodes but has 3; rebuild the bank"):
        load_bank(path)


def test_bank_policies_by_name_and_signal_flag():
    from entmtp_ray.config import DecodingConfig
    from entmtp_ray.calibrate.bank import build_policy as make_policy

    bank = make_bank()
    star = make_policy(DecodingConfig(policy="entmtp-star"), bank)
    assert star.choose().name == "n3"
    ladder = make_policy(DecodingConfig(policy="entmtp-ladder", adapt=False), bank)
    assert [t.name for t in ladder.trees()] == ["n5", "n3", "n1"] and ladder.thresholds == [0.5, 1.5]
    tau = make_policy(DecodingConfig(policy="entmtp-tau", signal="top1", adapt=False), bank)
    assert (tau.conservative.name, tau.aggressive.name, tau.tau_on, tau.signal.value) == ("n1", "n5", 0.1, 0.2)
    with pytest.raises(ValueError, match="no settings for signal 'path'"):
        make_policy(DecodingConfig(policy="entmtp-tau", signal="path"), bank)
    with pytest.raises(ValueError, match="needs a topology bank"):
        make_policy(DecodingConfig(policy="entmtp-tau"), None)


def test_bank_policies_adapt_among_the_banks_smaller_trees_unless_told_not_to():
    from entmtp_ray.config import DecodingConfig
    from entmtp_ray.decode.policy import Adaptive, FixedTree
    from entmtp_ray.calibrate.bank import build_policy as make_policy

    bank = make_bank()
    star = make_policy(DecodingConfig(policy="entmtp-star"), bank)
    assert isinstance(star, Adaptive) and star.name == "entmtp-star" and [t.name for t in star.trees()] == ["n3", "n1"]
    assert star.costs["n1"] == pytest.approx(1 / 30) and star.costs["n3"] == pytest.approx(1.5 / 40)
    assert star.tau == {"n1": 1.0, "n3": 1.5, "n5": 2.0} and [t.name for t in star.homes] == ["n1", "n3", "n5"]
    # n3 is inside n5 but has more than half its nodes: only the one-node tree is a fallback of a star n5; a ladder
    # that runs n3 itself may fall from n5 to it
    star5 = make_policy(DecodingConfig(policy="entmtp-star"),
                        make_bank(policy=bank.policy.model_copy(update={"star": "n5"})))
    assert [t.name for t in star5.trees()] == ["n5", "n1"]
    ladder = make_policy(DecodingConfig(policy="entmtp-ladder"), bank)
    assert [t.name for t in ladder.inside["n5"]] == ["n1", "n3", "n5"]
    assert isinstance(make_policy(DecodingConfig(policy="entmtp-star", adapt=False), bank), FixedTree)
    no_one = make_bank(trees=bank.trees[1:], policy=bank.policy.model_copy(update={"signals": {
        "entropy": bank.policy.signals["entropy"].model_copy(update={"ladder_trees": ["n5", "n3"],
                                                                     "ladder_thresholds": [0.5]})}}))
    assert isinstance(make_policy(DecodingConfig(policy="entmtp-star"), no_one), FixedTree)


@pytest.mark.parametrize("policy", ["entmtp-star", "entmtp-ladder", "entmtp-tau"])
def test_bank_policies_decode_exactly_what_ar_decodes(tiny_model_dirs, tmp_path, policy):
    from entmtp_ray.config import DecodingConfig, ModelConfig
    from helpers.engines import make_engine

    model_dir, heads_dir = tiny_model_dirs
    model_cfg = ModelConfig(model=str(model_dir), heads=str(heads_dir), dtype="fp32", device="cpu")
    from entmtp_ray.calibrate.rollouts import measure_rollout

    reference = make_engine(model_cfg, DecodingConfig(policy="ar", max_new_tokens=40)).generate("r", "Write a poem.")
    engine = make_engine(model_cfg, DecodingConfig(policy="hydra", max_new_tokens=40))  # its heads rank the drafts
    ids = engine.encode("Write a poem.")
    seen = sorted(measure_rollout(engine.decoder, ids + reference.output_token_ids, len(ids), (16, 8, 8, 8, 8)).entropy)
    q = [seen[int(f * (len(seen) - 1))] for f in (0.3, 0.4, 0.5, 0.6, 0.7)]
    bank = make_bank(model="tiny-vicuna")
    # the raw signal (beta 0) with thresholds inside its range, so the switching policies do switch
    bank.policy.beta = 0.0
    bank.policy.signals["entropy"] = SignalParams(initial=q[2], ladder_trees=["n5", "n3", "n1"],
                                                  ladder_thresholds=[q[0], q[4]], conservative="n1",
                                                  aggressive="n5", tau_on=q[1], tau_off=q[3])
    path = tmp_path / "bank.json"
    save_bank(bank, path)
    engine = make_engine(model_cfg, DecodingConfig(policy=policy, bank=str(path), max_new_tokens=40))
    # the policy settled at the step costs measured here, on any of the bank's trees: each tree it runs is built
    assert engine.decoder.costs.startswith("step costs ")
    assert set(engine.decoder.policy.trees()) <= set(engine.decoder.buffers)
    row = engine.run("r", "Write a poem.")
    assert row["error"] is None and row["bank"] == str(path) and row["policy"] == policy
    assert row["output_token_ids"] == reference.output_token_ids
    used = set(row["tree_usage"])
    assert used <= {"n1", "n3", "n5"} and (policy == "entmtp-star" or len(used) > 1), row["tree_usage"]


def test_step_costs_not_cached_here_are_measured_after_the_first_row_not_before_it(tiny_model_dirs, tmp_path,
                                                                                     monkeypatch):
    """With no cost table on the machine, an engine decodes its first row at the bank's costs (nothing timed before
    it), measures the costs before its second row, settles, and every row is still AR's tokens; the next engine on
    the machine reads the table and settles at once."""
    from entmtp_ray.config import DecodingConfig, ModelConfig
    from entmtp_ray.decode.costs import costs_dir
    from helpers.engines import make_engine

    monkeypatch.setenv("ENTMTP_COSTS", str(tmp_path / "costs"))
    model_dir, heads_dir = tiny_model_dirs
    model_cfg = ModelConfig(model=str(model_dir), heads=str(heads_dir), dtype="fp32", device="cpu")
    path = tmp_path / "bank.json"
    save_bank(make_bank(model="tiny-vicuna"), path)
    reference = make_engine(model_cfg, DecodingConfig(policy="ar", max_new_tokens=24))
    engine = make_engine(model_cfg, DecodingConfig(policy="entmtp-tau", bank=str(path), max_new_tokens=24))
    assert engine.decoder.costs_pending and engine.decoder.costs.startswith("step costs the bank's until measured")
    assert not costs_dir().exists()  # nothing timed before the first row
    prompts = ["Write a poem.", "Name three colours.", "Count to five."]
    first = engine.run("r0", prompts[0])
    assert engine.decoder.costs_pending and not costs_dir().exists()
    second = engine.run("r1", prompts[1])  # measured before this row
    assert not engine.decoder.costs_pending and engine.decoder.costs.startswith("step costs measured now (")
    assert len(list(costs_dir().glob("*.json"))) == 1
    for row, prompt in zip((first, second, engine.run("r2", prompts[2])), prompts):
        assert row["error"] is None and row["output_token_ids"] == reference.run("a", prompt)["output_token_ids"]
    again = make_engine(model_cfg, DecodingConfig(policy="entmtp-tau", bank=str(path), max_new_tokens=24))
    assert not again.decoder.costs_pending and again.decoder.costs.startswith("step costs cached from ")
    assert [t.name for t in again.decoder.policy.trees()] == [t.name for t in engine.decoder.policy.trees()]


def test_bank_policy_without_task_or_bank_fails_before_loading():
    from entmtp_ray.config import DecodingConfig, ModelConfig
    from entmtp_ray.pipeline.assemble import resolve

    with pytest.raises(ValueError, match="pass --task NAME"):
        resolve(ModelConfig(heads="untrained"), DecodingConfig(policy="entmtp-tau"))
    with pytest.raises(FileNotFoundError, match="build one with jobs/build_bank.py"):
        resolve(ModelConfig(heads="untrained"), DecodingConfig(policy="entmtp-tau", task="nosuchtask"))


def test_the_default_policy_is_entmtp_with_the_task_bank_the_general_bank_or_an_auto_bank(tiny_model_dirs, tmp_path):
    from entmtp_ray.assets import shipped_bank
    from entmtp_ray.config import DecodingConfig, ModelConfig
    from entmtp_ray.pipeline.assemble import resolve

    embedded = ModelConfig(dtype="bf16", device="cpu")  # the primary banks' hardware (fp32: the next test)
    assert DecodingConfig().policy == "auto"
    for task in ("gsm8k", "humaneval", "sharegpt"):  # each task's own bank
        resolved = resolve(embedded, DecodingConfig(task=task))
        assert resolved.decoding.policy == "entmtp-tau" and resolved.bank_path == shipped_bank(embedded.model, task)
    general = resolve(embedded, DecodingConfig())  # a dataset of the user's own: the general bank
    assert general.decoding.policy == "entmtp-tau" and general.decoding.bank == str(shipped_bank(embedded.model,
                                                                                                 "general"))
    assert general.bank.task == "general" and "humaneval" in general.bank.calibration["source"]
    bank = tmp_path / "bank.json"
    save_bank(make_bank(model="tiny-vicuna"), bank)
    model_dir, heads_dir = tiny_model_dirs
    local = ModelConfig(model=str(model_dir), heads=str(heads_dir))
    assert resolve(local, DecodingConfig(bank=str(bank))).decoding.policy == "entmtp-tau"  # --bank: that one
    auto = resolve(local, DecodingConfig(task="gsm8k"))  # no bank ships for this model: the job calibrates one
    assert auto.requested.policy == "entmtp-tau" and auto.requested.bank == "auto" and auto.calibrate
    assert auto.decoding.policy == "hydra" and auto.bank_path is None  # until then (or without a job): Hydra's tree
    assert resolve(embedded, DecodingConfig(policy="ar", task="gsm8k")).decoding.policy == "ar"  # asked: kept
    # why, in the job's summary
    assert resolved.source == f"the bank shipped for {embedded.model} and --task sharegpt"
    assert general.source == f"{embedded.model}'s general bank (no --task)"
    assert auto.source.startswith("calibrated on the job's prompts: no bank ships for") and \
        auto.source.endswith("; until calibrated, hydra")


def test_the_default_reads_the_variant_of_a_shipped_bank_timed_in_the_actors_dtype():
    """Each shipped bank comes in a bf16 CPU variant (the primary file) and an fp32 one (cpu-fp32/): a CPU without
    native bf16 computes in fp32, where a tree step costs several times more, so its trees are smaller."""
    from entmtp_ray.assets import shipped_bank, shipped_bank_variants
    from entmtp_ray.calibrate.bank import Actors, bank_hardware, default_bank_path
    from entmtp_ray.config import DecodingConfig, ModelConfig
    from entmtp_ray.pipeline.assemble import actors_here, resolve

    model = "smollm2-135m-instruct"
    for task in ("general", "gsm8k", "humaneval", "sharegpt"):
        primary, *variants = shipped_bank_variants(model, task)
        assert primary == shipped_bank(model, task) and [v.parent.name for v in variants] == ["cpu-fp32"]
        assert bank_hardware(primary).dtype == "bfloat16" and bank_hardware(variants[0]).dtype == "float32"
        assert default_bank_path(model, task, Actors(on_gpu=False, dtype="bfloat16")) == primary
        assert default_bank_path(model, task, Actors(on_gpu=False, dtype="float32")) == variants[0]
        assert default_bank_path(model, task, Actors(on_gpu=True, dtype="float16")) == primary  # none suits: then
        assert default_bank_path(model, task) == primary  # nothing known of the actors
        fp32 = ModelConfig(dtype="fp32", device="cpu")
        assert actors_here(fp32) == Actors(on_gpu=False, dtype="float32")
        plan = resolve(fp32, DecodingConfig(task=None if task == "general" else task))
        assert plan.bank_path == variants[0] and plan.bank.hardware.dtype == "float32" and not plan.calibrate
        assert "its cpu-fp32 variant" in plan.source
        # the actors' dtype, not this process's, once they are known
        placed = resolve(fp32, DecodingConfig(task=None if task == "general" else task),
                         Actors(on_gpu=False, dtype="bfloat16"))
        assert placed.bank_path == primary and not placed.calibrate
        if task != "general":  # an entmtp policy by name reads the variant too
            assert resolve(fp32, DecodingConfig(policy="entmtp-tau", task=task)).bank_path == variants[0]


@pytest.mark.slow
def test_build_bank_job_end_to_end_and_resume(tiny_model_dirs, tmp_path, ray_cluster):
    """jobs/build_bank.py on real local Ray with the tiny model: rollouts, rank tables, growth,
    timings, sweeps -> a bank that loads; a run stopped during the timing resumes it; a finished run's
    rerun reuses every cached stage."""
    from entmtp_ray.jobs.build_bank import main

    model_dir, heads_dir = tiny_model_dirs
    out, work = tmp_path / "bank.json", tmp_path / "work"
    args = ["--task", "gsm8k", "--dataset", str(GSM8K), "--prompts", "4",
            "--max-new-tokens", "24", "--budget", "8", "--timing-prompts", "2", "--model", str(model_dir),
            "--heads", str(heads_dir), "--out", str(out), "--work", str(work)]
    first = run_main(main, args)
    assert first.returncode == 0, first.stderr[-3000:]
    bank = load_bank(out, max_depth=4)
    assert bank.task == "gsm8k" and bank.hardware.threads == 1
    assert (bank.calibration["prompts"], bank.calibration["held_out"]) == (3, 1) and bank.selection.by == "measured"
    assert "selection on 1 held-out prompts" in first.stderr  # the replayed and measured figures, as a table
    assert bank.calibration["source"] == "gsm8k: gsm8k_train_200.jsonl (a local copy)"  # no path of this machine
    nodes = [t.nodes for t in bank.trees]
    assert nodes == sorted(nodes) and nodes[0] == 1 and max(nodes) <= 8
    taus = [t.tau for t in bank.trees]
    assert taus == sorted(taus), "the frontier's accepted length grows with its nodes"
    for name in ("tables.json", "step_seconds.json", "measured.json", "sweep.json"):
        assert (work / name).is_file(), name
    timing = json.loads((work / "step_seconds.json").read_text())
    trees = set(timing["steps"])
    assert {t.name for t in bank.trees} <= trees
    assert len(timing["rounds"]) == 2 and all(set(r) == trees for r in timing["rounds"]), "side by side per prompt"

    # stopped during the timing: the second prompt's round had not reached one tree
    cut = sorted(trees)[0]
    del timing["steps"], timing["rounds"][1][cut]
    (work / "step_seconds.json").write_text(json.dumps(timing))
    second = run_main(main, args)
    assert second.returncode == 0, second.stderr[-3000:]
    resumed = json.loads((work / "step_seconds.json").read_text())
    assert resumed["rounds"][0] == timing["rounds"][0] and set(resumed["rounds"][1]) == trees
    assert all(resumed["rounds"][1][n] == timing["rounds"][1][n] for n in trees - {cut}), "timed trees were redone"

    resumed_bank = load_bank(out, max_depth=4)
    assert [t.name for t in resumed_bank.trees] == [t.name for t in bank.trees]  # the frontier needs no timing

    stamp = (work / "step_seconds.json").stat().st_mtime
    third = run_main(main, args)
    assert third.returncode == 0, third.stderr[-3000:]
    # every rollout was already written: none decoded in this run (the summary's first_row_s)
    assert "rows already in" in third.stderr and '"first_row_s": null' in third.stderr
    assert (work / "step_seconds.json").stat().st_mtime == stamp
    again = load_bank(out, max_depth=4)
    assert again.trees == resumed_bank.trees and again.policy == resumed_bank.policy


def test_a_mixed_bank_calibrates_on_an_even_share_of_each_tasks_tune_prompts():
    """build_bank with several --task values: the shares add up to --prompts, ids name their task (so they stay
    unique), only tune prompts are used, and the source names every task without a local path."""
    from entmtp_ray.jobs.build_bank import calibration_prompts, calibration_source
    from entmtp_ray.pipeline.tasks import humaneval_tune_ids, is_eval_row

    gsm8k = str(GSM8K)
    table = calibration_prompts(["gsm8k", "humaneval"], gsm8k, "train", 7, 123)
    ids = table.column("id").to_pylist()
    assert table.column_names == ["id", "prompt", "_messages", "_input_error"] and len(set(ids)) == 7
    assert [i.split(":", 1)[0] for i in ids] == ["gsm8k"] * 4 + ["humaneval"] * 3
    assert not any(is_eval_row("gsm8k", i.split(":", 1)[1]) for i in ids[:4])
    assert {i.split(":", 1)[1] for i in ids[4:]} <= humaneval_tune_ids()
    assert all(p for p in table.column("prompt").to_pylist())
    assert calibration_source(["gsm8k", "humaneval"], gsm8k) == "gsm8k: gsm8k_train_200.jsonl (a local copy) + humaneval"
    assert calibration_source(["sharegpt"], None) == "sharegpt"


def test_a_bank_leaves_out_of_its_calibration_the_prompts_its_heads_were_trained_on(tmp_path, capsys):
    """The shipped heads list the prompt ids they were trained on (seen_prompts.json): a bank built for them
    calibrates and measures on other tune prompts, so its acceptance is what unseen prompts get."""
    from entmtp_ray.config import ModelConfig
    from entmtp_ray.jobs import build_bank
    from entmtp_ray.pipeline.tasks import load_prompts

    seen, left_out = build_bank.seen_prompts(ModelConfig(), None)  # the shipped heads' own list
    assert len(seen["humaneval"]) == 84 and len(seen["gsm8k"]) == 960 and "of seen_prompts.json" in left_out
    gsm8k = str(GSM8K)
    every = set(load_prompts("gsm8k", gsm8k, split="train", subset="tune").column("id").to_pylist())
    assert every & seen["gsm8k"], "the fixture holds prompts the heads saw"
    kept = set(build_bank.calibration_prompts(["gsm8k"], gsm8k, "train", 500, 123, seen).column("id").to_pylist())
    assert kept == every - seen["gsm8k"]
    # every HumanEval tune problem trained the heads: nothing is left, and the job says how to go on
    assert len(build_bank.calibration_prompts(["humaneval"], None, "train", 10, 123, seen)) == 0
    with pytest.raises(SystemExit):
        build_bank.main(["--task", "humaneval", "--out", str(tmp_path / "b.json"), "--work", str(tmp_path / "w")])
    assert "pass --seen none" in capsys.readouterr().err
    assert build_bank.seen_prompts(ModelConfig(), "none") == ({}, "")
    heads = tmp_path / "heads"  # a local heads folder's own list
    heads.mkdir()
    (heads / "seen_prompts.json").write_text(json.dumps({"source": "mine", "gsm8k": ["row-0000001"]}))
    assert build_bank.seen_prompts(ModelConfig(heads=str(heads)), None)[0] == {"gsm8k": {"row-0000001"}}
    assert build_bank.seen_prompts(ModelConfig(heads=str(tmp_path)), None) == ({}, "")  # none listed
    (tmp_path / "bad.json").write_text("[1,")
    with pytest.raises(ValueError, match="pass --seen none"):
        build_bank.seen_prompts(ModelConfig(), str(tmp_path / "bad.json"))
