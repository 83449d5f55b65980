"""Rank the tokens of the heads' training text by frequency and save the ranking beside the heads.

The same job as `entmtp train-heads draft-vocab` (entmtp_ray/jobs/draft_vocab.py); this file serves
`ray job submit --working-dir . -- python jobs/draft_vocab.py` and checkouts without an install."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout (or job working dir) first

from entmtp_ray.jobs.draft_vocab import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
