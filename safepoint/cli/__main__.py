"""`python -m safepoint.cli`: the same entry point as the `safepoint` console script."""

import sys

from safepoint.cli.main import main

sys.exit(main())
