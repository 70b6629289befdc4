"""`python -m heron`: the `heron` command."""

import sys

from heron.entrypoints.cli import main

sys.exit(main())
