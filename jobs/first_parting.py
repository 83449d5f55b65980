"""Where a tree's verify first rounds unlike the one-token steps it stands for, operation by operation.

The same job as the console script `entmtp-first-parting` (entmtp_ray/jobs/first_parting.py); this file serves
`ray job submit --working-dir . -- python jobs/first_parting.py` and checkouts without an install."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout (or job working dir) first

from entmtp_ray.jobs.first_parting import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
