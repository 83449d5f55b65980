"""Throughput report of one or more runs: Markdown, JSON and PNG plots.

    python jobs/report.py runs/gsm8k-ar runs/gsm8k-entmtp --output reports/gsm8k

Each RUN_DIR is a run's --output directory of Parquet parts (jobs/generate.py or the benchmark).
Writes DIR/report.md, DIR/report.json and DIR/*.png, prints the throughput tables and ends with one
JSON line. A missing or empty run directory exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


from entmtp_ray.bench.report import throughput_tables, write_report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="a run's --output directory of *.parquet")
    parser.add_argument("--output", required=True, metavar="DIR",
                        help="directory for report.md, report.json and the plots (created if missing)")
    args = parser.parse_args(argv)
    try:
        report = write_report(args.runs, args.output)
    except (OSError, ValueError) as exc:  # FileNotFoundError is an OSError
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(throughput_tables(report), flush=True)
    output = Path(args.output).resolve()
    print(json.dumps({"report": str(output / "report.md"), "groups": len(report["rows"]),
                      "rows": report["input_rows"], "errors": report["errors"]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
