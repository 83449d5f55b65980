"""The GPU path in one command: greedy exactness, CUDA graphs, the bench table, a bank build and a 2-actor Ray job.

The same job as entmtp_ray/jobs/gpu_check.py; this file serves checkouts without an install."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout (or job working dir) first

from entmtp_ray.jobs.gpu_check import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
