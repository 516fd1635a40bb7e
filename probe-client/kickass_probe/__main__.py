"""`python -m kickass_probe` is `kickass-probe`."""

import sys

from .cli import main

sys.exit(main())
