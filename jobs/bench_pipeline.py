"""Pipeline benchmark: what the Ray data plane costs, apart from decoding.

The same job as the console script `entmtp-bench-pipeline` (entmtp_ray/jobs/bench_pipeline.py); this file serves
`ray job submit --working-dir . -- python jobs/bench_pipeline.py` and checkouts without an install."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout (or job working dir) first

from entmtp_ray.jobs.bench_pipeline import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
