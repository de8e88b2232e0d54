"""`python -m specdecode.cli`: the same command as `specdecode`."""

import sys

from . import main

sys.exit(main())
