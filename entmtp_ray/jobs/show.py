"""Print a generation run's Parquet output as a short table, and how to read it yourself.

    python jobs/show.py runs/demo-humaneval
    python jobs/show.py s3://bucket/labels
"""

from __future__ import annotations

import sys

import pandas as pd
import pyarrow.dataset as pads

from entmtp_ray.pipeline.sources import Location

COLUMNS = ["id", "num_output_tokens", "finish_reason", "mean_accepted_length", "tokens_per_s", "error"]


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print("usage: entmtp show RUN_DIR\n\n" + __doc__, file=sys.stderr if len(argv) != 1 else sys.stdout)
        return 2 if len(argv) != 1 else 0
    path = argv[0]
    location = Location.of(path)
    files = location.parquet_files()
    if not files:
        print(f"error: {path} holds no Parquet files; pass a run's --output", file=sys.stderr)
        return 2
    frame = pads.dataset(files, filesystem=location.filesystem, format="parquet").to_table().to_pandas()
    frame["error"] = frame["error"].fillna("-")
    samples = "sample_index" in frame.columns and frame["sample_index"].max() > 0  # --n: several rows per id
    columns = COLUMNS[:1] + ["sample_index"] + COLUMNS[1:] if samples else COLUMNS
    with pd.option_context("display.width", 160, "display.max_colwidth", 60):
        print(frame[columns].sort_values(columns[:2] if samples else "id").to_string(index=False))
        print(f"\nfirst output ({frame.iloc[0]['id']}):\n{frame.iloc[0]['output_text']}\n")
    print(f"{len(frame)} rows, {len(frame.columns)} columns in {path}. Read them with:\n"
          f"  pandas.read_parquet('{path}')\n"
          f"  ray.data.read_parquet('{path}')")
    return 0


if __name__ == "__main__":
    sys.exit(main())
