"""`python -m entmtp_ray generate ...`: see cli.py."""

import sys

from .cli import main

sys.exit(main())
