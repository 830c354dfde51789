"""``python -m quark_brevitas``: the same command line as the ``quark-brevitas`` script."""

import sys

from quark_brevitas.cli import main

sys.exit(main())
