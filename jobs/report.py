"""Throughput report of one or more runs: Markdown, JSON and PNG plots.

The same job as `entmtp report` (entmtp_ray/jobs/report.py); this file serves
`ray job submit --working-dir . -- python jobs/report.py` and checkouts without an install."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout (or job working dir) first

from entmtp_ray.jobs.report import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
