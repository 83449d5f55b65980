"""Self-distillation data for head training: the base model's own greedy replies to the `tune`

The same job as `entmtp train-heads distill-data` (entmtp_ray/jobs/distill_data.py); this file serves
`ray job submit --working-dir . -- python jobs/distill_data.py` and checkouts without an install."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout (or job working dir) first

from entmtp_ray.jobs.distill_data import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
