"""How well each scheduling signal predicts the next step's accepted length, on held-out prompts.

The same job as `entmtp signal-power` (entmtp_ray/jobs/signal_power.py); this file serves
`ray job submit --working-dir . -- python jobs/signal_power.py` and checkouts without an install."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout (or job working dir) first

from entmtp_ray.jobs.signal_power import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
