"""`python -m iop.cli` is the `iop` command."""

import sys

from iop.cli import main

sys.exit(main())
