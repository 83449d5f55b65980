"""jobs/bench.py end to end on the embedded model: a tiny run of every system, its rows and report."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from entmtp_ray.assets import shipped_bank
from entmtp_ray.calibrate.bank import load_bank
from entmtp_ray.jobs import bench as bench_job
import bench_engine  # tools/bench_engine.py (pytest puts tools/ on the path)

ROOT = Path(__file__).resolve().parents[2]
THREADS = str(torch.get_num_threads())  # this test process's share of the cores (conftest.py)


@pytest.mark.slow
def test_tiny_bench_of_every_system(tmp_path, capsys):
    out = tmp_path / "bench"
    systems = ["ar", "hf-generate", "hf-prompt-lookup", "hydra", "medusa", "entmtp-star", "entmtp-ladder",
               "entmtp-tau"]
    rc = bench_job.main(["--task", "gsm8k", "--dataset", str(ROOT / "tests" / "fixtures" / "gsm8k_train_200.jsonl"),
                         "--limit", "1", "--max-new-tokens", "10", "--threads", THREADS,
                         "--systems", *systems, "--output", str(out)])
    stdout = capsys.readouterr().out
    assert rc == 0, stdout[-3000:]
    summary = json.loads(stdout.strip().splitlines()[-1])
    drafting = [s for s in systems if s not in ("ar", "hf-generate", "hf-prompt-lookup")]
    # T=0 greedy; T=0.7 every system under typical acceptance and the drafting ones under exact too
    variants = ({(s, 0.0, "greedy") for s in systems} | {(s, 0.7, "typical") for s in systems}
                | {(s, 0.7, "exact") for s in drafting})
    assert summary["differs"] == 0 and summary["rows"] == len(variants)

    rows = pq.read_table(out / "rows").to_pylist()
    assert {(r["policy"], r["temperature"], r["acceptance"]) for r in rows} == variants
    assert all(r["error"] is None and r["task"] == "gsm8k" and 1 <= r["num_output_tokens"] <= 10 for r in rows)
    greedy = [r for r in rows if r["temperature"] == 0]
    ar = {r["id"]: r["output_token_ids"] for r in greedy if r["policy"] == "ar"}
    for r in greedy:
        if r["policy"] == "ar":
            assert r["matches_ar"] is None
        else:  # the lossless check: equal, or proven a float tie at the first difference
            assert r["matches_ar"] in ("equal", "tie"), r
            assert (r["output_token_ids"] == ar[r["id"]]) == (r["matches_ar"] == "equal")
    assert all(r["output_nll"] is not None and r["output_nll"] >= 0 for r in rows)
    for r in rows:
        if r["policy"] in ("ar", "hf-generate"):
            assert r["mean_accepted_length"] == 1.0
        elif r["policy"] == "hf-prompt-lookup":
            assert r["steps"] is None  # transformers does not report its steps
        else:
            assert r["steps"] >= 1 and r["mean_accepted_length"] >= 1.0

    report = json.loads((out / "report.json").read_text())
    by_key = {(r["system"], r["temperature"], r["acceptance"]): r for r in report["rows"]}
    assert set(by_key) == variants
    for (system, temperature, rule), r in by_key.items():
        assert r["tokens_per_s"] > 0 and r["speedup_vs_ar"] > 0
        mine = [x for x in rows if (x["policy"], x["temperature"], x["acceptance"]) == (system, temperature, rule)]
        tokens = sum(x["num_output_tokens"] for x in mine)
        assert r["tokens_per_s"] == pytest.approx(tokens / sum(x["total_s"] for x in mine))
    assert by_key[("ar", 0.0, "greedy")]["speedup_vs_ar"] == pytest.approx(1.0)
    assert report["setup"]["threads"] == int(THREADS)
    assert (out / "report.md").is_file() and (out / "tokens_per_s.png").is_file()


def test_bench_config_errors_fail_before_any_work(tmp_path, capsys):
    rc = bench_job.main(["--dataset", str(tmp_path / "missing.jsonl"), "--systems", "entmtp-tau",
                         "--output", str(tmp_path / "out")])
    assert rc == 2  # with no task the entmtp systems read the general bank (as a job does); the missing file stops it
    assert "missing.jsonl: no such file or directory" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    rc = bench_job.main(["--task", "gsm8k", "--systems", "entmtp-tau", "--also-bank", "general",
                         "--output", str(tmp_path / "out")])
    assert rc == 2 and "--also-bank general: write NAME=FILE" in capsys.readouterr().err


def shipped_here(task: str) -> str:
    """The bank shipped for the embedded model and `task` in its variant for this host (bf16 or fp32 CPUs)."""
    from entmtp_ray.calibrate.bank import default_bank_path
    from entmtp_ray.config import ModelConfig
    from entmtp_ray.pipeline.assemble import actors_here

    return str(default_bank_path("smollm2-135m-instruct", task, actors_here(ModelConfig())))


def test_another_bank_and_the_unadapted_policy_run_as_more_systems_in_the_same_run(tmp_path, capsys):
    """--also-bank: two banks side by side in one interleaved run (an auto bank against the shipped one); and
    --unadapted: the policy without adapting to the content beside it."""
    general = shipped_bank("smollm2-135m-instruct", "general")
    rc = bench_job.main(["--task", "gsm8k", "--dataset", str(ROOT / "tests" / "fixtures" / "gsm8k_train_200.jsonl"),
                         "--limit", "1", "--max-new-tokens", "8", "--temperatures", "0", "--threads", THREADS,
                         "--systems", "ar", "entmtp-tau", "--also-bank", f"general={general}", "--unadapted",
                         "--output", str(tmp_path / "out")])
    assert rc == 0, capsys.readouterr().err[-3000:]
    rows = {r["policy"]: r for r in pq.read_table(tmp_path / "out" / "rows").to_pylist()}
    assert set(rows) == {"ar", "entmtp-tau", "entmtp-tau@general", "entmtp-tau@unadapted"}
    assert rows["entmtp-tau@unadapted"]["matches_ar"] in ("equal", "tie")
    star = load_bank(shipped_here("gsm8k")).policy.star
    assert [name for name, _ in rows["entmtp-tau@unadapted"]["tree_usage"]] == [star]
    assert rows["entmtp-tau@general"]["bank"] == str(general)
    assert rows["entmtp-tau"]["bank"] == shipped_here("gsm8k")
    assert rows["entmtp-tau@general"]["matches_ar"] in ("equal", "tie")
    assert all(name.startswith("general-") for name, _ in rows["entmtp-tau@general"]["tree_usage"])




def test_engine_step_breakdown_times_every_phase_of_a_tree_step():
    """tools/bench_engine.py's per-step breakdown on the embedded model with its shipped heads and a bank
    tree, from the decoder's own profile: every phase is timed, and the phases fill the step."""
    from entmtp_ray.calibrate.bank import load_bank
    from entmtp_ray.config import ModelConfig
    from entmtp_ray.decode.results import PHASES
    from entmtp_ray.decode.tree import load_topology
    from entmtp_ray.pipeline.assemble import load_stack

    stack = load_stack(ModelConfig(dtype="bf16", device="cpu"), with_heads=True)
    bank = load_bank(shipped_bank("smollm2-135m-instruct", "gsm8k"))
    prompts = [stack.loaded.encode_prompt("What is 12 times 7? Answer briefly.")]
    star = bank.topology(bank.policy.star)
    assert star.depth > 0
    parts = bench_engine.step_breakdown(stack.loaded, stack.drafter, prompts, 12, star)
    assert set(parts) == {*PHASES, "step_total"}
    assert all(parts[phase] > 0 for phase in PHASES)
    phases = sum(parts[phase] for phase in PHASES)
    assert 0.9 * parts["step_total"] < phases <= parts["step_total"]
    assert parts["verify"] > parts["choose"] and parts["verify"] > parts["observe"]
    ar = bench_engine.step_breakdown(stack.loaded, stack.drafter, prompts, 12, load_topology("ar"))
    assert ar["verify"] > 0 and ar["draft"] < ar["verify"]


def test_verify_cost_times_each_tree_on_the_models_device(tiny_model_dirs):
    """tools/bench_engine.py's verify timing: inputs, tree buffers and scored rows on the model's device (the
    CPU here; CUDA on a GPU machine, where it also synchronises before reading the clock)."""
    from entmtp_ray.decode.tree import load_topology
    from entmtp_ray.model.loading import load_model

    loaded = load_model(str(tiny_model_dirs[0]), dtype="fp32", device="cpu")
    costs = bench_engine.verify_cost(loaded, loaded.encode_prompt("Hello there"),
                                     {1: load_topology("ar"), 64: load_topology("hydra")}, repeats=2)
    assert set(costs) == {1, 64} and all(ms > 0 for ms in costs.values())
def test_attention_costs_time_sdpa_and_the_fixed_order_attention_side_by_side(tiny_model_dirs, capsys):
    """--attention-costs: a row per prefix and attention, a JSON line with both; with a bank, its entmtp-tau's
    decodes with each attention, the fixed-order one equal to AR's; refused (exit 2) where the fixed-order
    attention does not serve the forward (kernel not built or switched off)."""
    from entmtp_ray.calibrate.bank import build_policy, load_bank
    from entmtp_ray.config import DecodingConfig, ModelConfig
    from entmtp_ray.model.attention import fixed_order_ready, sdpa_only
    from entmtp_ray.pipeline.assemble import load_stack

    if not fixed_order_ready():
        pytest.skip("the fixed-order attention kernel could not be built")
    model, heads = (str(d) for d in tiny_model_dirs)
    stack = load_stack(ModelConfig(model=model, heads=heads, dtype="bf16", device="cpu"), with_heads=True)
    policy = build_policy(DecodingConfig(policy="entmtp-tau"), load_bank(shipped_bank("smollm2-135m-instruct",
                                                                                      "general")))
    prompts = [stack.loaded.encode_prompt("Hello there"), stack.loaded.encode_prompt("Hello there, " * 20)]
    assert bench_engine.attention_costs(stack, prompts, 1, policy, max_new_tokens=12) == 0
    out = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(out[-1])
    figures = summary["verify_ms"]
    assert set(figures) == {str(len(p)) for p in prompts}
    assert all(set(f) == {"sdpa", "fixed-order"} and all(ms > 0 for ms in f["sdpa"].values()) for f in figures.values())
    assert sum(line.startswith("| ") for line in out) == 1 + 2 * len(prompts)  # the header, a row per pair
    speeds = summary["policy"]
    assert speeds["fixed-order"]["equal_to_ar"] == len(prompts) and speeds["sdpa"]["tokens_per_s"] > 0
    assert any(line.startswith("entmtp-tau tokens/s") for line in out)
    with sdpa_only():  # as where the kernel is not built or switched off: refused, with the fix named
        assert bench_engine.attention_costs(stack, prompts, 1) == 2
    assert "python -m entmtp_ray.model.native" in capsys.readouterr().err


@pytest.mark.slow  # the real embedded model, every system in turn
def test_throughput_mode_tables_every_system_at_every_k_in_one_run(tmp_path, capsys):
    """--concurrent-requests: each (system, K) decodes all prompts; aggregate rates, ratios to the system's own
    K=1 and the greedy check against AR at K=1; a bank given for one K runs there."""
    general = shipped_bank("smollm2-135m-instruct", "general")
    out = tmp_path / "out"
    rc = bench_job.main(["--task", "gsm8k", "--dataset", str(ROOT / "tests" / "fixtures" / "gsm8k_train_200.jsonl"),
                         "--limit", "3", "--max-new-tokens", "8", "--threads", THREADS, "--concurrent-requests", "1", "2",
                         "--systems", "ar", "entmtp-tau", "hf-generate", "--bank-at", f"2={general}",
                         "--output", str(out)])
    stdout = capsys.readouterr().out
    assert rc == 0, stdout[-3000:]
    report = json.loads((out / "throughput.json").read_text())
    lines = {(line["system"], line["k"]): line for line in report["lines"]}
    assert set(lines) == {(s, k) for s in ("ar", "entmtp-tau", "hf-generate") for k in (1, 2)}
    for (system, k), line in lines.items():
        assert line["tokens_per_s"] > 0 and line["tokens"] > 0
        passes = [p for p in report["passes"] if (p["system"], p["k"]) == (system, k)]
        assert line["tokens_per_s"] == pytest.approx(passes[0]["tokens"] / passes[0]["wall_s"])
        assert line["greedy"]["differs"] == 0 and sum(line["greedy"].values()) == 3
    assert lines["ar", 1]["x_own_k1"] == pytest.approx(1.0) and lines["ar", 1]["greedy"]["equal"] == 3
    # entmtp-tau adapts: where its bank's tau does not pay for its tree at the step costs measured here, it may run the
    # one-node tree for all of these 8 tokens (probing its own every 16th step), so its tau is at least AR's
    assert lines["ar", 2]["tau"] == pytest.approx(1.0) and lines["entmtp-tau", 1]["tau"] >= 1.0
    assert report["banks"]["entmtp-tau K=2"] == str(general)
    assert "| entmtp-tau | 2 |" in (out / "throughput.md").read_text()
    rc = bench_job.main(["--task", "gsm8k", "--concurrent-requests", "1", "2", "--bank-at", f"3={general}",
                         "--output", str(tmp_path / "bad")])
    assert rc == 2 and "--bank-at 3=" in capsys.readouterr().err


@pytest.mark.slow  # the real embedded model, every system in turn
def test_a_quantized_bench_checks_ours_against_quantized_ar_and_leaves_transformers_uncompared(tmp_path, capsys):
    """--quantize: our systems decode the quantized model, so their greedy output must be its AR output;
    transformers' generate runs the unquantized weights, another model: not compared, never `differs`.
    int8 on one short question: ATen's int4 CPU matmul is slow enough on an AVX2-only host (some 27 s per prefill
    of a gsm8k question) to cost this test minutes; test_quant.py decodes int4 on the tiny model."""
    out = tmp_path / "bench"
    dataset = tmp_path / "one.jsonl"
    dataset.write_text(json.dumps({"question": "What is 2 + 3?", "answer": "2 + 3 = 5\n#### 5"}) + "\n")
    rc = bench_job.main(["--task", "gsm8k", "--dataset", str(dataset), "--output", str(out)])
    assert rc == 2 and "pass --subset all" in capsys.readouterr().err  # its one row is a tune row, refused at once
    rc = bench_job.main(["--task", "gsm8k", "--dataset", str(dataset), "--subset", "all",
                         "--limit", "1", "--max-new-tokens", "12", "--threads", THREADS, "--temperatures", "0",
                         "--quantize", "int8", "--systems", "ar", "hf-generate", "entmtp-tau", "--output", str(out)])
    stdout = capsys.readouterr().out
    assert rc == 0, stdout[-3000:]
    rows = {r["policy"]: r for r in pq.read_table(out / "rows").to_pylist()}
    assert rows["entmtp-tau"]["matches_ar"] in ("equal", "tie") and rows["hf-generate"]["matches_ar"] == "not compared"
    assert rows["ar"]["output_nll"] >= 0  # scored by the quantized model's own forward


def test_verify_costs_under_each_weight_scheme(tiny_model_dirs, capsys):
    """tools/bench_engine.py --quantize: each tree's verify ms under every scheme, interleaved over the rounds."""
    from entmtp_ray.decode.tree import load_topology
    from entmtp_ray.model.loading import load_model

    loaded = load_model(str(tiny_model_dirs[0]), dtype="bf16", device="cpu")
    trees = {"ar": load_topology("ar"), "chain3": load_topology("chain3")}
    assert bench_engine.scheme_costs(loaded, loaded.encode_prompt("Hello there"), trees, ["none", "int4"], 2) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(summary["verify_ms"]) == {"none", "int4"}
    assert all(set(costs) == {"ar", "chain3"} and min(costs.values()) > 0 for costs in summary["verify_ms"].values())


def test_tree_costs_time_every_size_through_the_verifier_with_the_weight_read_floor(tiny_model_dirs, capsys):
    """tools/bench_engine.py --tree-costs (without llama.cpp, which CI does not build): verify ms of a tree of each
    size through the decoder's own verifier, and the weights' bytes and read time beside them."""
    from types import SimpleNamespace

    from entmtp_ray.decode.tree import build_buffers
    from entmtp_ray.model.loading import load_model

    trees = bench_engine.sized_trees()
    assert [build_buffers(t).num_nodes for t in trees.values()] == list(bench_engine.TREE_SIZES)
    loaded = load_model(str(tiny_model_dirs[0]), dtype="fp32", device="cpu")
    assert bench_engine.tree_costs(SimpleNamespace(loaded=loaded), loaded.encode_prompt("Hello there"), False, 2) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert list(summary["verify_ms"]) == ["ours"]
    assert [int(n) for n in summary["verify_ms"]["ours"]] == list(bench_engine.TREE_SIZES)
    assert min(summary["verify_ms"]["ours"].values()) > 0 and summary["weight_read_ms"] > 0
    # what a one-token step reads: every weight but the (untied) embedding, of which it reads one row
    embedding = loaded.model.model.embed_tokens.weight
    assert summary["weight_bytes"] == sum(p.numel() * p.element_size() for p in loaded.model.parameters()) \
        - embedding.numel() * embedding.element_size()


@pytest.mark.slow
def test_the_bench_resolves_the_entmtp_bank_as_a_job_does(tmp_path, capsys):
    """No --task: the entmtp systems run the model's general bank, as the job's default policy would, and each row
    names it; --bank auto (a job's calibration) is refused with the way to bench what it wrote."""
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"prompt": "Name three colours."}) + "\n")
    out = tmp_path / "bench"
    rc = bench_job.main(["--dataset", str(chat), "--max-new-tokens", "6", "--threads", THREADS, "--temperatures", "0",
                         "--systems", "ar", "entmtp-tau", "--output", str(out)])
    stdout = capsys.readouterr().out
    assert rc == 0, stdout[-3000:]
    rows = {r["policy"]: r for r in pq.read_table(out / "rows").to_pylist()}
    assert rows["entmtp-tau"]["bank"] == shipped_here("general") and rows["ar"]["bank"] is None
    assert rows["entmtp-tau"]["matches_ar"] in ("equal", "tie")
    rc = bench_job.main(["--dataset", str(chat), "--bank", "auto", "--systems", "ar", "entmtp-tau",
                         "--output", str(tmp_path / "auto")])
    assert rc == 2 and "--bank auto is calibrated by the generation job" in capsys.readouterr().err


def test_llama_cpp_prefills_every_prompt_in_full_as_ours_do():
    """The baseline forgets the last prompt: llama-cpp-python reuses a common prefix's KV cache, and the warm-up
    (the first prompt) once spared the first timed row its whole prefill."""
    pytest.importorskip("llama_cpp")  # the `llamacpp` extra: its build takes minutes, so not in `make setup`
    from entmtp_ray.bench.compare import LlamaCpp
    from entmtp_ray.config import DecodingConfig, ModelConfig
    from entmtp_ray.pipeline.assemble import load_stack

    loaded = load_stack(ModelConfig(), with_heads=False).loaded
    engine = LlamaCpp(loaded, threads=1, seed=0)
    evaluated = []
    real_eval = engine.llm.eval
    engine.llm.eval = lambda tokens: (evaluated.append(list(tokens)), real_eval(tokens))[1]
    ids = loaded.encode_prompt("Name three colours.")
    cfg = DecodingConfig(max_new_tokens=2)
    first = engine.run(ids, cfg, 0)
    evaluated.clear()
    again = engine.run(ids, cfg, 0)
    assert evaluated[0] == ids  # the whole prompt again, not only its last token
    assert again.output_token_ids == first.output_token_ids
