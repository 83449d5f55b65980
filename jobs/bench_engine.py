"""Engine micro-benchmark on one machine (no Ray): same-code AR vs transformers `generate`, the

The same job as the console script `entmtp-bench-engine` (entmtp_ray/jobs/bench_engine.py); this file serves
`ray job submit --working-dir . -- python jobs/bench_engine.py` and checkouts without an install."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout (or job working dir) first

from entmtp_ray.jobs.bench_engine import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
