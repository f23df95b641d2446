"""``python -m tpucompile``: the same command line as the ``tpucompile`` script."""

import sys

from tpucompile.cli import main

sys.exit(main())
