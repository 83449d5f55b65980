"""What --quantize costs in quality: the base model's NLL on held-out text under each scheme.

The same job as the console script `entmtp-quant-quality` (entmtp_ray/jobs/quant_quality.py); this file serves
`ray job submit --working-dir . -- python jobs/quant_quality.py` and checkouts without an install."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout (or job working dir) first

from entmtp_ray.jobs.quant_quality import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
