"""What a head-training step costs under each lever (draft vocabulary, teacher top-k, teacher cache), side by side.

The same job as the console script `entmtp-bench-train` (entmtp_ray/jobs/bench_train.py); this file serves
`ray job submit --working-dir . -- python jobs/bench_train.py` and checkouts without an install."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout (or job working dir) first

from entmtp_ray.jobs.bench_train import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
