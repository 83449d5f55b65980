"""Throughput report on a hand-built pair of runs whose every figure is worked out below."""

from __future__ import annotations

import json
import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from entmtp_ray.bench.report import load_runs, summarize
from entmtp_ray.jobs.report import main
from entmtp_ray.pipeline.records import OUTPUT_SCHEMA


# Run 1 (a benchmark at T=0, task gsm8k, with output_nll and an extra input column):
#   ar           a: 10 tok / 1 s, b: 30 tok / 1 s, c: 20 tok / 2 s  -> 60 / 4 = 15 tok/s (row mean 16.7)
#   entmtp-star  a: 20 tok / 1 s, b: 60 tok / 4 s, c: 4 tok / 0.1 s, d: failed
#                -> 84 / 5.1 tok/s (row mean 25), x AR = 84 / 5.1 / 15, paired ratios 2, 0.5, 4 -> 2
#   tau = (2*10 + 3*20 + 2*2) / (10 + 20 + 2) = 84 / 32
#   nodes per step (wide 5 nodes, deep 3): (6*5 + 4*3 + 20*5 + 2*3) / 32 = 148 / 32
#   per position (steps-weighted, c and a padded): [5 + 16 + 1, 2.5 + 12 + 1, 8] / 32
#   trees: wide 6 + 20, deep 4 + 2 of 32 steps; switches 2 per 84 tokens
#   scheduler: (0.08 + 0.32 + 0.01) / (0.8 + 3.5 + 0.09)
#   NLL: ar (2*10 + 1*30 + 1*20) / 60, star (1*20 + 1.5*60 + 2*4) / 84
#   tokens vs AR: a equal, b other length, c same length but last token differs
#   signal = 4 - accepted on a's 10 steps and c's second step (c's first step has no signal)
# Run 2 (an older run: no schedule_s / step columns; matches_ar from the benchmark):
#   hf-generate T=0: 10 tok / 2 s, 30 tok / 2 s -> 10 tok/s, x AR 10 / 15; matches_ar equal, tie
#   medusa T=0.7 with no task and no AR to compare with
STAR_A_SIGNALS = [3.0, 3.0, 3.0, 2.0, 2.0, 2.0, 1.0, 1.0, 2.0, 1.0]
STAR_A_ACCEPTED = [1, 1, 1, 2, 2, 2, 3, 3, 2, 3]


def _row(**fields) -> dict:
    timing = {"prefill_s": 0.0, "decode_s": fields.get("total_s")} if fields.get("total_s") else {}
    tokens_per_s = {"tokens_per_s": fields["num_output_tokens"] / fields["total_s"]} if fields.get("total_s") else {}
    return {"task": "gsm8k", "temperature": 0.0, "acceptance": "greedy", "tree_switches": 0,
            **timing, **tokens_per_s, **fields}


def _ar(id_, tokens, total_s, output, nll):
    return _row(id=id_, policy="ar", num_output_tokens=tokens, total_s=total_s, steps=tokens, verified_nodes=tokens,
                mean_accepted_length=1.0, accepted_per_position=[], tree_usage=[("chain", tokens)],
                output_token_ids=output, output_nll=nll)


RUN1 = [
    _ar("a", 10, 1.0, [1, 2, 3], 2.0),
    _ar("b", 30, 1.0, [4, 5, 6], 1.0),
    _ar("c", 20, 2.0, [7, 8, 0], 1.0),
    _row(id="a", policy="entmtp-star", num_output_tokens=20, total_s=1.0, decode_s=0.8, schedule_s=0.08, steps=10,
         verified_nodes=42, mean_accepted_length=2.0, accepted_per_position=[0.5, 0.25],
         tree_usage=[("wide", 6), ("deep", 4)],
         tree_switches=2, output_token_ids=[1, 2, 3], output_nll=1.0, step_signals=STAR_A_SIGNALS,
         step_accepted_lengths=STAR_A_ACCEPTED),
    _row(id="b", policy="entmtp-star", num_output_tokens=60, total_s=4.0, decode_s=3.5, schedule_s=0.32, steps=20,
         verified_nodes=100, mean_accepted_length=3.0, accepted_per_position=[0.8, 0.6, 0.4], tree_usage=[("wide", 20)],
         output_token_ids=[9, 9], output_nll=1.5, step_accepted_lengths=[3] * 20),
    _row(id="c", policy="entmtp-star", num_output_tokens=4, total_s=0.1, decode_s=0.09, schedule_s=0.01, steps=2,
         verified_nodes=6, mean_accepted_length=2.0, accepted_per_position=[0.5, 0.5], tree_usage=[("deep", 2)],
         output_token_ids=[7, 8, 9], output_nll=2.0, step_signals=[None, 3.0], step_accepted_lengths=[3, 1]),
    _row(id="d", policy="entmtp-star", num_output_tokens=0, steps=0, error="RuntimeError: out of memory"),
]
RUN2 = [
    _row(id="a", policy="hf-generate", num_output_tokens=10, total_s=2.0, steps=10, mean_accepted_length=1.0,
         output_token_ids=[1, 2, 3], matches_ar="equal"),
    _row(id="b", policy="hf-generate", num_output_tokens=30, total_s=2.0, steps=30, mean_accepted_length=1.0,
         output_token_ids=[4, 5, 7], matches_ar="tie"),
    _row(id="x", task=None, policy="medusa", temperature=0.7, acceptance="typical", num_output_tokens=10,
         total_s=1.0, steps=5, mean_accepted_length=2.0, accepted_per_position=[0.6], tree_usage=[("medusa", 5)]),
]


def _write(directory, rows, extra: dict, drop=(), parts=1):
    """rows in OUTPUT_SCHEMA (the real types) plus `extra` columns, as `parts` Parquet files."""
    directory.mkdir()
    table = pa.Table.from_pylist(rows, schema=OUTPUT_SCHEMA)
    for name, type_ in extra.items():
        table = table.append_column(pa.field(name, type_), pa.array([row.get(name) for row in rows], type_))
    table = table.drop_columns(list(drop))
    step = math.ceil(table.num_rows / parts)
    for part in range(parts):
        pq.write_table(table.slice(part * step, step), directory / f"part-{part}.parquet")
    return directory


@pytest.fixture
def runs(tmp_path):
    run1 = _write(tmp_path / "run1", RUN1, {"output_nll": pa.float64(), "answer": pa.string()}, parts=2)
    run2 = _write(tmp_path / "run2", RUN2, {"matches_ar": pa.string()},
                  drop=("schedule_s", "step_signals", "step_accepted_lengths"))
    return [run1, run2]


def _group(summary, system, temperature=0.0, task="gsm8k"):
    (row,) = [r for r in summary["rows"]
              if (r["system"], r["temperature"], r["task"]) == (system, temperature, task)]
    return row


def test_rates_speedup_and_spread(runs):
    summary = summarize(load_runs(runs))
    assert summary["input_rows"] == 10 and summary["errors"] == 1
    ar, star, hf = _group(summary, "ar"), _group(summary, "entmtp-star"), _group(summary, "hf-generate")
    assert ar["tokens_per_s"] == pytest.approx(15.0)  # not the row mean 16.67
    assert star["rows"] == 4 and star["errors"] == 1 and star["output_tokens"] == 84
    assert star["tokens_per_s"] == pytest.approx(84 / 5.1)  # not the row mean 25
    assert star["speedup_vs_ar"] == pytest.approx(84 / 5.1 / 15)
    assert star["speedup_median_paired"] == pytest.approx(2.0) and star["paired_rows"] == 3
    assert (star["row_tokens_per_s_p10"], star["row_tokens_per_s_median"], star["row_tokens_per_s_p90"]) == \
        pytest.approx((16.0, 20.0, 36.0))  # rows 15, 20, 40, linear interpolation
    assert hf["speedup_vs_ar"] == pytest.approx(10 / 15)  # AR from the other run
    assert ar["speedup_vs_ar"] == pytest.approx(1.0)
    assert star["nodes_per_step"] == pytest.approx(148 / 32) and ar["nodes_per_step"] == 1.0
    assert hf["nodes_per_step"] is None  # not recorded


def test_steps_weighted_figures(runs):
    summary = summarize(load_runs(runs))
    star = _group(summary, "entmtp-star")
    assert star["mean_accepted_length"] == pytest.approx(84 / 32)
    assert star["accepted_per_position"] == pytest.approx([22 / 32, 15.5 / 32, 8 / 32])
    assert star["tree_usage"] == pytest.approx({"wide": 26 / 32, "deep": 6 / 32})
    assert list(star["tree_usage"]) == ["wide", "deep"]  # largest share first
    assert star["switches_per_100_tokens"] == pytest.approx(100 * 2 / 84)
    assert star["schedule_share"] == pytest.approx(0.41 / 4.39)
    assert star["mean_nll"] == pytest.approx(118 / 84)
    assert star["nll_delta_vs_ar"] == pytest.approx(118 / 84 - 70 / 60)
    hf = _group(summary, "hf-generate")
    assert hf["schedule_share"] is None and hf["mean_nll"] is None and hf["signal"] is None
    medusa = _group(summary, "medusa", temperature=0.7, task="-")
    assert medusa["speedup_vs_ar"] is None and medusa["speedup_median_paired"] is None
    assert medusa["accepted_per_position"] == pytest.approx([0.6])


def test_signal_correlation_and_deciles(runs):
    signal = _group(summarize(load_runs(runs)), "entmtp-star")["signal"]
    assert signal["steps"] == 11  # c's step without a signal is skipped; b traced none
    assert signal["pearson"] == pytest.approx(-1.0)
    assert signal["spearman"] == pytest.approx(-1.0)
    # 11 steps: signal 1 x3 (average rank 2), 2 x4 (5.5), 3 x4 (9.5) -> deciles 2, 5, 9
    assert [(b["decile"], b["mean_accepted_length"], b["steps"]) for b in signal["bins"]] == \
        [(2, 3.0, 3), (5, 2.0, 4), (9, 1.0, 4)]


def test_greedy_equality(runs):
    summary = summarize(load_runs(runs))
    star = _group(summary, "entmtp-star")
    assert star["greedy_vs_ar"] == {"equal": 1, "differs": 2} and star["greedy_vs_ar_from"] == "output_token_ids"
    hf = _group(summary, "hf-generate")  # its tokens for b differ, but the benchmark proved a tie
    assert hf["greedy_vs_ar"] == {"equal": 1, "tie": 1} and hf["greedy_vs_ar_from"] == "matches_ar"
    assert _group(summary, "ar")["greedy_vs_ar"] is None
    assert _group(summary, "medusa", temperature=0.7, task="-")["greedy_vs_ar"] is None


def test_cli_writes_report(runs, tmp_path, capsys):
    out = tmp_path / "report"
    assert main([str(path) for path in runs] + ["--output", str(out)]) == 0
    report = json.loads((out / "report.json").read_text(), parse_constant=lambda name: pytest.fail(name))
    assert report["sources"] == [str(path.resolve()) for path in runs]
    assert len(report["rows"]) == 4
    assert {"system", "task", "temperature", "acceptance", "tokens_per_s", "speedup_vs_ar",
            "mean_accepted_length"} <= set(report["rows"][0])
    for name in ("tokens_per_s.png", "row_tokens_per_s.png", "acceptance_by_position.png", "accepted_vs_signal.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG"
    markdown = (out / "report.md").read_text()
    assert "How to read this report" in markdown and "![tokens_per_s.png](tokens_per_s.png)" in markdown
    assert "| entmtp-star | 4 (1 failed) | 16.5 | 16.0-36.0 | 1.10 | 2.00 | 4.6 | 2.62 | 2.4 | 9.3% |" in markdown
    assert "| wide 81%, deep 19% |" in markdown
    stdout = capsys.readouterr().out
    assert "### task gsm8k, T=0" in stdout and "| hf-generate | 2 | 10.0 |" in stdout
    assert json.loads(stdout.strip().splitlines()[-1])["errors"] == 1


def test_no_signal_no_signal_plot(runs, tmp_path):
    out = tmp_path / "report"
    assert main([str(runs[1]), "--output", str(out)]) == 0
    assert (out / "tokens_per_s.png").exists() and not (out / "accepted_vs_signal.png").exists()
    assert "Scheduling signal" not in (out / "report.md").read_text()


def test_bad_input_exits_2(tmp_path, capsys):
    assert main([str(tmp_path / "nope"), "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "nope does not exist" in err and "--output directory" in err
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"no \*\.parquet files"):
        load_runs([tmp_path / "empty"])


def test_group_of_only_failed_rows():
    failed = [_row(id=i, policy="hydra", num_output_tokens=0, steps=0, error="ValueError: prompt too long")
              for i in ("a", "b")]
    (row,) = summarize(pa.Table.from_pylist(failed, schema=OUTPUT_SCHEMA))["rows"]
    assert (row["rows"], row["errors"], row["output_tokens"]) == (2, 2, 0)
    assert row["tokens_per_s"] is None and row["row_tokens_per_s_median"] is None
    assert row["mean_accepted_length"] is None and row["greedy_vs_ar"] is None
