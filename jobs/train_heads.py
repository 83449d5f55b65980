"""Train Hydra++ heads for a base model (base frozen, soft cross-entropy against its own

The same job as `entmtp train-heads` (entmtp_ray/jobs/train_heads.py); this file serves
`ray job submit --working-dir . -- python jobs/train_heads.py` and checkouts without an install."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout (or job working dir) first

from entmtp_ray.jobs.train_heads import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
