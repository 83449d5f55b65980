"""Build a topology bank for one (model, heads, task) on the hardware at hand.

The same job as `entmtp build-bank` (entmtp_ray/jobs/build_bank.py); this file serves
`ray job submit --working-dir . -- python jobs/build_bank.py` and checkouts without an install."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout (or job working dir) first

from entmtp_ray.jobs.build_bank import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
