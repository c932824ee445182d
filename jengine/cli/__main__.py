"""`python -m jengine.cli ...` runs the `jengine` command."""

import sys

from jengine.cli.main import main

sys.exit(main())
