"""`python -m orca_jax.cli ...`: the same as the `orca-jax` script."""

import sys

from orca_jax.cli.commands import main

sys.exit(main())
