"""Side-by-side benchmark: AR, transformers generate and prompt lookup, Hydra, Medusa and the EntMTP policies.

The same job as `entmtp bench` (entmtp_ray/jobs/bench.py); this file serves
`ray job submit --working-dir . -- python jobs/bench.py` and checkouts without an install."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout (or job working dir) first

from entmtp_ray.jobs.bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
