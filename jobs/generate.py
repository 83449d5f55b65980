"""Batch generation job: prompts -> Ray Data actor pool -> Parquet.

The same job as `entmtp batch` (entmtp_ray/jobs/generate.py); this file serves
`ray job submit --working-dir . -- python jobs/generate.py` and checkouts without an install."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout (or job working dir) first

from entmtp_ray.jobs.generate import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
