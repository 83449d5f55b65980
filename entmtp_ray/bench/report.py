"""Runs -> throughput report: per (task, system, temperature, acceptance) rates, speedup over AR,
accepted length, scheduling cost, signal correlation and losslessness, as JSON, Markdown and PNGs.

Reads the Parquet of records.OUTPUT_SCHEMA (plus the benchmark's optional `output_nll` and
`matches_ar`); knows nothing about models or Ray. Everything is vectorised over Arrow and pandas
(groupby, exploded list columns): on 2 cores a million rows take about 3 s, plus about 0.4 s per
million traced steps (ranking the signal). Failed rows (`error` set) are counted in `rows` and
`errors` and excluded from every rate and mean.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
import pyarrow.parquet as pq
from matplotlib.figure import Figure

from entmtp_ray.pipeline.sources import Location

KEYS = ["task", "policy", "temperature", "acceptance"]  # one report row per group
SAME_PROMPT = ["task", "temperature", "id"]  # how a row finds its AR counterpart
REQUIRED = ("id", "policy", "temperature", "num_output_tokens", "total_s", "tokens_per_s", "error")
OPTIONAL = ("task", "acceptance", "steps", "verified_nodes", "mean_accepted_length", "accepted_per_position",
            "tree_usage", "tree_switches", "step_accepted_lengths", "step_signals", "decode_s", "schedule_s",
            "output_token_ids", "output_nll", "matches_ar")
SCALARS = ("id", "task", "policy", "temperature", "acceptance", "num_output_tokens", "steps", "verified_nodes",
           "mean_accepted_length", "tree_switches", "decode_s", "schedule_s", "total_s", "tokens_per_s",
           "output_nll", "matches_ar", "error")
SYSTEM_ORDER = ("ar", "hydra", "medusa", "entmtp-star", "entmtp-ladder", "entmtp-tau", "fixed",
                "hf-generate", "hf-prompt-lookup", "llama-cpp")  # table order; others follow by name
QUANTILES = {"p10": 0.1, "p25": 0.25, "median": 0.5, "p75": 0.75, "p90": 0.9}  # of per-row tokens/s
GROUP_FIGURES = ("rows", "errors", "output_tokens", "steps", "tokens_per_s",
                 *(f"row_tokens_per_s_{name}" for name in QUANTILES), "speedup_vs_ar", "speedup_median_paired",
                 "paired_rows", "nodes_per_step", "mean_accepted_length", "switches_per_100_tokens",
                 "schedule_share", "mean_nll", "nll_delta_vs_ar")  # the scalar figures of a report row
COUNTS = {"rows", "errors", "output_tokens", "steps", "paired_rows"}
SIGNAL_BINS = 10  # deciles of the signal, as in the EntMTP paper's Figure 3

HOW_TO_READ = """\
How to read this report. One line per system (decoding policy or baseline) on one task at one
temperature, pooled over all runs given. `tokens/s` is the aggregate rate: all output tokens over
all row time, prefill included, so long rows weigh more than short ones; `p10-p90 row tok/s` is the
spread of the per-row rates. `x AR` divides the aggregate rate by AR's on the same task and
temperature; `x AR median paired` is the median, over prompts both ran, of the per-prompt ratio to
AR (robust to a few slow rows and to different prompt sets). `tau` is the mean accepted length:
tokens committed per draft-verify step, the bonus token included, so AR has tau 1.
`nodes/step` is the tree size verified per step (1 for AR). `switches/100 tok` counts tree changes;
`scheduler share` is the part of decode time spent choosing trees and computing the signal. `NLL`
is the base model's mean per-token negative log-likelihood of the outputs (nats), with its difference
to AR's. `greedy = AR` (temperature 0) counts outputs equal
to AR's for the same prompt (a tie is a float tie broken differently, proven by the benchmark).
Failed rows count in `rows` but in no rate."""


def load_runs(paths) -> pa.Table:
    """The columns the report reads, from every run's output (a folder or a URI, as the job's --output), as one
    table (a column a run lacks is null)."""
    paths = [paths] if isinstance(paths, (str, Path)) else paths
    tables = [_load_run(str(path)) for path in paths]
    if not tables:
        raise ValueError("no run directories given; pass the --output directory of one or more runs")
    return pa.concat_tables(tables, promote_options="permissive")


def _load_run(path: str) -> pa.Table:
    location = Location.of(path)
    if not location.exists():
        raise FileNotFoundError(f"run directory {path} does not exist; pass the --output directory of a "
                                "generate or benchmark run")
    files = location.parquet_files()
    if not files:
        raise ValueError(f"{path} holds no *.parquet files; pass the directory a run wrote its Parquet "
                         "parts into (its --output), not a file or a parent directory")
    # part files of a resumed run may differ in their optional columns
    fs = location.filesystem
    schema = pa.unify_schemas([pq.read_schema(file, filesystem=fs) for file in files], promote_options="permissive")
    missing = [name for name in REQUIRED if name not in schema.names]
    if missing:
        raise ValueError(f"{path}: columns {missing} missing; expected the output schema of "
                         "entmtp_ray/pipeline/records.py (jobs/generate.py or the benchmark writes it)")
    columns = [name for name in REQUIRED + OPTIONAL if name in schema.names]
    return pads.dataset(files, schema=schema, filesystem=fs, format="parquet").to_table(columns=columns)


def summarize(table: pa.Table) -> dict:
    """report.json without its sources: {"input_rows", "errors", "rows": [one dict per group]}."""
    frame = _row_frame(table)
    groups = _group_scalars(frame)
    per_position = _accepted_per_position(table, frame, groups)
    tree_shares = _tree_shares(table, frame)
    signal = _signal_correlation(table, frame)
    greedy = _greedy_vs_ar(table, frame)
    rows = []
    for gid, group in groups.iterrows():  # one iteration per group, not per row
        row = {"system": group["policy"], "task": group["task"], "temperature": _number(group["temperature"]),
               "acceptance": group["acceptance"]}
        row.update({name: _number(group[name], name in COUNTS) for name in GROUP_FIGURES})
        row["accepted_per_position"] = per_position.get(gid)
        row["tree_usage"] = tree_shares.get(gid)
        row["signal"] = signal.get(gid)
        row["greedy_vs_ar"], row["greedy_vs_ar_from"] = greedy.get(gid, (None, None))
        rows.append(row)
    return {"input_rows": table.num_rows, "errors": int((~frame["good"]).sum()), "rows": rows}


def _row_frame(table: pa.Table) -> pd.DataFrame:
    """The scalar columns, one line per row, with `good` (no error) and `gid` (its group's number)."""
    frame = table.select([name for name in SCALARS if name in table.column_names]).to_pandas()
    frame = frame.reindex(columns=list(SCALARS))  # absent optional columns -> all missing
    frame[["task", "acceptance"]] = frame[["task", "acceptance"]].astype(object).fillna("-")
    frame["good"] = frame["error"].isna()
    frame["gid"] = frame.groupby(KEYS, sort=False, dropna=False).ngroup()
    return frame


def _group_scalars(frame: pd.DataFrame) -> pd.DataFrame:
    """Per group (index gid, in report order): counts, pooled rates and their ratios to AR."""
    good = frame[frame["good"]].assign(
        tau_weight=lambda f: f["mean_accepted_length"] * f["steps"],
        nll_weight=lambda f: f["output_nll"] * f["num_output_tokens"],
        node_steps=lambda f: f["steps"].where(f["verified_nodes"].notna()),
        nll_tokens=lambda f: f["num_output_tokens"].where(f["output_nll"].notna()),
        scheduled_decode_s=lambda f: f["decode_s"].where(f["schedule_s"].notna()),
    )
    by_group = frame.groupby("gid")
    groups = by_group[KEYS].first()
    groups["rows"] = by_group.size()
    groups["errors"] = groups["rows"] - by_group["good"].sum()
    sums = good.groupby("gid")[["num_output_tokens", "total_s", "steps", "verified_nodes", "node_steps",
                                "tau_weight", "tree_switches",
                                "schedule_s", "scheduled_decode_s", "nll_weight", "nll_tokens"]].sum(min_count=1)
    groups = groups.join(sums)
    groups["output_tokens"] = groups["num_output_tokens"].fillna(0)
    groups["tokens_per_s"] = groups["num_output_tokens"] / groups["total_s"]
    quantiles = good.groupby("gid")["tokens_per_s"].quantile(list(QUANTILES.values())).unstack()
    quantiles = quantiles.reindex(index=groups.index, columns=list(QUANTILES.values()))  # a group may have no good row
    groups[[f"row_tokens_per_s_{name}" for name in QUANTILES]] = quantiles.to_numpy()
    groups["mean_accepted_length"] = groups["tau_weight"] / groups["steps"]
    groups["nodes_per_step"] = groups["verified_nodes"] / groups["node_steps"]  # tree size verified per step
    groups["switches_per_100_tokens"] = 100 * groups["tree_switches"] / groups["num_output_tokens"]
    groups["schedule_share"] = groups["schedule_s"] / groups["scheduled_decode_s"]
    groups["mean_nll"] = groups["nll_weight"] / groups["nll_tokens"]
    groups = _versus_ar(groups, good)
    order = groups["policy"].map({name: rank for rank, name in enumerate(SYSTEM_ORDER)}).fillna(len(SYSTEM_ORDER))
    return groups.assign(order=order).sort_values(["task", "temperature", "order", "policy", "acceptance"])


def _versus_ar(groups: pd.DataFrame, good: pd.DataFrame) -> pd.DataFrame:
    """Speedup and NLL delta against AR's rows with the same task and temperature (AR pooled over acceptance)."""
    ar = good[good["policy"] == "ar"]
    reference = ar.groupby(["task", "temperature"])[["num_output_tokens", "total_s", "nll_weight",
                                                     "nll_tokens"]].sum(min_count=1)
    reference = pd.DataFrame({"ar_tokens_per_s": reference["num_output_tokens"] / reference["total_s"],
                              "ar_nll": reference["nll_weight"] / reference["nll_tokens"]})
    groups = groups.join(reference, on=["task", "temperature"])
    groups["speedup_vs_ar"] = groups["tokens_per_s"] / groups["ar_tokens_per_s"]
    groups["nll_delta_vs_ar"] = groups["mean_nll"] - groups["ar_nll"]
    ar_rows = ar.drop_duplicates(SAME_PROMPT)[SAME_PROMPT + ["tokens_per_s"]]  # a resumed run may repeat ids
    paired = good[SAME_PROMPT + ["gid", "tokens_per_s"]].merge(ar_rows, on=SAME_PROMPT, suffixes=("", "_ar"))
    ratio = (paired["tokens_per_s"] / paired["tokens_per_s_ar"]).replace([np.inf, -np.inf], np.nan)
    groups["speedup_median_paired"] = ratio.groupby(paired["gid"]).median()
    groups["paired_rows"] = paired.groupby("gid").size().reindex(groups.index).fillna(0)
    return groups


def _explode(column: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray, pa.Array]:
    """(row, position, value) of every element of a list column: [elements] each.

    Values behind null lists come too (Arrow may back a null with a non-empty span), so callers mask rows.
    """
    array = column.combine_chunks()
    if pa.types.is_map(array.type):  # list_parent_indices has no map kernel; a map is a list of structs
        array = array.cast(pa.list_(pa.struct([("key", array.type.key_type), ("value", array.type.item_type)])))
    offsets = array.offsets.to_numpy()  # [rows + 1], not rebased when the array is a slice
    rows = pc.list_parent_indices(array).to_numpy()
    positions = np.arange(offsets[0], offsets[-1]) - offsets[rows]
    return rows, positions, array.values.slice(offsets[0], offsets[-1] - offsets[0])


def _valid(table: pa.Table, name: str) -> np.ndarray:
    return table.column(name).is_valid().to_numpy(zero_copy_only=False)  # [rows]


def _accepted_per_position(table: pa.Table, frame: pd.DataFrame, groups: pd.DataFrame) -> dict:
    """gid -> steps-weighted fraction of steps accepting depth i+1, shorter rows padded with 0.0."""
    if "accepted_per_position" not in table.column_names:
        return {}
    rows, positions, values = _explode(table.column("accepted_per_position"))
    keep = (frame["good"].to_numpy() & _valid(table, "accepted_per_position"))[rows]
    steps = frame["steps"].fillna(0).to_numpy()
    weighted = pd.DataFrame({"gid": frame["gid"].to_numpy()[rows][keep], "position": positions[keep],
                             "weight": (values.to_numpy(zero_copy_only=False) * steps[rows])[keep]})
    sums = weighted.groupby(["gid", "position"])["weight"].sum().unstack(fill_value=0.0)
    shares = sums.div(groups["steps"].reindex(sums.index), axis=0)
    depth = weighted.groupby("gid")["position"].max() + 1  # the group's own deepest position
    return {gid: [float(x) for x in shares.loc[gid].iloc[:depth[gid]]]
            for gid in shares.index if groups.at[gid, "steps"] > 0}


def _tree_shares(table: pa.Table, frame: pd.DataFrame) -> dict:
    """gid -> {tree: share of the group's steps}, largest first."""
    if "tree_usage" not in table.column_names:
        return {}
    rows, _, entries = _explode(table.column("tree_usage"))
    keep = (frame["good"].to_numpy() & _valid(table, "tree_usage"))[rows]
    usage = pd.DataFrame({"gid": frame["gid"].to_numpy()[rows][keep],
                          "tree": entries.field("key").filter(keep).dictionary_encode().to_pandas(),
                          "steps": entries.field("value").to_numpy(zero_copy_only=False)[keep]})
    steps = usage.groupby(["gid", "tree"], observed=True)["steps"].sum()
    shares = (steps / steps.groupby(level="gid").transform("sum")).sort_values(ascending=False)
    return {gid: {str(tree): float(share) for tree, share in part.droplevel("gid").items()}
            for gid, part in shares.groupby(level="gid")}


def _signal_correlation(table: pa.Table, frame: pd.DataFrame) -> dict:
    """gid -> Pearson and Spearman correlation of each step's signal with its accepted length, and
    mean accepted length per signal decile; only for groups whose rows traced the signal."""
    if not {"step_signals", "step_accepted_lengths"} <= set(table.column_names):
        return {}
    signals, accepted = table.column("step_signals"), table.column("step_accepted_lengths")
    aligned = pc.equal(pc.list_value_length(signals), pc.list_value_length(accepted)).fill_null(False)
    traced = frame["good"].to_numpy() & aligned.to_numpy(zero_copy_only=False)  # [rows]
    gids = frame["gid"].to_numpy()
    figures = {}
    for gid in np.unique(gids[traced]):  # one iteration per group; a groupby rank over all steps is slower
        mask = traced & (gids == gid)  # [rows]; non-null lists of equal lengths, so the elements align
        steps = pd.DataFrame({"signal": pc.list_flatten(signals.filter(mask)).to_numpy(zero_copy_only=False),
                              "accepted": pc.list_flatten(accepted.filter(mask)).to_numpy(zero_copy_only=False)})
        steps = steps.dropna()  # a step without a signal (or accepted length) is skipped
        if len(steps):
            figures[int(gid)] = _signal_figures(steps)
    return figures


def _signal_figures(steps: pd.DataFrame) -> dict:
    """One group's steps -> correlations and mean accepted length per signal decile."""
    rank = steps["signal"].rank()  # [steps], average ranks: tied signals share a decile
    decile = ((rank - 0.5) * SIGNAL_BINS // len(steps)).astype(int) + 1  # the 0.5 keeps equal bins exact
    bins = steps.groupby(decile.rename("decile")).agg(
        signal_min=("signal", "min"), signal_max=("signal", "max"),
        mean_accepted_length=("accepted", "mean"), steps=("accepted", "size"))
    return {"steps": len(steps), "pearson": _number(steps["signal"].corr(steps["accepted"])),
            "spearman": _number(rank.corr(steps["accepted"].rank())),  # Spearman = Pearson of the ranks
            "bins": bins.reset_index().to_dict("records")}


def _greedy_vs_ar(table: pa.Table, frame: pd.DataFrame) -> dict:
    """gid -> (counts, source) for non-AR systems at temperature 0: the benchmark's `matches_ar` values
    where a group has any, else equal/differs of output_token_ids against AR's row for the same prompt.
    Rows with no AR counterpart (or a null `matches_ar`) are not counted."""
    greedy = frame[frame["good"] & (frame["temperature"] == 0) & (frame["policy"] != "ar")]
    flagged = greedy["matches_ar"].notna().groupby(greedy["gid"]).transform("any")
    counts = greedy[flagged].groupby(["gid", "matches_ar"]).size()
    result = {gid: ({str(k): int(v) for k, v in part.droplevel("gid").items()}, "matches_ar")
              for gid, part in counts.groupby(level="gid")}
    if "output_token_ids" not in table.column_names:
        return result
    ar = frame[frame["good"] & (frame["temperature"] == 0) & (frame["policy"] == "ar")]
    pairs = greedy[~flagged][SAME_PROMPT + ["gid"]].reset_index(names="row").merge(
        ar.drop_duplicates(SAME_PROMPT)[SAME_PROMPT].reset_index(names="ar_row"), on=SAME_PROMPT)
    if pairs.empty:
        return result
    tokens = table.column("output_token_ids")
    ours, theirs = tokens.take(pairs["row"].to_numpy()), tokens.take(pairs["ar_row"].to_numpy())
    same_length = pc.equal(pc.list_value_length(ours), pc.list_value_length(theirs)).fill_null(False)
    same_length = same_length.to_numpy(zero_copy_only=False)  # [pairs]
    rows, _, our_tokens = _explode(ours.filter(same_length))
    _, _, their_tokens = _explode(theirs.filter(same_length))
    differs = pc.not_equal(our_tokens, their_tokens).fill_null(True).to_numpy(zero_copy_only=False)
    differing = np.unique(rows[differs])
    equal = same_length.copy()
    equal[np.flatnonzero(same_length)[differing]] = False
    outcome = pd.Series(np.where(equal, "equal", "differs")).groupby(pairs["gid"]).value_counts()
    result.update({gid: ({str(k): int(v) for k, v in part.droplevel("gid").items()}, "output_token_ids")
                   for gid, part in outcome.groupby(level="gid")})
    return result


def _number(value, count: bool = False):
    """A JSON number, or None for NaN, inf and missing; `count` makes it an int."""
    if value is None or pd.isna(value) or math.isinf(value):
        return None
    return int(value) if count or isinstance(value, (int, np.integer)) else float(value)


def write_report(paths, output_dir, setup: dict | None = None) -> dict:
    """Load the runs, summarize them, write report.json, report.md and the PNGs; returns report.json's content.

    `setup`: how the runs were made (the benchmark's machine, threads, weight-read floor), kept under
    "setup" in report.json and listed in report.md."""
    paths = [paths] if isinstance(paths, (str, Path)) else paths
    table = load_runs(paths)
    report = {"sources": [str(Path(path).resolve()) for path in paths], **({"setup": setup} if setup else {}),
              **summarize(table)}
    output = Path(output_dir)
    output.mkdir(parents=True, exist_ok=True)
    (output / "report.json").write_text(json.dumps(report, indent=1, allow_nan=False) + "\n")
    plots = _write_plots(report["rows"], output)
    (output / "report.md").write_text(_markdown(report, plots))
    return report


# ---- Markdown ------------------------------------------------------------------------------------

def _fmt(value, spec: str = ".2f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _panels(rows: list[dict]) -> dict:
    """(task, temperature) -> [(label, row)]: the label is the system, with the acceptance where a panel mixes them."""
    panels: dict = {}
    for row in rows:
        panels.setdefault((row["task"], row["temperature"]), []).append(row)
    labelled = {}
    for key, panel in panels.items():
        mixed = len({row["acceptance"] for row in panel}) > 1
        labelled[key] = [(f"{row['system']} ({row['acceptance']})" if mixed else row["system"], row) for row in panel]
    return labelled


def _table(header: list[str], lines: list[list[str]]) -> str:
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
                     + ["| " + " | ".join(line) + " |" for line in lines])


def _throughput_line(label: str, row: dict) -> list[str]:
    failed = f" ({row['errors']} failed)" if row["errors"] else ""
    spread = ("-" if row["row_tokens_per_s_p10"] is None
              else f"{row['row_tokens_per_s_p10']:.1f}-{row['row_tokens_per_s_p90']:.1f}")
    share = None if row["schedule_share"] is None else 100 * row["schedule_share"]
    nll = "-" if row["mean_nll"] is None else f"{row['mean_nll']:.3f} ({_fmt(row['nll_delta_vs_ar'], '+.3f')})"
    counts = row["greedy_vs_ar"] or {}
    compared = sum(counts.get(k, 0) for k in ("equal", "tie", "differs"))  # e.g. llama.cpp's are "not compared"
    greedy = ("-" if not counts else ", ".join(counts) if not compared
              else f"{counts.get('equal', 0)}/{compared}" + (f" ({counts['tie']} tie)" if counts.get("tie") else ""))
    return [label, f"{row['rows']}{failed}", _fmt(row["tokens_per_s"], ".1f"), spread, _fmt(row["speedup_vs_ar"]),
            _fmt(row["speedup_median_paired"]), _fmt(row["nodes_per_step"], ".1f"), _fmt(row["mean_accepted_length"]),
            _fmt(row["switches_per_100_tokens"], ".1f"), _fmt(share, ".1f", "%"), nll, greedy]


def throughput_tables(report: dict) -> str:
    """The Markdown throughput table of each (task, temperature): what jobs/report.py prints."""
    header = ["system", "rows", "tokens/s", "p10-p90 row tok/s", "x AR", "x AR median paired", "nodes/step", "tau",
              "switches/100 tok", "scheduler share", "NLL (delta vs AR)", "greedy = AR"]
    return "\n\n".join(f"### task {task}, T={temperature:g}\n\n"
                       + _table(header, [_throughput_line(label, row) for label, row in panel])
                       for (task, temperature), panel in _panels(report["rows"]).items())


def _markdown(report: dict, plots: list[str]) -> str:
    labelled = [(label, row) for panel in _panels(report["rows"]).values() for label, row in panel]
    parts = ["# Throughput report", HOW_TO_READ,
             "Sources: " + ", ".join(f"`{source}`" for source in report["sources"])
             + f" ({report['input_rows']} rows, {report['errors']} failed).",
             *(["Setup: " + "; ".join(f"{key} {value}" for key, value in report["setup"].items()) + "."]
               if report.get("setup") else []),
             "## Throughput", throughput_tables(report)]
    deep = [(label, row) for label, row in labelled if row["accepted_per_position"]]
    if deep:
        depth = max(len(row["accepted_per_position"]) for _, row in deep)
        lines = [[row["task"], f"{row['temperature']:g}", label]
                 + [_fmt(share) for share in row["accepted_per_position"]]
                 + [""] * (depth - len(row["accepted_per_position"])) for label, row in deep]
        parts += ["## Acceptance by draft depth",
                  "Steps-weighted fraction of steps whose draft token at depth d was accepted.",
                  _table(["task", "T", "system"] + [f"d={d + 1}" for d in range(depth)], lines)]
    switching = [(label, row) for label, row in labelled if row["tree_usage"] and len(row["tree_usage"]) > 1]
    if switching:
        lines = [[row["task"], f"{row['temperature']:g}", label,
                  ", ".join(f"{tree} {100 * share:.0f}%" for tree, share in row["tree_usage"].items()),
                  _fmt(row["switches_per_100_tokens"], ".1f")] for label, row in switching]
        parts += ["## Tree usage", "Share of steps per tree, for systems that used more than one.",
                  _table(["task", "T", "system", "trees (share of steps)", "switches/100 tok"], lines)]
    traced = [(label, row) for label, row in labelled if row["signal"]]
    if traced:
        lines = [[row["task"], f"{row['temperature']:g}", label, str(row["signal"]["steps"]),
                  _fmt(row["signal"]["pearson"]), _fmt(row["signal"]["spearman"]),
                  " ".join(_fmt(b["mean_accepted_length"]) for b in row["signal"]["bins"])] for label, row in traced]
        parts += ["## Scheduling signal vs accepted length",
                  ("Correlation of the signal before each step with that step's accepted length, and the mean "
                   "accepted length per signal decile, lowest signal first (with entropy it should fall)."),
                  _table(["task", "T", "system", "steps", "Pearson", "Spearman", "tau by signal decile"], lines)]
    parts += ["## Plots"] + [f"![{name}]({name})" for name in plots]
    return "\n\n".join(parts) + "\n"


# ---- plots ---------------------------------------------------------------------------------------

def _figure(panels: dict, width: float) -> tuple[Figure, list]:
    """One axes per (task, temperature) panel, at most 3 to a line, titled."""
    columns = min(3, len(panels))
    figure = Figure(figsize=(width * columns, 3.8 * math.ceil(len(panels) / columns)), layout="constrained")
    axes = figure.subplots(math.ceil(len(panels) / columns), columns, squeeze=False).ravel()
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    for ax, (task, temperature) in zip(axes, panels):
        ax.set_title(f"task {task}, T={temperature:g}")
    return figure, list(axes[:len(panels)])


def _values(panel: list, name: str) -> np.ndarray:
    return np.array([np.nan if row[name] is None else row[name] for _, row in panel], dtype=float)  # [systems]


def _write_plots(rows: list[dict], output: Path) -> list[str]:
    """Write the PNGs (Agg canvas, no pyplot state); returns their file names."""
    panels = _panels(rows)
    width = 1.5 + 0.7 * max(len(panel) for panel in panels.values())
    figure, axes = _figure(panels, width)
    for ax, panel in zip(axes, panels.values()):
        x = np.arange(len(panel))
        median = _values(panel, "row_tokens_per_s_median")
        ax.bar(x, _values(panel, "tokens_per_s"), label="aggregate")
        ax.errorbar(x, median, yerr=[median - _values(panel, "row_tokens_per_s_p10"),
                                     _values(panel, "row_tokens_per_s_p90") - median],
                    fmt="o", color="black", capsize=3, label="row median, p10-p90")
        ax.set_xticks(x, [label for label, _ in panel], rotation=35, ha="right")
        ax.set_ylabel("output tokens/s")
    axes[0].legend(fontsize="small")
    figure.savefig(output / "tokens_per_s.png", dpi=110)
    written = ["tokens_per_s.png"]

    figure, axes = _figure(panels, width)
    for ax, panel in zip(axes, panels.values()):
        boxes = [{"label": label, "med": row["row_tokens_per_s_median"], "q1": row["row_tokens_per_s_p25"],
                  "q3": row["row_tokens_per_s_p75"], "whislo": row["row_tokens_per_s_p10"],
                  "whishi": row["row_tokens_per_s_p90"], "fliers": []}
                 for label, row in panel if row["row_tokens_per_s_median"] is not None]
        if boxes:
            ax.bxp(boxes)
            ax.tick_params(axis="x", labelrotation=35)
        ax.set_ylabel("row tokens/s")
    figure.suptitle("per-row tokens/s: box p25-p75, line median, whiskers p10-p90")
    figure.savefig(output / "row_tokens_per_s.png", dpi=110)
    written.append("row_tokens_per_s.png")

    figure, axes = _figure(panels, 5.0)
    for ax, panel in zip(axes, panels.values()):
        for label, row in panel:
            if row["accepted_per_position"]:
                depth = np.arange(1, len(row["accepted_per_position"]) + 1)
                ax.plot(depth, row["accepted_per_position"], marker="o", label=label)
        ax.set(xlabel="draft depth", ylabel="fraction of steps accepted", ylim=(0, 1))
        if ax.lines:
            ax.set_xticks(range(1, max(len(line.get_xdata()) for line in ax.lines) + 1))
            ax.legend(fontsize="small")
    figure.savefig(output / "acceptance_by_position.png", dpi=110)
    written.append("acceptance_by_position.png")

    traced = {key: [(label, row) for label, row in panel if row["signal"]] for key, panel in panels.items()}
    traced = {key: panel for key, panel in traced.items() if panel}
    if traced:
        figure, axes = _figure(traced, 5.0)
        for ax, panel in zip(axes, traced.values()):
            for label, row in panel:
                bins = row["signal"]["bins"]
                ax.plot([b["decile"] for b in bins], [b["mean_accepted_length"] for b in bins], marker="o",
                        label=f"{label} (Pearson {_fmt(row['signal']['pearson'])})")
            ax.set(xlabel=f"signal decile (1 = lowest of {SIGNAL_BINS})", ylabel="mean accepted length",
                   xticks=range(1, SIGNAL_BINS + 1))
            ax.legend(fontsize="small")
        figure.savefig(output / "accepted_vs_signal.png", dpi=110)
        written.append("accepted_vs_signal.png")
    return written
