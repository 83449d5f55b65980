"""`python -m entmtp_ray <command> ...`, the same as the console script `entmtp`: see commands.py."""

import sys

from entmtp_ray.commands import main

sys.exit(main())
