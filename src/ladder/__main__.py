"""`python -m ladder ...` is the `ladder` command (for launchers that take a module, like `torchrun -m`)."""

import sys

from ladder.cli.main import main

sys.exit(main())
