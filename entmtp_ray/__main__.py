"""`python -m entmtp_ray generate ...` and `python -m entmtp_ray eval-heads ...`: see cli.py."""

import sys

from entmtp_ray.cli import main

sys.exit(main())
