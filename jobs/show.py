"""Print a generation run's Parquet output as a short table, and how to read it yourself.

The same job as `entmtp show` (entmtp_ray/jobs/show.py); this file serves
`ray job submit --working-dir . -- python jobs/show.py` and checkouts without an install."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout (or job working dir) first

from entmtp_ray.jobs.show import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
